"""Model cards for the shipped pair: how each model was trained and what it measures.

Contract: ``write_cards(target_dir, drafter_dir, bench_dir)`` measures each model's loss and
perplexity on the stdlib test split, writes greedy and sampled sample completions of held-out
prompts, and takes the pair's figures (acceptance, mean accepted length, cost ratio, speedups,
the count of degenerate greedy loops) from a ``specdec bench`` run's ``summary.json``, so every
figure in a card is reproducible by a command the card names. Training histories come from the run folders' checkpoint
``state.json``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from specdec.data.prompts import code_completion_prompts
from specdec.data.stdlib import corpus_stats
from specdec.loading import load_model, load_tokenizer
from specdec.train.checkpoint import saved_run
from specdec.train.lm import stream_loss, tokenize_split

EVAL_WINDOWS = 200  # 512-token windows of the test split scored per model (about 100k tokens)


def test_split_loss(model, tok, seq_len: int = 512) -> dict[str, float]:
    """Cross-entropy (nats/token) and perplexity on the held-out test split."""
    stream = tokenize_split(tok, "test")
    loss = stream_loss(model, stream, seq_len, EVAL_WINDOWS)
    return {"test_loss": round(loss, 4), "test_perplexity": round(math.exp(loss), 2),
            "test_tokens_scored": min(EVAL_WINDOWS, (len(stream) - 1) // seq_len) * seq_len}


def samples(model, tok, n: int = 3, max_new_tokens: int = 64) -> list[dict[str, str]]:
    """Greedy and sampled (temperature 0.8, top-p 0.95) completions of held-out prompts."""
    from specdec.decode import autoregressive_generate

    out = []
    for p in code_completion_prompts(n, seed=1):
        ids = tok(p["prompt"])["input_ids"]
        greedy = autoregressive_generate(model, ids, max_new_tokens=max_new_tokens)
        sampled = autoregressive_generate(model, ids, max_new_tokens=max_new_tokens, temperature=0.8,
                                          top_p=0.95, seed=0)
        out.append({"id": p["id"], "prompt": p["prompt"], "greedy": tok.decode(greedy.tokens),
                    "sampled": tok.decode(sampled.tokens)})
    return out


def pair_figures(bench_dir: str | Path) -> dict:
    """The pair's figures from a bench run (methods plain-hf, plain, spec, spec-lookup; temperatures 0 and 1)."""
    bench = Path(bench_dir)
    summary = json.loads((bench / "summary.json").read_text())
    rows = {(r["method"], r["temperature"]): r for r in summary["rows"] if not r.get("error")}

    def rate(method: str, temperature: float) -> float | None:
        row = rows.get((method, temperature))
        return row and row["mean_tokens_per_s"]

    spec0, spec1, plain_hf0 = rows.get(("spec", 0.0), {}), rows.get(("spec", 1.0), {}), rows.get(("plain-hf", 0.0), {})

    def over_plain(method: str) -> float | None:  # greedy tokens/s over our plain decoding's
        ours, plain = rate(method, 0.0), rate("plain", 0.0)
        return ours / plain if ours and plain else None

    lookup0 = rows.get(("spec-lookup", 0.0), {})  # the CLI's default drafter: prompt lookup, then the model
    return {
        "prompts": len(summary["prompts"]),
        "max_new_tokens": summary["config"]["max_new_tokens"],
        "gamma": summary["config"]["gamma"][0],
        "greedy_alpha": spec0.get("alpha"), "greedy_tau": spec0.get("tau"),
        "sampled_alpha": spec1.get("alpha"), "sampled_tau": spec1.get("tau"),
        "cost_ratio": spec0.get("cost_ratio"),
        "greedy_speedup_vs_plain": over_plain("spec"),
        "greedy_speedup_vs_plain_hf": spec0.get("speedup"),
        "greedy_speedup_vs_plain_hf_non_loop": spec0.get("speedup_non_loop"),
        "sampled_speedup_vs_plain_hf": spec1.get("speedup"),
        "greedy_equal": f"{spec0.get('greedy_equal')}/{spec0.get('greedy_total')}",
        "lookup_greedy_speedup_vs_plain": over_plain("spec-lookup"),
        "lookup_greedy_speedup_vs_plain_hf": lookup0.get("speedup"),
        "lookup_greedy_speedup_vs_plain_hf_non_loop": lookup0.get("speedup_non_loop"),
        "lookup_sampled_speedup_vs_plain_hf": rows.get(("spec-lookup", 1.0), {}).get("speedup"),
        "lookup_greedy_equal": f"{lookup0.get('greedy_equal')}/{lookup0.get('greedy_total')}" if lookup0 else None,
        "degenerate_loops": f"{plain_hf0.get('loop_prompts')}/{plain_hf0.get('prompts')}",
        "environment": summary["environment"],
    }


