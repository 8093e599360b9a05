"""Architecture sweep (issue 25): is specdec's greedy output each architecture's own ``generate`` output?

For every model type in transformers' ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` and
``MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES``, each in its own subprocess (one torch thread,
a timeout, so a hang or a crash stops only that model):

1. Build it tiny from its default config: every width, layer count, head count, expert count,
   vocabulary and window shrunk by one generic rule over the config's fields (sub-configs too;
   per-layer lists and ``per_layer_config`` cut to one layer of each kind), random weights, seed 0.
   Relations of the default kept: head dimensions equal in it stay equal (``HEAD_DIMS``), a field it
   leaves None though the model reads it gets its usual meaning (``NONE_MEANS``). Types whose fields
   depend on each other beyond that, or whose default config transformers cannot build (a field its
   model reads that the config never sets), get their settings from ``OVERRIDES`` (by model type,
   a composite's sub-configs by theirs).
2. Its own greedy ``generate`` (its generation config, ``eos`` off so every row runs the full
   length) of each prompt alone, prompts of 1, 5, 12, 23, 30 tokens, 12 new tokens: the reference. A model that
   cannot be built or whose own ``generate`` fails is *skipped* (by transformers), with the error.
3. ``specdec.speculative_generate`` of the prompts of 1, 12 and 30 tokens alone at γ 1, 4, 7, then the 5 prompts as a
   ragged batch (``batch_size=3``: rows join and leave) at γ 4. The drafter is the model itself
   with noise on its output head (same vocabulary, agrees often, not always: drafts are both
   accepted and rejected).

Each model is classified: ``exact`` (every output equal; ``apart``: why the batch's rows decoded one at a time,
if they did), ``mismatch`` (which run, which prompt),
``crash`` (an exception from inside specdec, with its traceback's last frames), ``refused`` (specdec
refused the model, with its message), ``refused-batch`` (exact alone, the batch refused), or
``skipped`` (transformers cannot build it tiny or its own generate fails: why). A divergence where
the model's two best logits are within ``TIE`` is reported as exact with the tie noted.

    python benchmarks/architecture_sweep.py --jobs 2 --json sweep.json            # every type
    python benchmarks/architecture_sweep.py --only mistral,bart --json sweep.json
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

LENGTHS = (1, 5, 12, 23, 30)  # prompt lengths (the ragged batch)
ALONE = (0, 2, 4)  # the prompts decoded alone at each gamma: 1, 12 and 30 tokens
GAMMAS = (1, 4, 7)
BATCH_GAMMA = 4
NEW = 12  # new tokens per prompt
VOCAB = 128
TIE = 1e-4  # a divergence at a gap this small between the two best logits is a near tie, not a mismatch
TOKENS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}

# field -> small value (ints larger than it are shrunk to it)
SMALL = {
    "hidden_size": 64, "d_model": 64, "n_embd": 64, "emb_dim": 64, "embed_dim": 64, "dim": 64,
    "word_embed_proj_dim": 64, "d_embed": 64, "projection_dim": 64,
    "intermediate_size": 128, "ffn_dim": 128, "encoder_ffn_dim": 128, "decoder_ffn_dim": 128, "d_ff": 128,
    "n_inner": 128, "ffn_hidden_size": 128, "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64,
    "intermediate_size_mlp": 128, "block_ff_dim": 128, "expert_intermediate_size": 64, "dense_intermediate_size": 128,
    "num_hidden_layers": 2, "num_layers": 2, "n_layer": 2, "n_layers": 2, "encoder_layers": 2, "decoder_layers": 2,
    "num_decoder_layers": 2, "num_encoder_layers": 2,
    "num_attention_heads": 4, "n_head": 4, "num_heads": 4, "n_heads": 4, "encoder_attention_heads": 4,
    "decoder_attention_heads": 4, "num_encoder_attention_heads": 4, "num_decoder_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "d_kv": 16, "kv_channels": 16, "attention_head_dim": 16,
    "kv_lora_rank": 16, "q_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16,
    "qk_head_dim": 16, "index_head_dim": 16, "index_n_heads": 2, "index_topk": 8,
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4, "num_experts_per_tok": 2,
    "num_experts_per_token": 2, "moe_topk": 2, "n_shared_experts": 1, "num_shared_experts": 1, "n_group": 1,
    "topk_group": 1, "expert_capacity": 64,
    "max_position_embeddings": 512, "n_positions": 512, "n_ctx": 512, "context_length": 512,
    "sliding_window": 8, "sliding_window_size": 8, "window_size": 8, "attention_window": 8, "attention_chunk_size": 8,
    "local_window_size": 8,
    "state_size": 8, "ssm_state_size": 8, "mamba_d_state": 8, "d_state": 8,
    "num_global_tokens": 2, "block_size": 4,
    "rotary_dim": 8, "moe_k": 2, "num_expert_group": 1, "embedding_dim": 64, "attention_hidden_size": 64,
    "hidden_size_per_layer_input": 16, "zero_expert_num": 2, "expert_ffn_hidden_size": 64, "num_blocks": 2,
    "adapter_in_dim": 64, "adapter_input_size": 64, "adapter_out_dim": 64,
    "mamba_d_ssm": 64, "mamba_n_heads": 8, "mamba_d_head": 8, "mamba_chunk_size": 16,
}
# head dimensions equal in a default config stay equal once shrunk (the smallest small value): latent attention's
# rotary part is its head_dim (DeepSeek-V3: head_dim = qk_rope_head_dim), its values as wide as its unrotated keys
HEAD_DIMS = ("head_dim", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")
# field -> its usual meaning where a default config leaves it None though the
# model reads it (its default does not build)
NONE_MEANS: dict[str, Callable[[dict], object]] = {
    "head_dim": lambda d: d["hidden_size"] // d["num_attention_heads"],
    "num_key_value_heads": lambda d: d["num_attention_heads"],
    "n_routed_experts": lambda d: SMALL["n_routed_experts"],
    "num_experts_per_tok": lambda d: SMALL["num_experts_per_tok"] if d.get("n_routed_experts") else None,
    "n_shared_experts": lambda d: SMALL["n_shared_experts"] if d.get("n_routed_experts") else None,
}
LAYER_FIELDS = ("num_hidden_layers", "num_layers", "n_layer", "n_layers", "decoder_layers", "num_decoder_layers")
INIT = {"initializer_range": 0.2, "init_std": 0.2}

# model type -> settings for types whose fields depend on each other beyond the generic rule
OVERRIDES: dict[str, dict] = {  # hybrids: one recurrent and one attention layer (the defaults' periods skip it)
    "mamba2": {"hidden_size": 64, "num_heads": 8, "head_dim": 16, "n_groups": 1, "chunk_size": 16},
    "bamba": {"attn_layer_indices": [1], "mamba_n_heads": 8, "mamba_d_head": 16, "mamba_d_state": 8,
              "mamba_n_groups": 1, "mamba_chunk_size": 16},
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2, "expert_layer_offset": 1,
              "mamba_d_state": 8, "mamba_dt_rank": 4},
    "zamba2": {"layers_block_type": ["linear_attention", "hybrid"], "hybrid_layer_ids": [1],
               "attention_hidden_size": 128,
               "attention_head_dim": 32, "num_key_value_heads": 4, "mamba_headdim": 16, "n_mamba_heads": 8,
               "mamba_d_state": 8},
    "gpt_neo": {"attention_types": [[["global", "local"], 1]], "num_layers": 2},
    "zamba": {"layers_block_type": ["hybrid", "hybrid"], "attention_hidden_size": 128, "attention_head_dim": 32,
              "num_key_value_heads": 4, "n_mamba_heads": 2,
              "mamba_dt_rank": 8},
    "recurrent_gemma": {"block_types": ["recurrent", "attention"], "lru_width": 64, "num_key_value_heads": 4},
    "granitemoehybrid": {"layer_types": ["linear_attention", "full_attention"], "num_hidden_layers": 2,
                         "mamba_n_heads": 8, "mamba_d_head": 16, "mamba_chunk_size": 16},
    "xlstm": {"qk_dim_factor": 1.0},  # its config rounds qk dims up to 64, its layers do not: equal at width 64 only
    "reformer": {"axial_pos_shape": [16, 32], "axial_pos_embds_dim": [32, 32], "attention_head_size": 16,
                 "local_attn_chunk_length": 8, "lsh_attn_chunk_length": 8, "feed_forward_size": 128, "num_buckets": 4},
    "hrm_text": {"num_layers_per_stack": None, "num_hidden_layers": 1, "H_cycles": 1, "L_cycles": 1},
    "xmod": {"default_language": "en_XX"},
    "musicgen_decoder": {"num_codebooks": 1}, "musicgen_melody_decoder": {"num_codebooks": 1},  # one token stream
    # KV sharing: the last layers read the cache of the last earlier layer of their kind (one of each kind shared)
    "gemma3n_text": {"num_hidden_layers": 4, "num_kv_shared_layers": 2, "activation_sparsity_pattern": [0.0] * 4,
                     "intermediate_size": [128] * 4,
                     "layer_types": ["sliding_attention", "full_attention"] * 2},  # its default config
                                                                                   # names no language: its
                                                                                   # forward refuses to run
    # defaults that do not build in transformers (fields left None, or read where the config never writes them)
    "dbrx": {"attn_config": {"rope_theta": 10000.0, "clip_qkv": 8.0}},  # read by its attention, None by default
    "cohere_compass_text": {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},
    # transformers 5.25's new types whose config validates its layer layout: Dory (a looped middle; its config dict
    # lists attention and mlp blocks, counts doubled) and Kolibri 1.1 (indexed layers that read an earlier one's keys)
    "dory": {"num_hidden_layers": 6, "n_input_layers": 2, "n_recurrent_layers": 2, "n_output_layers": 2,
             "layer_types": ["sliding_attention", "mlp", "full_attention", "mlp", "sliding_attention", "mlp"]},
    "kolibri1_1": {"num_hidden_layers": 2, "layer_types": ["sliding_attention", "indexed_attention"],
                   "index_layers": [1], "kv_source_layers": [0, 1], "mlp_only_layers": [0], "index_num_heads": 2,
                   "index_topk": 8, "index_pool_size": 64, "index_compression": 4},
    "qwen4_exp_text": {"indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 16, "indexer_budget": 8,
                       "indexer_compress_ratio": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16},
}


# model type -> the sub-config its causal-LM class is built from (its default config is a composite the class
# does not take)
CAUSAL_FROM_SUB = {"musicgen": "decoder", "musicgen_melody": "decoder"}


def merged(data: dict, override: dict) -> dict:
    """``data`` with ``override``'s fields set (a sub-config's dict merged field by field)."""
    out = dict(data)
    for key, value in override.items():
        both = isinstance(value, dict) and isinstance(out.get(key), dict) and key != "rope_parameters"
        out[key] = merged(out[key], value) if both else value
    return out


def overridden(data: dict) -> dict:
    """``data`` with the ``OVERRIDES`` of its model type and of its sub-configs' (a composite's text config)."""
    out = {key: overridden(value) if isinstance(value, dict) and "model_type" in value else value
           for key, value in data.items()}
    return merged(out, OVERRIDES.get(out.get("model_type"), {}))


def shrink(data: dict, fields_seen: list[str]) -> dict:
    """``data`` (a config's ``to_dict``) with every size field shrunk (sub-configs too)."""
    out = dict(data)
    layers_before = next((data[f] for f in LAYER_FIELDS if isinstance(data.get(f), int)), None)
    keep: list[int] | None = None
    types = next((data[k] for k in ("layer_types", "layers_block_type") if isinstance(data.get(k), list)), None)
    if isinstance(types, list) and types and layers_before and len(types) == layers_before:
        kinds: list = []
        keep = []
        for i, kind in enumerate(types):  # the first layer of each kind, then fill to 2 layers
            if kind not in kinds:
                kinds.append(kind)
                keep.append(i)
        keep = sorted(set(keep) | set(range(max(0, 2 - len(keep)))))
    for key, value in data.items():
        if isinstance(value, dict) and "model_type" in value or key.endswith("_config") and isinstance(value, dict):
            out[key] = shrink(value, fields_seen)
        elif key in SMALL and isinstance(value, int) and not isinstance(value, bool) and value > SMALL[key]:
            out[key] = SMALL[key]
            fields_seen.append(key)
        elif key in SMALL and isinstance(value, list) and value and all(isinstance(v, int) for v in value):
            out[key] = [min(v, SMALL[key]) for v in value]
        elif "vocab_size" in key and isinstance(value, int) and value > VOCAB:  # vocab_size_per_layer_input too
            out[key] = VOCAB
        elif key in INIT and isinstance(value, float):
            out[key] = INIT[key]
    if keep is not None:
        for key, value in data.items():  # every per-layer list cut to the kept layers
            if isinstance(value, list) and len(value) == layers_before:
                out[key] = [value[i] for i in keep]
        for f in LAYER_FIELDS + ("encoder_layers", "num_encoder_layers"):
            if isinstance(data.get(f), int) and data[f] == layers_before:
                out[f] = len(keep)
    elif layers_before:
        new = next(out[f] for f in LAYER_FIELDS if isinstance(out.get(f), int))
        keep = list(range(new))
        for key, value in data.items():
            if isinstance(value, list) and len(value) == layers_before and key not in SMALL:
                out[key] = value[:new]
    if isinstance(data.get("per_layer_config"), dict) and keep is not None:  # per-layer overrides of the kept layers
        out["per_layer_config"] = {str(keep.index(int(i))): shrink(fields, fields_seen)
                                   for i, fields in data["per_layer_config"].items() if int(i) in keep}
    for key, means in NONE_MEANS.items():  # a None the model cannot build with: its usual meaning
        if key in data and data[key] is None:
            try:
                out[key] = means(out)
            except (KeyError, TypeError, ZeroDivisionError):
                pass
    dims = [f for f in HEAD_DIMS if isinstance(data.get(f), int)]
    for f in dims:  # head dimensions equal by default stay equal
        out[f] = min(out[g] for g in dims if data[g] == data[f])
    if all(isinstance(data.get(f), int) for f in ("qk_head_dim", "qk_nope_head_dim", "qk_rope_head_dim")) \
            and data["qk_head_dim"] == data["qk_nope_head_dim"] + data["qk_rope_head_dim"]:
        out["qk_head_dim"] = out["qk_nope_head_dim"] + out["qk_rope_head_dim"]
    if all(isinstance(data.get(f), int) for f in ("d_head", "d_model", "n_head")) \
            and data["d_head"] == data["d_model"] // data["n_head"]:  # XLNet checks it
        out["d_head"] = out["d_model"] // out["n_head"]
    for key, value in list(out.items()):  # token ids inside the shrunk vocabulary
        if key.endswith(("_token_id", "_token_index")) and isinstance(value, int) and value >= VOCAB:
            out[key] = VOCAB - 1 - sum(map(ord, key)) % 16
    for key, value in TOKENS.items():
        if key in out or "vocab_size" in out:
            out[key] = value
    if "kv_lora_rank" in out and isinstance(out.get("num_attention_heads"), int):
        out["num_key_value_heads"] = out["num_attention_heads"]  # latent attention: one latent per query head
    if out.get("decoder_start_token_id") is not None:
        out["decoder_start_token_id"] = 2
    return out


def tiny_config(model_type: str, encoder_decoder: bool):
    """``model_type``'s default config shrunk (``shrink``, then its ``OVERRIDES``)."""
    from transformers import AutoConfig

    default = AutoConfig.for_model(model_type)
    if model_type in CAUSAL_FROM_SUB and not encoder_decoder:
        default = getattr(default, CAUSAL_FROM_SUB[model_type])
    data = overridden(shrink(default.to_dict(), []))
    data.pop("transformers_version", None)
    if not encoder_decoder and "is_decoder" in data:
        data["is_decoder"] = True  # BERT-family causal LMs (a user decoding with
                                   # one sets it; else it attends both ways)
    return type(default).from_dict(data)


def build(model_type: str, encoder_decoder: bool):
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    config = tiny_config(model_type, encoder_decoder)
    torch.manual_seed(0)
    auto = AutoModelForSeq2SeqLM if encoder_decoder else AutoModelForCausalLM
    if model_type in CAUSAL_FROM_SUB and not encoder_decoder:  # the class itself (Auto maps the composite only)
        import transformers
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        model = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])(config).eval()
    else:
        model = auto.from_config(config).eval()
    gc = model.generation_config
    gc.pad_token_id = 0
    return model


