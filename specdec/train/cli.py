"""``specdec train``: train the tokenizer, a target or a distilled drafter, and export for shipping.

    specdec train tokenizer --out runs/tokenizer
    specdec train lm --preset code-target --out runs/code-target --tokenizer runs/tokenizer
    specdec train lm --preset code-drafter --out runs/code-drafter --tokenizer runs/tokenizer \
        --teacher runs/code-target/final
    specdec train lm --preset code-target-s2 --out runs/code-target-s2 --tokenizer runs/tokenizer   # stage 2
    specdec train lm --preset code-drafter-s2 --out runs/code-drafter-s2 --tokenizer runs/tokenizer
    specdec train lm --preset code-target-s3 --out runs/code-target-s3 --tokenizer runs/tokenizer   # stage 3
    specdec train lm --preset code-drafter-s3 --out runs/code-drafter-s3 --tokenizer runs/tokenizer
    specdec train outputs --target code-target --out runs/code-target-outputs.jsonl --dtype bf16  # stage 4:
    specdec train lm --preset code-drafter-s4 --out runs/code-drafter-s4 --tokenizer runs/tokenizer  # on them
    specdec train outputs --target code-target --out runs/code-target-outputs.jsonl --dtype bf16 --num-prompts 12000
    specdec train lm --preset code-drafter-s5 --out runs/code-drafter-s5 --tokenizer runs/tokenizer  # stage 5
    specdec train export runs/code-target-s3/final models/code-target --dtype bf16
    specdec train drafter --target MODEL --data runs/outputs.jsonl --out runs/my-drafter --layers 2  # any target,
        # on `specdec data outputs --target MODEL --prompts FILE --out runs/outputs.jsonl` (see drafter.py)
    specdec train block-drafter --target MODEL --data runs/outputs.jsonl --out runs/my-block-drafter  # any target
    specdec train feature-drafter --target MODEL --data runs/outputs.jsonl --out runs/my-feature-drafter  # EAGLE-3
    specdec train parallel-drafter --target MODEL --data runs/outputs.jsonl --out runs/my-parallel-drafter  # block
    specdec train head --target MODEL --drafter runs/my-drafter/final --data runs/outputs.jsonl --out runs/my-head
        # SpecDec's block drafter and SpecDec++'s head for any target (pair), on the same data; measured at the end
    specdec train export runs/code-drafter-s5/final models/code-drafter --dtype bf16
    specdec train card      # after `specdec bench ... --output bench-out/card`: writes the model cards
    specdec train head --outputs runs/code-target-outputs.jsonl --valid-outputs runs/valid-outputs.jsonl \
        --out runs/acceptance-head       # the SpecDec++ acceptance head (see specdec/heads/cli.py)
    specdec train head-eval --head runs/acceptance-head/final --valid-outputs runs/valid-outputs.jsonl \
        --out runs/acceptance-head/eval
    specdec train block-drafter --out runs/code-block-drafter --outputs runs/code-target-outputs.jsonl \
        --valid runs/valid-outputs.jsonl   # SpecDec's block drafter (see specdec/train/block.py)

The translation pair (encoder-decoder, on `specdec data gettext --out data/gettext-de`):

    specdec train seq2seq-tokenizer --data data/gettext-de --out runs/translate-tokenizer
    specdec train seq2seq --preset translate-target --out runs/translate-target
    specdec train translations --model runs/translate-target/final --out runs/translate-target-translations-train.jsonl
    specdec train seq2seq --preset translate-drafter --out runs/translate-drafter
    specdec train seq2seq-block-drafter --target runs/translate-target/final \
        --translations runs/translate-target-translations-train.jsonl --out runs/translate-block-drafter
    specdec train seq2seq-export runs/translate-target/final models/translate-target --dtype bf16
    specdec train seq2seq-eval models/translate-target --split test --beams 1 5

Run ``lm`` again with the same ``--out`` to resume. Every ``TrainConfig`` field of the preset can be
overridden (``--max-steps``, ``--lr``, ...).
"""

