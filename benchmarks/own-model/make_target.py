"""Make "the user's model" for the own-model goals of issue 26: a GPT-2 of about 12M parameters with
its own 4k byte-level BPE tokenizer, trained on Python code from site-packages on one CPU thread.

Neither the model nor its tokenizer is used by specdec's tests or shipped models (those use the
standard library). The packages in TRAIN_PACKAGES are the training code; make_prompts.py draws the
user's prompts from HELD_OUT_PACKAGES only (split by package, so no prompt's file was trained on).

    python benchmarks/own-model/make_target.py --out /work/scratch/own-goal/target --minutes 22

Writes OUT (config.json, model.safetensors, the tokenizer files) and OUT/train_log.txt. ``--init-from
DIR`` continues a model saved by an earlier run (its tokenizer, the same corpus and split; a fresh
optimizer and schedule), logging to OUT/train_log_continued.txt.
"""

from __future__ import annotations

import argparse
import math
import random
import site
import time
from pathlib import Path

import torch
from tokenizers import ByteLevelBPETokenizer
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

TRAIN_PACKAGES = (
    "werkzeug", "flask", "jinja2", "click", "rich", "urllib3", "anyio", "trio", "pygments",
    "docutils", "setuptools", "pip", "prompt_toolkit", "_pytest", "hypothesis", "websockets",
    "fastapi", "httpx2", "filelock", "fsspec", "typer", "packaging", "pyparsing", "markdown",
    "traitlets", "idna", "s3transfer", "boto3", "docker", "babel",
)
HELD_OUT_PACKAGES = ("networkx", "sympy", "jsonschema", "jedi", "griffe", "pydantic", "psutil", "portalocker")
EOS = "<|endoftext|>"


def site_packages() -> Path:
    return Path(site.getsitepackages()[0])


def package_files(packages: tuple[str, ...], max_bytes: int = 400_000) -> list[Path]:
    """Every .py file of the packages (sorted), without tests and files larger than max_bytes."""
    files = []
    for name in packages:
        root = site_packages() / name
        for f in sorted(root.rglob("*.py")):
            if "test" in f.relative_to(root).as_posix() or f.stat().st_size > max_bytes:
                continue
            files.append(f)
    return files


def read(f: Path) -> str:
    return f.read_text(encoding="utf-8", errors="replace")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--minutes", type=float, default=22.0, help="training wall time")
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--layers", type=int, default=14)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--corpus-mb", type=float, default=12.0, help="training text kept (MB)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--init-from", default=None, help="continue the model and tokenizer saved in this folder")
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = (out / ("train_log_continued.txt" if args.init_from else "train_log.txt")).open("w")

    def say(msg: str) -> None:
        print(msg, flush=True)
        log.write(msg + "\n")
        log.flush()

    files = package_files(TRAIN_PACKAGES)
    random.Random(args.seed).shuffle(files)
    texts, size = [], 0
    for f in files:
        t = read(f)
        texts.append(t)
        size += len(t)
        if size > args.corpus_mb * 1e6:
            break
    say(f"corpus: {len(texts)} files of {len(TRAIN_PACKAGES)} packages, {size / 1e6:.1f} MB")

    t0 = time.time()
    if args.init_from:
        tok = PreTrainedTokenizerFast.from_pretrained(args.init_from)
    else:
        bpe = ByteLevelBPETokenizer()
        bpe.train_from_iterator(texts, vocab_size=args.vocab, min_frequency=2, special_tokens=[EOS])
        tok = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, bos_token=EOS, eos_token=EOS,
                                      unk_token=EOS, pad_token=EOS, model_max_length=512)
    tok.save_pretrained(out)
    eos_id = tok.convert_tokens_to_ids(EOS)
    ids: list[int] = []
    for enc in tok.backend_tokenizer.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eos_id)
    data = torch.tensor(ids, dtype=torch.long)
    say(f"tokenizer: vocab {len(tok)}, {len(data) / 1e6:.2f}M tokens ({size / len(data):.2f} chars/token), "
        f"{time.time() - t0:.0f} s")
    n_valid = 50_000
    valid, train = data[:n_valid], data[n_valid:]

    config = GPT2Config(vocab_size=len(tok), n_positions=512, n_embd=args.width, n_layer=args.layers,
                        n_head=args.heads, bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel.from_pretrained(args.init_from) if args.init_from else GPT2LMHeadModel(config)
    n_params = sum(p.numel() for p in model.parameters())
    say(f"model: GPT-2, {args.layers} layers, width {args.width}, {args.heads} heads, {n_params / 1e6:.2f}M params")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(args.seed)
    budget, warmup = args.minutes * 60, 50
    start, step, tokens = time.time(), 0, 0

    def batch(src: torch.Tensor, n: int) -> torch.Tensor:
        starts = torch.randint(0, len(src) - args.seq_len - 1, (n,), generator=gen)
        return torch.stack([src[s: s + args.seq_len] for s in starts])

    @torch.no_grad()
    def valid_loss() -> float:
        model.eval()
        g = torch.Generator().manual_seed(1)
        starts = torch.randint(0, len(valid) - args.seq_len - 1, (32,), generator=g)
        x = torch.stack([valid[s: s + args.seq_len] for s in starts])
        loss = model(input_ids=x, labels=x).loss.item()
        model.train()
        return loss

    model.train()
    while (elapsed := time.time() - start) < budget:
        frac = elapsed / budget
        lr = args.lr * min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        for g in opt.param_groups:
            g["lr"] = lr
        x = batch(train, args.batch_size)
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        tokens += x.numel()
        if step % 50 == 0:
            say(f"step {step}  {elapsed:.0f} s  lr {lr:.2e}  loss {loss.item():.3f}  {tokens / elapsed:.0f} tok/s")
        if step % 500 == 0:
            say(f"  valid loss {valid_loss():.3f}")
    say(f"done: {step} steps, {tokens / 1e6:.2f}M tokens in {time.time() - start:.0f} s; "
        f"valid loss {valid_loss():.3f}")
    model.eval()
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    say(f"saved {out}")


if __name__ == "__main__":
    main()
