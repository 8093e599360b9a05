"""Where a target step's time goes on this machine: `python -m specdec.bench.matmul`.

Speculation pays when verifying k+1 tokens costs about one single-token step. That depends on the
matrix kernels more than on the model: for a 1-token input PyTorch's ``F.linear`` runs a
matrix-vector product, for k+1 tokens a matrix product with the weight transposed. This probe
times, for several query lengths q, one cached forward of the model and the sum of its linear
layers in two layouts that compute the same numbers (up to summation order):

- ``F.linear(x, W)``: what the model runs (``x @ W.T``);
- ``W @ x.T``: the same product with the weight as the untransposed left operand, a 1-row input
  padded to 2 rows (a matrix-vector product is the slow kernel on some CPUs).

It also times the model's forward with its linear layers switched to the second layout for the
duration of the probe, to show what speculation would gain over plain decoding with faster kernels.

Each figure is the median of interleaved repeats, so the ratios within one run are comparable.
It measures; it changes nothing in how specdec or transformers compute.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from rich.console import Console
from rich.table import Table

from specdec.cache import RaggedCache
from specdec.loading import load_model


def _linears(model: torch.nn.Module) -> list[torch.nn.Linear]:
    """The model's linear layers, each once (a tied LM head included)."""
    return [m for m in model.modules() if isinstance(m, torch.nn.Linear)]


def _gemm_forward(linear: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``linear(x)`` computed as ``(W @ x.T).T``; one row is padded to two (the padding is dropped)."""
    rows = x.reshape(-1, x.shape[-1])  # [n, in]
    padded = torch.cat([rows, rows]) if rows.shape[0] == 1 else rows
    out = (linear.weight @ padded.T).T[: rows.shape[0]]  # [n, out]
    if linear.bias is not None:
        out = out + linear.bias
    return out.reshape(*x.shape[:-1], -1)


@contextmanager
def gemm_layout(model: torch.nn.Module) -> Iterator[None]:
    """Within the block, every ``nn.Linear`` of ``model`` computes ``(W @ x.T).T``; restored after.

    A forward already set on the instance (e.g. an accelerate device hook) is put back as it was."""
    saved = {m: vars(m).get("forward") for m in _linears(model)}
    for m in saved:
        m.forward = _gemm_forward.__get__(m)
    try:
        yield
    finally:
        for m, forward in saved.items():
            if forward is None:
                del m.forward
            else:
                m.forward = forward


def _timed(repeats: list[float], started: float) -> None:
    repeats.append(time.perf_counter() - started)


def probe(model: torch.nn.Module, lengths: tuple[int, ...], repeats: int,
          context: int = 100) -> dict[int, dict[str, float]]:
    """Median milliseconds per query length: the model's cached forward and both linear layouts."""
    linears = _linears(model)
    vocab = model.config.get_text_config().vocab_size
    prompt = torch.randint(0, vocab, (1, context + max(lengths)), generator=torch.Generator().manual_seed(0))
    names = ("forward", "forward, W @ x.T", "linear", "W @ x.T")
    times: dict[int, dict[str, list[float]]] = {q: {name: [] for name in names} for q in lengths}
    with torch.inference_mode():
        cache = RaggedCache(model, 1)
        cache.forward(prompt[:, :context])
        keep = torch.tensor([context])
        for _ in range(repeats + 2):  # the first two rounds warm up and are dropped below
            for q in lengths:
                x = {m.in_features: torch.randn(q, m.in_features, dtype=m.weight.dtype) for m in linears}
                new = prompt[:, context : context + q]
                started = time.perf_counter()
                cache.forward(new, None, q)
                _timed(times[q]["forward"], started)
                cache.keep(keep)
                with gemm_layout(model):
                    started = time.perf_counter()
                    cache.forward(new, None, q)
                    _timed(times[q]["forward, W @ x.T"], started)
                    cache.keep(keep)
                started = time.perf_counter()
                for m in linears:
                    torch.nn.functional.linear(x[m.in_features], m.weight)
                _timed(times[q]["linear"], started)
                started = time.perf_counter()
                for m in linears:
                    _gemm_forward(m, x[m.in_features])
                _timed(times[q]["W @ x.T"], started)
    return {q: {k: 1e3 * statistics.median(v[2:]) for k, v in row.items()} for q, row in times.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m specdec.bench.matmul", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="code-target", help="a shipped name or a model folder")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1, 2, 5, 9], help="query lengths (tokens)")
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--threads", type=int, default=None, help="torch threads; None = torch's default")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = load_model(args.model, dtype=torch.float32)
    rows = probe(model, tuple(args.lengths), args.repeats)
    table = Table(title=f"{args.model}: median ms, {torch.get_num_threads()} threads, {args.repeats} repeats")
    columns = ("q", "forward", "× q=1", "forward, W @ x.T", "× q=1 ", "linear layers", "W @ x.T", "ratio")
    for column in columns:
        table.add_column(column, justify="right")
    first = rows[min(rows)]
    for q, row in rows.items():
        gemm = row["forward, W @ x.T"]
        table.add_row(
            str(q), f"{row['forward']:.2f}", f"{row['forward'] / first['forward']:.2f}", f"{gemm:.2f}",
            f"{gemm / first['forward, W @ x.T']:.2f}", f"{row['linear']:.2f}", f"{row['W @ x.T']:.2f}",
            f"{row['linear'] / row['W @ x.T']:.2f}",
        )
    Console().print(table)
    Console().print("forward: the model's cached forward of q new tokens as it runs (x q=1: per single-token "
                    "step); forward, W @ x.T: the same with its linear layers in the other layout; linear "
                    "layers / W @ x.T: their products alone in each layout; ratio: linear / W @ x.T")


if __name__ == "__main__":
    main()