def _stages(run_dir: Path) -> list[tuple[Path, dict]]:
    """The training stages that produced ``run_dir``'s model, oldest first, as (run folder, state).

    A run started with ``--init-from OTHER_RUN/final`` continues OTHER_RUN, whose state is read
    from its newest complete checkpoint's ``state.json``; the chain ends at a run without one."""
    stages: list[tuple[Path, dict]] = []
    while run_dir is not None and len(stages) < 16:
        state = saved_run(run_dir / "checkpoint")
        if state is None:
            break
        stages.insert(0, (run_dir, state))
        init = state["config"].get("init_from")
        run_dir = Path(init).parent if init and Path(init).name == "final" else None
    return stages


def _history(run_dir: Path) -> list[dict]:
    """Validation history over every stage, steps counted from the first stage's start."""
    out, offset = [], 0
    for _, state in _stages(run_dir):
        out += [{**h, "step": h["step"] + offset} for h in state["state"]["history"]]
        offset += state["config"]["max_steps"]
    return out


def _fmt(v: object, spec: str = ".3f") -> str:
    return format(v, spec) if isinstance(v, float) else str(v)


def render_card(name: str, role: str, model_dir: Path, model, lm: dict, pair: dict, run_dir: Path,
                samples_: list[dict], recipe: str) -> str:
    """The README.md of one shipped model (``model``: the one loaded from ``model_dir``)."""
    n_params = sum(p.numel() for p in model.parameters())
    cfg = model.config
    hist = _history(run_dir)
    vals = ", ".join(f"{h['step']}: {h['val_loss']:.3f}" for h in hist if "val_loss" in h)
    stats = corpus_stats()
    env = pair["environment"]
    lines = [
        f"# {name}", "",
        (f"The {role} of specdec's shipped default pair: a Llama-style causal LM for Python code, "
        "trained by this project on the Python standard library (no data or weights from a hub)."), "",
        "| | |", "|---|---|",
        f"| parameters | {n_params / 1e6:.2f}M (tied input/output embeddings) |",
        (f"| shape | hidden {cfg.hidden_size}, {cfg.num_hidden_layers} layers, {cfg.num_attention_heads} heads, "
        f"MLP {cfg.intermediate_size}, vocabulary {cfg.vocab_size}, context {cfg.max_position_embeddings} |"),
        (f"| weights | safetensors, {json.loads((model_dir / 'config.json').read_text())['dtype']} "
         "(loaded as fp32 on CPU by default) |"),
        f"| tokenizer | byte-level BPE ({cfg.vocab_size} tokens) trained on the train split; eos `<|endoftext|>` |",
        "", "## Training", "",
        f"Corpus: `*.py` files of CPython {'.'.join(map(str, __import__('sys').version_info[:3]))}'s "
        "standard library (no site-packages), split by a hash of each file's path: "
        + ", ".join(f"{s} {v['files']} files / {v['chars'] / 1e6:.1f}M characters" for s, v in stats.items())
        + ". The test split is never trained on.", "",
        recipe, "",
        f"Validation loss by step: {vals or 'n/a'}.", "",
        "## Figures", "",
        (f"Test split ({lm['test_tokens_scored']} tokens in 512-token windows): loss **{lm['test_loss']:.3f}** "
        f"nats/token, perplexity **{lm['test_perplexity']:.2f}**."), "",
        (f"With the pair, on {pair['prompts']} held-out prompts from the test split (function prefixes), "
        f"{pair['max_new_tokens']} new tokens, gamma {pair['gamma']}, {env.get('device')} "
        f"{env.get('dtype')}, {env.get('torch_threads')} threads ({env.get('device_name', '')}), "
         f"torch {env.get('torch_version')}, transformers {env.get('transformers_version')}; reproduce with "
         "`specdec bench --methods plain-hf,plain,spec,spec-lookup --temperature 0 1 --output bench-out/card`:"), "",
        "| figure | value |", "|---|---|",
        f"| greedy acceptance rate α | {_fmt(pair['greedy_alpha'])} |",
        f"| greedy mean accepted length τ (incl. recovered/bonus token) | {_fmt(pair['greedy_tau'], '.2f')} |",
        f"| sampled (temperature 1) α | {_fmt(pair['sampled_alpha'])} |",
        f"| sampled (temperature 1) τ | {_fmt(pair['sampled_tau'], '.2f')} |",
        f"| cost ratio c (drafter step / target step) | {_fmt(pair['cost_ratio'])} |",
        (f"| greedy speedup of `speculative_generate` with the drafter model alone over `autoregressive_generate` | "
        f"{_fmt(pair['greedy_speedup_vs_plain'], '.2f')}x |"),
        f"| greedy speedup over the target's own `generate` | {_fmt(pair['greedy_speedup_vs_plain_hf'], '.2f')}x |",
        f"| greedy outputs equal to plain decoding | {pair['greedy_equal']} |",
        f"| greedy outputs of plain decoding that are degenerate loops | {pair['degenerate_loops']} |",
        (f"| greedy speedup over `generate` on the other prompts (no loop) | "
         f"{_fmt(pair['greedy_speedup_vs_plain_hf_non_loop'], '.2f')}x |"),
        *([] if pair.get("lookup_greedy_speedup_vs_plain") is None else [
            (f"| with prompt lookup first, the drafter model otherwise (`--drafter lookup+code-drafter`, the "
             f"CLI's default): greedy speedup over `autoregressive_generate` | "
             f"{_fmt(pair['lookup_greedy_speedup_vs_plain'], '.2f')}x |"),
            (f"| the same, over `generate`: all prompts / no loop / sampled (temperature 1) | "
             f"{_fmt(pair['lookup_greedy_speedup_vs_plain_hf'], '.2f')}x / "
             f"{_fmt(pair['lookup_greedy_speedup_vs_plain_hf_non_loop'], '.2f')}x / "
             f"{_fmt(pair['lookup_sampled_speedup_vs_plain_hf'], '.2f')}x |"),
            f"| the same, greedy outputs equal to plain decoding | {pair['lookup_greedy_equal']} |",
        ]),
        "", ("Greedy outputs are not tuned for repetition: a small target's greedy decoding loops, and "
             "looping text is easy to draft, so acceptance on looping outputs flatters the pair. "
             "Reproduce the whole card with `specdec train card` after that bench run."), "",
        "## Samples (held-out prompts)", "",
    ]
    for s in samples_:
        lines += [f"### `{s['id']}`", "", "Prompt (end):", "", "```python",
                  "\n".join(s["prompt"].rstrip("\n").splitlines()[-6:]), "```", "",
                  "Greedy continuation:", "", "```python", s["greedy"], "```", "",
                  "Sampled (temperature 0.8, top-p 0.95):", "", "```python", s["sampled"], "```", ""]
    return "\n".join(lines) + "\n"