from __future__ import annotations

import argparse
import dataclasses

from specdec.train.presets import (
    PRESETS,
    SEQ2SEQ_PRESETS,
    BlockTrainConfig,
    DrafterTrainConfig,
    FeatureDrafterTrainConfig,
    ParallelDrafterTrainConfig,
    Seq2SeqBlockConfig,
    Seq2SeqTrainConfig,
    TrainConfig,
)


def _add_config_flags(parser: argparse.ArgumentParser, cls: type = TrainConfig,
                      suffix: str = " (overrides the preset)") -> None:
    from specdec.arguments import field_comments

    comments = field_comments(cls)
    for f in dataclasses.fields(cls):
        if f.name in ("shape",):
            continue
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool", bool):
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None,
                                help=comments.get(f.name, "") + suffix.format(default=f.default))
        else:
            kind = {"int": int, "float": float}.get(str(f.type).removesuffix(" | None"), str)
            parser.add_argument(flag, dest=f.name, type=kind, default=None,
                                help=(comments.get(f.name, "") + suffix.format(default=f.default)).replace("%", "%%"))


def _config_from(args: argparse.Namespace) -> TrainConfig:
    base = PRESETS[args.preset]
    overrides = {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)
                 if f.name != "shape" and getattr(args, f.name, None) is not None}
    return dataclasses.replace(base, **overrides)


def _cmd_tokenizer(args: argparse.Namespace) -> int:
    from specdec.data.tokenizer import train_code_tokenizer

    tok = train_code_tokenizer(args.out, vocab_size=args.vocab_size)
    print(f"tokenizer with {len(tok)} tokens saved to {args.out}")
    return 0


def _cmd_lm(args: argparse.Namespace) -> int:
    from specdec.train.lm import train

    final = train(_config_from(args), args.out, args.tokenizer, device=args.device,
                  stop_after_s=args.stop_after, stop_at_step=args.stop_at_step)
    print(f"final model: {final}" if final else "stopped early; run the same command to resume")
    return 0


def _cmd_block_drafter(args: argparse.Namespace) -> int:
    import torch

    from specdec.train.block import train_block_drafter

    torch.set_num_threads(args.threads)
    overrides = {f.name: getattr(args, f.name) for f in dataclasses.fields(BlockTrainConfig)
                 if getattr(args, f.name, None) is not None}
    if args.data is not None:  # any target, on `specdec data outputs`
        from specdec.train.block import train_own_block_drafter

        if args.target is None:
            raise ValueError("--data needs --target: the target the data was written with")
        if args.reschedule_to is not None:
            raise ValueError("--reschedule-to does not go with --data: give --max-steps")
        target = overrides.pop("target")
        final = train_own_block_drafter(target, args.data, args.out, overrides, device=args.device,
                                        stop_after_s=args.stop_after, stop_at_step=args.stop_at_step,
                                        measure=not args.no_measure, measure_prompts=args.measure_prompts,
                                        measure_tokens=args.measure_tokens)
        print(f"final model: {final}" if final else "stopped early; run the same command to resume")
        return 0
    if args.device != "cpu":
        raise ValueError("the block drafter trains on the CPU: leave out --device")
    final = train_block_drafter(BlockTrainConfig(**overrides), args.out, stop_after_s=args.stop_after,
                                stop_at_step=args.stop_at_step, reschedule_to=args.reschedule_to)
    print(f"final model: {final}" if final else "stopped early; run the same command to resume")
    return 0