def noisy_copy(model, scale: float = 0.5):
    import torch

    drafter = copy.deepcopy(model)
    head = drafter.get_output_embeddings()
    weight = head.weight if head is not None and hasattr(head, "weight") else None
    if weight is not None:
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():
            weight.add_(torch.randn(weight.shape, generator=gen) * scale * weight.std())
    return drafter.eval()


def reference(model, prompt: list[int]) -> list[int]:
    import torch

    ids = torch.tensor([prompt])
    kwargs = {"do_sample": False, "num_beams": 1, "max_new_tokens": NEW, "min_new_tokens": None,
              "eos_token_id": None, "pad_token_id": 0}
    if model.config.is_encoder_decoder:
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)[0].tolist()
        return out[1:]
    return model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)[0, len(prompt):].tolist()


def gap_at(model, prompt: list[int], tokens: list[int], i: int) -> float | None:
    """The gap between the model's two best logits before new token ``i`` (one-pass forward), or None."""
    import torch

    try:
        with torch.no_grad():
            if model.config.is_encoder_decoder:
                start = model.generation_config.decoder_start_token_id
                start = start if isinstance(start, int) else model.config.decoder_start_token_id
                dec = torch.tensor([[start, *tokens[:i]]])
                logits = model(input_ids=torch.tensor([prompt]), decoder_input_ids=dec, use_cache=False).logits
            else:
                logits = model(input_ids=torch.tensor([prompt + tokens[:i]]), use_cache=False).logits
        top = logits[0, -1].float().topk(2).values
        return float(top[0] - top[1])
    except Exception:  # noqa: BLE001 - only a diagnostic
        return None