RECIPES = {
    "target": ("Trained from scratch with `specdec train lm --preset code-target` (next-token "
               "cross-entropy; AdamW, betas 0.9/0.95, weight decay 0.1, peak learning rate {lr}, "
               "{warmup} warm-up steps then cosine decay to 10%, {steps} steps of {batch} windows of "
               "{seq} tokens = {tokens:.1f}M tokens, bf16 autocast, on this project's 2-core CPU)."),
    "drafter": ("Distilled from the target with `specdec train lm --preset code-drafter --teacher ...`: "
                "loss = {kd} x KL(p_target || q_drafter) + {ce} x cross-entropy; AdamW, peak learning "
                "rate {lr}, {steps} steps of {batch} windows of {seq} tokens = {tokens:.1f}M tokens, "
                "bf16 autocast, CPU."),
    "continued": ("continued from `{init}` with `--init-from` (fresh AdamW state, batch seed {seed}, so "
                  "new windows of the train split{data}): {loss}{teacher}, peak learning rate {lr}, {warmup} "
                  "warm-up steps then cosine decay to 10%, {steps} steps of {batch} windows of {seq} "
                  "tokens = {tokens:.1f}M tokens, bf16 autocast, CPU."),
}


def _recipe(role: str, run_dir: Path) -> str:
    """How the model was trained: one paragraph per stage (a continuation names its start)."""
    parts = []
    for i, (stage_dir, state) in enumerate(_stages(run_dir)):
        cfg = state["config"]
        tokens = cfg["max_steps"] * cfg["batch_size"] * cfg["seq_len"] / 1e6
        text = RECIPES[role if i == 0 else "continued"].format(
            lr=cfg["lr"], warmup=cfg["warmup_steps"], steps=cfg["max_steps"], batch=cfg["batch_size"],
            seq=cfg["seq_len"], tokens=tokens, kd=cfg["kd_weight"], ce=round(1 - cfg["kd_weight"], 2),
            init=cfg.get("init_from"), seed=cfg["seed"],
            loss=("the same distillation loss" if cfg.get("teacher") else "next-token cross-entropy"),
            teacher=f" (teacher `{cfg['teacher']}`)" if cfg.get("teacher") else "",
            data=(f"; {cfg['outputs_share']:.0%} of each batch's windows from `{cfg['outputs']}`, the "
                  "target's own continuations of train-split function prefixes written by `specdec train "
                  "outputs` (those ending in a loop left out)" if cfg.get("outputs") else ""))
        parts.append(f"Stage {i + 1} (`{stage_dir.name}`): {text}")
    return "\n\n".join(parts)


def write_cards(target_dir: str | Path, drafter_dir: str | Path, bench_dir: str | Path,
                target_run: str | Path, drafter_run: str | Path) -> dict:
    """Measure and write README.md into both model folders; return the figures."""
    torch.manual_seed(0)
    pair = pair_figures(bench_dir)
    figures = {"pair": {k: v for k, v in pair.items() if k != "environment"}}
    for name, role, model_dir, run_dir in (("code-target", "target", target_dir, target_run),
                                           ("code-drafter", "drafter", drafter_dir, drafter_run)):
        model = load_model(str(model_dir), dtype="fp32")
        tok = load_tokenizer(str(model_dir))
        lm = test_split_loss(model, tok)
        figures[name] = lm
        card = render_card(name, role, Path(model_dir), model, lm, pair, Path(run_dir), samples(model, tok),
                           _recipe(role, Path(run_dir)))
        (Path(model_dir) / "README.md").write_text(card, encoding="utf-8")
    return figures
