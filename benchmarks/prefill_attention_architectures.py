"""Every decoder-only architecture's prefill with the shared attention (``specdec.attention``) against sdpa's:
``python benchmarks/prefill_attention_architectures.py``.

Each causal-LM model type the architecture sweep builds (``benchmarks/architecture_sweep.py``: its tiny configs, but
twice as wide, 128, with heads of 32, so that the operator's head dimensions apply), in float32, one thread, the
helper on: a 40-token prompt alone and a batch of two with one row left-padded by 6, prefilled into the cache
specdec gives it (``seq2seq.cache_for``: a ``RaggedCache``, or a ``RecurrentCache`` for a hybrid) with the model's
own sdpa attention, inside ``attention.prefilling``, and in float64. Printed per
type: how many attention calls the operator took (one per layer and row where it covers them), the largest
difference of the real positions' logits from the float64 prefill for sdpa and for the operator, and OK where the
operator's is within twice sdpa's (or 1e-4). Where the float64 copy cannot run (grouped expert products are
float32 and half only), the operator's logits are set against sdpa's: OK within 1e-4 of the logits' largest size. A
type that cannot be built is listed with its error. Findings: docs/journal/2026-12-06-prefill-attention.md, "A
prefill's attention on both cores".
"""

from __future__ import annotations

import contextlib
import copy
import signal
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import architecture_sweep as sweep

from specdec import attention, kernels
from specdec.seq2seq import cache_for

WIDTHS = ("hidden_size", "d_model", "n_embd", "emb_dim", "embed_dim", "dim", "word_embed_proj_dim", "d_embed",
          "projection_dim")
HEADS = ("head_dim", "d_kv", "kv_channels", "attention_head_dim", "v_head_dim", "qk_head_dim", "kv_lora_rank",
         "q_lora_rank")


def check(model_type: str, taken: list[int]) -> str:
    model = sweep.build(model_type, False).float().eval()
    if not attention.wanted(model):
        return f"not covered ({getattr(model.config, '_attn_implementation', None)} attention)"
    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(3, min(vocab, 1000), (2, 40), generator=torch.Generator().manual_seed(0))
    padded = torch.ones(2, 40, dtype=torch.bool)
    padded[1, :6] = False
    exact_model = copy.deepcopy(model).double()
    verdicts = []
    for rows, valid in ((1, None), (2, padded)):
        x = ids[:rows]
        out = {}
        for name, m, shared in (("sdpa", model, False), ("shared", model, True), ("float64", exact_model, False)):
            taken[0] = 0
            try:
                cache = cache_for(m, rows, "cpu")
                with torch.inference_mode(), attention.prefilling(m) if shared else contextlib.nullcontext():
                    out[name] = cache.forward(x, valid, logits_to_keep=40).logits.double()
            except RuntimeError:
                if name != "float64":
                    raise
            if shared:
                calls = taken[0]
        real = valid if valid is not None else torch.ones(1, 40, dtype=torch.bool)
        if "float64" in out:
            sdpa = float((out["sdpa"] - out["float64"])[real].abs().max())
            shared = float((out["shared"] - out["float64"])[real].abs().max())
            ok = shared <= max(2 * sdpa, 1e-4)
            verdicts.append(f"{rows} row(s): {calls} calls taken, sdpa {sdpa:.1e}, shared {shared:.1e} from float64")
        else:
            gap = float((out["shared"] - out["sdpa"])[real].abs().max())
            ok = gap <= 1e-4 * max(1.0, float(out["sdpa"][real].abs().max()))
            verdicts.append(f"{rows} row(s): {calls} calls taken, shared {gap:.1e} from sdpa (no float64)")
        verdicts[-1] += " OK" if ok else " DIFFERS"
    return "; ".join(verdicts)


def main() -> None:
    warnings.filterwarnings("ignore")
    for key in WIDTHS:
        sweep.SMALL[key] = 128
    for key in HEADS:
        sweep.SMALL[key] = 32
    sweep.SMALL["qk_rope_head_dim"] = sweep.SMALL["qk_nope_head_dim"] = 16
    torch.set_num_threads(1)
    if not kernels.blocked_op():
        sys.exit("specdec's operators did not build (a C and a C++ compiler are needed)")
    kernels._set_helper(True)
    taken = [0]
    chunked = attention._chunked

    def counted(*args):
        taken[0] += 1
        return chunked(*args)
    attention._chunked = counted

    def timeout(*_):
        raise TimeoutError("over 60 s")
    signal.signal(signal.SIGALRM, timeout)
    for model_type, seq2seq in sweep.model_types(None):
        if seq2seq:
            continue
        signal.alarm(60)
        try:
            result = check(model_type, taken)
        except Exception as error:  # noqa: BLE001 - a type that cannot be built or run is listed, not fatal
            result = f"error: {type(error).__name__}: {str(error).splitlines()[0][:100] if str(error) else ''}"
        finally:
            signal.alarm(0)
        print(model_type, result, flush=True)


if __name__ == "__main__":
    main()