def _cmd_block_eval(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    import torch

    from specdec.train.block_eval import evaluate_block_drafter, format_evaluation

    torch.set_num_threads(args.threads)
    result = evaluate_block_drafter(args.model, args.valid, target=args.target, drafter=args.drafter or None,
                                    records=args.records, steps=args.steps)
    print(format_evaluation(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


def _cmd_outputs(args: argparse.Namespace) -> int:
    from specdec.train.outputs import generate_outputs

    n = generate_outputs(args.target, args.out, num_prompts=args.num_prompts, split=args.split,
                         max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                         sampled_every=args.sampled_every, dtype=args.dtype, device=args.device, seed=args.seed,
                         progress=True)
    print(f"{args.out}: {n} of {args.num_prompts} prompts continued")
    return 0


def _cmd_drafter(args: argparse.Namespace) -> int:
    import torch

    from specdec.train.drafter import train_drafter

    torch.set_num_threads(args.threads)
    overrides = {f.name: getattr(args, f.name) for f in dataclasses.fields(DrafterTrainConfig)
                 if getattr(args, f.name, None) is not None}
    final = train_drafter(DrafterTrainConfig(**overrides), args.out, device=args.device, stop_at_step=args.stop_at_step,
                          stop_after_s=args.stop_after, measure=not args.no_measure,
                          measure_prompts=args.measure_prompts, measure_tokens=args.measure_tokens)
    print(f"final model: {final}" if final else "stopped early; run the same command to resume")
    return 0


def _train_with(args: argparse.Namespace, config_class: type, train) -> int:
    """Run ``train(config_class(**the flags given), args.out, ...)`` and say where the final model is."""
    import torch

    torch.set_num_threads(args.threads)
    overrides = {f.name: getattr(args, f.name) for f in dataclasses.fields(config_class)
                 if getattr(args, f.name, None) is not None}
    final = train(config_class(**overrides), args.out, device=args.device, stop_at_step=args.stop_at_step,
                  stop_after_s=args.stop_after)
    print(f"final model: {final}" if final else "stopped early; run the same command to resume")
    return 0


def _cmd_feature_drafter(args: argparse.Namespace) -> int:
    from specdec.train.feature_drafter import train_feature_drafter

    return _train_with(args, FeatureDrafterTrainConfig, train_feature_drafter)


def _cmd_parallel_drafter(args: argparse.Namespace) -> int:
    from specdec.train.parallel_drafter import train_parallel_drafter

    return _train_with(args, ParallelDrafterTrainConfig, train_parallel_drafter)


def _cmd_feature_eval(args: argparse.Namespace) -> int:
    import json

    import torch

    from specdec.train.feature_eval import evaluate

    torch.set_num_threads(args.threads)
    figures = evaluate(args.drafter, args.target, prompts=args.prompts, max_new_tokens=args.max_new_tokens,
                       depth=args.depth, compare=[c for c in args.compare if c], seed=args.seed,
                       rows_file=args.rows)
    text = json.dumps(figures, indent=1)
    if args.output:
        from pathlib import Path

        Path(args.output).write_text(text + "\n")
    print(text)
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from specdec.train.lm import export

    print(f"exported to {export(args.src, args.dst, dtype=args.dtype)}")
    return 0


def _cmd_card(args: argparse.Namespace) -> int:
    import json

    from specdec.train.card import write_cards

    figures = write_cards(args.target, args.drafter, args.bench_dir, args.target_run, args.drafter_run)
    print(json.dumps(figures, indent=1))
    return 0


def _add_dataclass_flags(parser: argparse.ArgumentParser, cls: type, skip: tuple[str, ...] = ("shape",)) -> None:
    """One ``--flag`` per field of ``cls`` (default None: the preset's value stands)."""
    from specdec.arguments import field_comments

    comments = field_comments(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        kind = {"int": int, "float": float}.get(str(f.type).removesuffix(" | None"), str)
        parser.add_argument("--" + f.name.replace("_", "-"), dest=f.name, type=kind, default=None,
                            help=(comments.get(f.name, "") + " (overrides the preset)").replace("%", "%%"))


def _add_measure_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of the held-out measurement a trainer of a user's target runs at the end."""
    parser.add_argument("--no-measure", action="store_true", help="skip the held-out speed measurement at the end")
    parser.add_argument("--measure-prompts", type=int, default=20,
                        help="held-out prompts measured (default: %(default)s)")
    parser.add_argument("--measure-tokens", type=int, default=64,
                        help="new tokens per measured prompt (default: %(default)s)")


def _cmd_seq2seq_tokenizer(args: argparse.Namespace) -> int:
    from specdec.data.seq2seq_tokenizer import train_translation_tokenizer

    tok = train_translation_tokenizer(args.data, args.out, vocab_size=args.vocab_size)
    print(f"tokenizer with {len(tok)} tokens saved to {args.out}")
    return 0


def _cmd_seq2seq(args: argparse.Namespace) -> int:
    from specdec.train.seq2seq import train_seq2seq

    overrides = {f.name: getattr(args, f.name) for f in dataclasses.fields(Seq2SeqTrainConfig)
                 if f.name != "shape" and getattr(args, f.name, None) is not None}
    if overrides.get("translations") == "references":  # distil from nothing: train on the reference translations
        overrides["translations"] = None
    cfg = dataclasses.replace(SEQ2SEQ_PRESETS[args.preset], **overrides)
    final = train_seq2seq(cfg, args.out, device=args.device, stop_after_s=args.stop_after,
                          stop_at_step=args.stop_at_step)
    print(f"final model: {final}" if final else "stopped early; run the same command to resume")
    return 0


def _cmd_seq2seq_block(args: argparse.Namespace) -> int:
    from specdec.train.seq2seq_block import train_seq2seq_block

    overrides = {f.name: getattr(args, f.name) for f in dataclasses.fields(Seq2SeqBlockConfig)
                 if getattr(args, f.name, None) is not None}
    cfg = dataclasses.replace(Seq2SeqBlockConfig(), **overrides)
    final = train_seq2seq_block(cfg, args.out, device=args.device, stop_after_s=args.stop_after)
    print(f"final model: {final}" if final else "stopped early; run the same command to resume")
    return 0


def _cmd_translations(args: argparse.Namespace) -> int:
    from specdec.train.seq2seq import write_translations

    n = write_translations(args.model, args.data, args.out, split=args.split, batch_size=args.batch_size,
                           chunk=args.chunk, device=args.device)
    print(f"{args.out}: {n} translations")
    return 0


def _cmd_seq2seq_export(args: argparse.Namespace) -> int:
    from specdec.train.seq2seq import export as export_seq2seq

    print(f"exported to {export_seq2seq(args.src, args.dst, dtype=args.dtype)}")
    return 0


def _cmd_seq2seq_eval(args: argparse.Namespace) -> int:
    import json
    from dataclasses import asdict

    from specdec.train.seq2seq import agreement, evaluate

    figures = {"model": args.model, "quality": [asdict(q) for q in evaluate(
        args.model, args.data, split=args.split, beams=args.beams, batch_size=args.batch_size, limit=args.limit,
        device=args.device, hypotheses_dir=args.hypotheses)]}
    if args.agreement_with is not None:
        figures["agreement"] = agreement(args.model, args.agreement_with, device=args.device)
    print(json.dumps(figures, indent=1))
    return 0


def register(subparsers) -> None:
    """Add ``specdec train`` and its subcommands."""
    train = subparsers.add_parser("train", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = train.add_subparsers(dest="train_command", required=True)

    tok = sub.add_parser("tokenizer", help="train the byte-level BPE on the stdlib train split")
    tok.add_argument("--out", required=True, help="folder to save the tokenizer to")
    tok.add_argument("--vocab-size", type=int, default=8192)
    tok.set_defaults(func=_cmd_tokenizer)

    lm = sub.add_parser("lm", help="train or resume a target (LM loss) or drafter (distillation)")
    lm.add_argument("--preset", choices=sorted(PRESETS), default="code-target")
    lm.add_argument("--out", required=True, help="run folder: checkpoint/ (resume) and final/")
    lm.add_argument("--tokenizer", required=True, help="tokenizer folder (from `specdec train tokenizer`)")
    lm.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    lm.add_argument("--stop-after", type=float, default=None, metavar="SECONDS",
                    help="checkpoint and stop after this long (resume later)")
    lm.add_argument("--stop-at-step", type=int, default=None, metavar="STEP",
                    help="checkpoint and stop at this step (resume later)")
    _add_config_flags(lm)
    lm.set_defaults(func=_cmd_lm)

    block = sub.add_parser("block-drafter", help="distil SpecDec's block drafter from the target (resumable)")
    block.add_argument("--out", required=True, help="run folder: checkpoint/ (resume) and final/")
    block.add_argument("--stop-after", type=float, default=None, metavar="SECONDS",
                       help="checkpoint and stop after this long (resume later)")
    block.add_argument("--stop-at-step", type=int, default=None, metavar="STEP",
                       help="checkpoint and stop at this step (resume later)")
    block.add_argument("--reschedule-to", type=int, default=None, metavar="STEPS",
                       help="on resume, end the lr and glancing schedules at STEPS instead of the saved max_steps")
    block.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    block.add_argument("--data", default=None, metavar="FILE",
                       help="a `specdec data outputs` file of --target (any target, decoder-only or encoder-decoder; "
                            "held out: its .valid.jsonl); replaces --outputs and --valid")
    block.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (an encoder-decoder target's drafter)")
    _add_measure_flags(block)
    _add_config_flags(block, BlockTrainConfig, suffix=" (default: {default})")
    block.set_defaults(func=_cmd_block_drafter)

    ev = sub.add_parser("block-eval", help="a block drafter's offline figures: tau by k, forward times")
    ev.add_argument("--model", required=True, help="the block drafter's folder")
    ev.add_argument("--valid", required=True, help="held-out `specdec train outputs --split validation` file")
    ev.add_argument("--target", default="code-target")
    ev.add_argument("--drafter", default="code-drafter", help="autoregressive drafter compared ('' for none)")
    ev.add_argument("--records", type=int, default=300, help="greedy records measured")
    ev.add_argument("--steps", type=int, default=24, help="timed forwards per probe (medians)")
    ev.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ev.add_argument("--out", default=None, help="also write the figures as JSON here")
    ev.set_defaults(func=_cmd_block_eval)

    gen = sub.add_parser("outputs", help="the target's continuations of train-split prompts (drafter data; resumable)")
    gen.add_argument("--target", required=True, help="the target model (a folder or a shipped name)")
    gen.add_argument("--out", required=True, help="JSONL file to append to (run again to resume)")
    gen.add_argument("--num-prompts", type=int, default=8000, help="function prefixes to continue")
    gen.add_argument("--split", choices=["train", "validation"], default="train")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--batch-size", type=int, default=32)
    gen.add_argument("--sampled-every", type=int, default=4,
                     help="every N-th prompt is continued by sampling at temperature 1 (0 = all greedy)")
    gen.add_argument("--dtype", default=None, help="None = fp32 on CPU; bf16 is faster where the CPU has it")
    gen.add_argument("--device", default=None)
    gen.add_argument("--seed", type=int, default=0)
    gen.set_defaults(func=_cmd_outputs)

    dr = sub.add_parser("drafter",
                        help="a small drafter for any target, distilled on its `specdec data outputs` (resumable)",
                        description="Build a drafter from the target's own config class (--layers, --hidden, or "
                        "--init first-layers) and distil it on the target's outputs (KL to the target at every "
                        "position). OUT/checkpoint resumes (Ctrl-C writes one); OUT/final is a plain transformers "
                        "folder with a model card and, unless --no-measure, the drafter's greedy alpha, tau and "
                        "speedup on the held-out prompts.")
    dr.add_argument("--out", required=True, help="run folder: checkpoint/ (resume) and final/")
    dr.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    dr.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    dr.add_argument("--stop-at-step", type=int, default=None, metavar="STEP",
                    help="checkpoint and stop at this step (resume later)")
    dr.add_argument("--stop-after", type=float, default=None, metavar="SECONDS",
                    help="checkpoint and stop after this long (resume later)")
    _add_measure_flags(dr)
    _add_config_flags(dr, DrafterTrainConfig, suffix=" (default: {default})")
    dr.set_defaults(func=_cmd_drafter)

    fd = sub.add_parser("feature-drafter",
                        help="an EAGLE-3-style feature drafter for any target, on its `specdec data outputs` "
                             "(resumable)",
                        description="One decoder layer of the target's class reading three of the target's layers "
                        "and the next token, trained with training-time test (EAGLE-3): KL to the target at every "
                        "drafted depth. OUT/checkpoint resumes (Ctrl-C writes one); OUT/final holds the drafter "
                        "(its own weights; the target's embedding and head are bound at load) and a model card with "
                        "the held-out KL, agreement and greedy acceptance per depth.")
    fd.add_argument("--out", required=True, help="run folder: checkpoint/ (resume) and final/")
    fd.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    fd.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    fd.add_argument("--stop-at-step", type=int, default=None, metavar="STEP",
                    help="checkpoint and stop at this step (resume later)")
    fd.add_argument("--stop-after", type=float, default=None, metavar="SECONDS",
                    help="checkpoint and stop after this long (resume later)")
    _add_config_flags(fd, FeatureDrafterTrainConfig, suffix=" (default: {default})")
    fd.set_defaults(func=_cmd_feature_drafter)

    pd = sub.add_parser("parallel-drafter",
                        help="a target-conditioned parallel drafter (k tokens in one forward) for any target, on its "
                             "`specdec data outputs` (resumable)",
                        description="Decoder layers of the target's class over the target's features and a block of "
                        "mask slots, trained on blocks cut at random offsets: KL to the target at every mask slot. "
                        "OUT/checkpoint resumes (Ctrl-C writes one); OUT/final holds the drafter and a model card.")
    pd.add_argument("--out", required=True, help="run folder: checkpoint/ (resume) and final/")
    pd.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    pd.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    pd.add_argument("--stop-at-step", type=int, default=None, metavar="STEP",
                    help="checkpoint and stop at this step (resume later)")
    pd.add_argument("--stop-after", type=float, default=None, metavar="SECONDS",
                    help="checkpoint and stop after this long (resume later)")
    _add_config_flags(pd, ParallelDrafterTrainConfig, suffix=" (default: {default})")
    pd.set_defaults(func=_cmd_parallel_drafter)

    fe = sub.add_parser("feature-eval",
                        help="a feature drafter's held-out greedy acceptance per depth (teacher-forced), beside a "
                             "drafter model's")
    fe.add_argument("--drafter", required=True, help="the feature drafter's folder ('' for the compared ones alone)")
    fe.add_argument("--target", default="models/code-target")
    fe.add_argument("--compare", nargs="*", default=["code-drafter"], help="drafter models measured beside it")
    fe.add_argument("--prompts", type=int, default=50, help="held-out test-split prompts (default: %(default)s)")
    fe.add_argument("--max-new-tokens", type=int, default=128, help="the target's greedy continuation per prompt")
    fe.add_argument("--depth", type=int, default=8, help="drafting depths measured (default: %(default)s)")
    fe.add_argument("--seed", type=int, default=0, help="which prompts (one per test file)")
    fe.add_argument("--threads", type=int, default=1)
    fe.add_argument("--output", default=None, help="also write the figures (JSON) here")
    fe.add_argument("--rows", default=None, metavar="JSON",
                    help="keep the target's continuations here (read when it exists): measure several drafters on them")
    fe.set_defaults(func=_cmd_feature_eval)

    exp = sub.add_parser("export", help="save a trained model for shipping (bf16 safetensors shards)")
    exp.add_argument("src")
    exp.add_argument("dst")
    exp.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    exp.set_defaults(func=_cmd_export)

    stok = sub.add_parser("seq2seq-tokenizer", help="train the shared English/German BPE on a gettext corpus")
    stok.add_argument("--data", required=True, help="a `specdec data gettext` folder")
    stok.add_argument("--out", required=True, help="folder to save the tokenizer to")
    stok.add_argument("--vocab-size", type=int, default=8000)
    stok.set_defaults(func=_cmd_seq2seq_tokenizer)

    s2s = sub.add_parser("seq2seq", help="train or resume an encoder-decoder translation model (Marian)")
    s2s.add_argument("--preset", choices=sorted(SEQ2SEQ_PRESETS), default="translate-target")
    s2s.add_argument("--out", required=True, help="run folder: checkpoint/ (resume) and final/")
    s2s.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    s2s.add_argument("--stop-after", type=float, default=None, metavar="SECONDS",
                     help="checkpoint and stop after this long (resume later)")
    s2s.add_argument("--stop-at-step", type=int, default=None, metavar="STEP",
                     help="checkpoint and stop at this step (resume later)")
    _add_dataclass_flags(s2s, Seq2SeqTrainConfig)
    s2s.set_defaults(func=_cmd_seq2seq)

    sblk = sub.add_parser("seq2seq-block-drafter",
                          help="train or resume SpecDec's block drafter for an encoder-decoder target")
    sblk.add_argument("--out", required=True, help="run folder: checkpoint/ (resume) and final/")
    sblk.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    sblk.add_argument("--stop-after", type=float, default=None, metavar="SECONDS",
                      help="checkpoint and stop after this long (resume later)")
    _add_dataclass_flags(sblk, Seq2SeqBlockConfig, skip=())
    sblk.set_defaults(func=_cmd_seq2seq_block)

    tr = sub.add_parser("translations",
                        help="a model's greedy translations of a split's sources (distillation data; resumable)")
    tr.add_argument("--model", required=True, help="the target's folder")
    tr.add_argument("--data", default="data/gettext-de", help="a `specdec data gettext` folder")
    tr.add_argument("--out", required=True, help="JSONL file to append to (run again to resume)")
    tr.add_argument("--split", choices=["train", "validation"], default="train")
    tr.add_argument("--batch-size", type=int, default=64)
    tr.add_argument("--chunk", type=int, default=2048, help="sources per write (a file cut short is a uniform sample)")
    tr.add_argument("--device", default="cpu")
    tr.set_defaults(func=_cmd_translations)

    sexp = sub.add_parser("seq2seq-export", help="save a trained encoder-decoder for shipping (safetensors)")
    sexp.add_argument("src")
    sexp.add_argument("dst")
    sexp.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    sexp.set_defaults(func=_cmd_seq2seq_export)

    sev = sub.add_parser("seq2seq-eval", help="BLEU and chrF of plain generate (greedy, beam) on a split")
    sev.add_argument("model", help="a model folder")
    sev.add_argument("--data", default="data/gettext-de", help="a `specdec data gettext` folder")
    sev.add_argument("--split", choices=["validation", "test"], default="test")
    sev.add_argument("--beams", type=int, nargs="+", default=[1, 5], help="beam sizes (1 = greedy)")
    sev.add_argument("--batch-size", type=int, default=64)
    sev.add_argument("--limit", type=int, default=None, help="only the split's first N pairs")
    sev.add_argument("--hypotheses", default=None, metavar="DIR", help="also write the translations here")
    sev.add_argument("--agreement-with", default=None, metavar="JSONL",
                     help="also report teacher-forced top-1 agreement with these target translations")
    sev.add_argument("--device", default="cpu")
    sev.set_defaults(func=_cmd_seq2seq_eval)

    card = sub.add_parser("card", help="measure the shipped pair and write both model cards (README.md)")
    card.add_argument("--target", default="models/code-target")
    card.add_argument("--drafter", default="models/code-drafter")
    card.add_argument("--target-run", default="runs/code-target-s3",
                      help="the target's last training run folder (earlier stages are found via its --init-from)")
    card.add_argument("--drafter-run", default="runs/code-drafter-s5",
                      help="the drafter's last training run folder (earlier stages are found via its --init-from)")
    card.add_argument("--bench-dir", default="bench-out/card",
                      help="a `specdec bench --methods plain-hf,plain,spec,spec-lookup --temperature 0 1` output "
                           "folder")
    card.set_defaults(func=_cmd_card)

    from specdec.heads.cli import register as register_head

    register_head(sub)
