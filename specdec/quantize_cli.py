"""``specdec quantize``: its parser (light: ``specdec quantize --help`` and bad flags import no torch) and its run,
which calls ``specdec.quantized.quantize``."""

from __future__ import annotations

GROUP_SIZES = (32, 64, 128)  # int4's choices of input columns per scale:
                             # specdec.quantized.GROUP_SIZES (torch-free here)


def register(subparsers) -> None:
    """Add ``specdec quantize``."""
    parser = subparsers.add_parser(
        "quantize",
        description="Write a weight-only int8 (per output channel) or int4 (group-wise) copy of MODEL to DIR in "
        "torchao's format (safetensors; from_pretrained loads it with torchao installed), with a README.md giving "
        "its size on disk and its greedy agreement with MODEL.",
    )
    parser.add_argument("model", metavar="MODEL", help="a model folder or shipped name (e.g. code-target)")
    parser.add_argument("--to", required=True, choices=("int8", "int4"), help="the weights' integer type")
    parser.add_argument("--out", required=True, metavar="DIR", help="the folder to write (must not exist, or be empty)")
    parser.add_argument("--group-size", type=int, choices=GROUP_SIZES, default=None,
                        help="int4: input columns per scale (default 128)")
    parser.add_argument("--quantize-embeddings", action="store_true", help="quantize the input embeddings too")
    parser.add_argument("--quantize-head", action="store_true", help="quantize the LM head too")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                        help="the dtype it computes in (scales and unquantized weights; default fp32, the CPU's)")
    parser.add_argument("--prompts", type=int, default=8, help="held-out prompts for the agreement (default 8)")
    parser.add_argument("--tokens", type=int, default=32, help="new tokens a prompt (default 32)")
    parser.set_defaults(func=_run)


def _run(args) -> int:
    import torch

    from specdec.loading import resolve_model_path
    from specdec.quantized import quantize

    if args.prompts < 1 or args.tokens < 1:
        raise ValueError("--prompts and --tokens must be at least 1")
    path = resolve_model_path(args.model)
    figures = quantize(path, args.to, args.out, args.group_size, args.quantize_embeddings, args.quantize_head,
                       torch.float32 if args.dtype == "fp32" else torch.bfloat16, args.prompts, args.tokens)
    a = figures["agreement"]
    print(f"wrote {args.out}: {figures['bytes'] / 2**20:.1f} MiB of weights "
          f"({figures['bytes'] / max(figures['source_bytes'], 1):.2f}x the source); greedy agreement "
          f"{a['equal_prompts']}/{a['prompts']} prompts × {a['tokens']} tokens")
    return 0