def classify_error(error: BaseException) -> tuple[str, str]:
    frames = traceback.extract_tb(error.__traceback__)
    inside = [f for f in frames if "/specdec/" in f.filename]
    text = f"{type(error).__name__}: {error}"
    if not inside:
        return "crash-transformers", text
    last = frames[-1]
    if "/specdec/" in last.filename and isinstance(error, (ValueError, TypeError, NotImplementedError)) \
            and (last.line or "").lstrip().startswith("raise"):
        return "refused", text
    tail = "".join(traceback.format_list(frames[-4:]))
    return "crash", f"{text}\n{tail}"


def run_one(model_type: str, encoder_decoder: bool) -> dict:
    import torch

    torch.set_num_threads(1)
    result: dict = {"model_type": model_type, "kind": "encoder-decoder" if encoder_decoder else "decoder-only"}
    try:
        model = build(model_type, encoder_decoder)
        result["class"] = type(model).__name__
        result["params"] = sum(p.numel() for p in model.parameters())
    except Exception as error:  # noqa: BLE001
        return {**result, "status": "skipped", "why": f"build: {type(error).__name__}: {str(error)[:300]}"}
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in LENGTHS]
    try:
        refs = [reference(model, p) for p in prompts]
    except Exception as error:  # noqa: BLE001
        return {**result, "status": "skipped", "why": f"own generate: {type(error).__name__}: {str(error)[:300]}"}
    if any(len(r) != NEW for r in refs):
        return {**result, "status": "skipped", "why": f"own generate returned lengths {[len(r) for r in refs]}"}
    import specdec

    drafter = noisy_copy(model)
    ties: list[str] = []

    def compare(label: str, i: int, tokens: list[int]) -> str | None:
        if tokens == refs[i]:
            return None
        at = next((k for k, (a, b) in enumerate(zip(tokens, refs[i])) if a != b), min(len(tokens), len(refs[i])))
        gap = gap_at(model, prompts[i], refs[i], at)
        if gap is not None and gap < TIE:
            ties.append(f"{label} prompt {LENGTHS[i]}: token {at} (gap {gap:.1e})")
            return None
        return f"{label}, prompt of {LENGTHS[i]} tokens: first difference at new token {at} (gap {gap})"

    stage = "single"
    try:
        for gamma in GAMMAS:
            for i in ALONE:
                out = specdec.speculative_generate(model, drafter, prompts[i], max_new_tokens=NEW, gamma=gamma,
                                                   stop_token_ids=[])
                if (why := compare(f"alone, gamma {gamma}", i, out.tokens)) is not None:
                    return {**result, "status": "mismatch", "why": why}
        stage = "batch"
        outs = specdec.speculative_generate(model, drafter, prompts, max_new_tokens=NEW, gamma=BATCH_GAMMA,
                                            stop_token_ids=[], batch_size=3)
        if outs[0].batch is not None and outs[0].batch.apart:  # exact, but its rows decoded one at a time
            result["apart"] = outs[0].batch.apart
        for i, out in enumerate(outs):
            if (why := compare(f"ragged batch, gamma {BATCH_GAMMA}", i, out.tokens)) is not None:
                return {**result, "status": "mismatch", "why": why}
    except Exception as error:  # noqa: BLE001
        status, text = classify_error(error)
        if status == "refused" and stage == "batch":
            status = "refused-batch"
        return {**result, "status": status, "stage": stage, "why": text[:2000]}
    return {**result, "status": "exact", "ties": ties}


def model_types(only: list[str] | None) -> list[tuple[str, bool]]:
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
    )

    pairs = [(t, False) for t in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES]
    pairs += [(t, True) for t in MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES]
    if only:
        pairs = [p for p in pairs if p[0] in only]
    return pairs


def in_subprocess(model_type: str, encoder_decoder: bool, timeout: float) -> dict:
    command = [sys.executable, __file__, "--one", model_type] + (["--seq2seq"] if encoder_decoder else [])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    kind = "encoder-decoder" if encoder_decoder else "decoder-only"
    start = time.perf_counter()
    try:
        done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"model_type": model_type, "kind": kind, "status": "timeout", "why": f"over {timeout:.0f} s",
                "seconds": timeout}
    seconds = round(time.perf_counter() - start, 1)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        return {"model_type": model_type, "kind": kind, "status": "crash-process", "seconds": seconds,
                "why": (done.stderr or done.stdout)[-1500:]}
    return {**json.loads(lines[-1]), "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--one", help="run one model type in this process (the sweep's worker)")
    parser.add_argument("--seq2seq", action="store_true", help="with --one: its seq2seq class")
    parser.add_argument("--only", help="comma-separated model types (default: every type)")
    parser.add_argument("--jobs", type=int, default=1, help="subprocesses at once (1 or 2 on a shared machine)")
    parser.add_argument("--timeout", type=float, default=420, help="seconds per model type")
    parser.add_argument("--json", type=Path, help="write every result here")
    parser.add_argument("--resume", action="store_true", help="keep the results already in --json, run the rest")
    parser.add_argument("--first", default="", help="comma-separated model types to run before the others "
                                                    "(the others alternate decoder-only and encoder-decoder)")
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_one(args.one, args.seq2seq)), flush=True)
        return
    pairs = model_types(args.only.split(",") if args.only else None)
    results: list[dict] = json.loads(args.json.read_text()) if args.resume and args.json.exists() else []
    done = {(r["model_type"], r["kind"] == "encoder-decoder") for r in results}
    first = args.first.split(",") if args.first else []
    decoders = [p for p in pairs if not p[1] and p[0] not in first]
    seq2seq = [p for p in pairs if p[1] and p[0] not in first]
    mixed = [p for i in range(max(len(decoders), len(seq2seq)))
             for p in (decoders[i:i + 1] + seq2seq[i:i + 1])]
    pairs = [p for p in [p for p in pairs if p[0] in first] + mixed if p not in done]
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        futures = [pool.submit(in_subprocess, t, s, args.timeout) for t, s in pairs]
        for future in futures:
            r = future.result()
            results.append(r)
            why = r.get("why") or r.get("apart") or ""
            print(f"{r['kind']:16} {r['model_type']:28} {r['status']:14} {r.get('seconds', 0):6.1f}s  "
                  f"{why.splitlines()[0][:150] if why else ''}", flush=True)
            if args.json:
                args.json.write_text(json.dumps(results, indent=1))
    print()
    statuses = sorted({r["status"] for r in results})
    for kind in ("decoder-only", "encoder-decoder"):
        counts = {s: sum(r["status"] == s and r["kind"] == kind for r in results) for s in statuses}
        print(f"{kind:16} " + "  ".join(f"{s} {n}" for s, n in counts.items()))


if __name__ == "__main__":
    main()
