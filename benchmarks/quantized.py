"""Plain decoding of a 409M-parameter Llama shape with bf16, int8 and int4 weights (issue 71's first measurement).

The shape of issue 71's table: hidden 1536, 16 layers, 12 heads of 128, intermediate 3328, an 8192-token vocabulary,
tied embeddings (409.0M parameters), random weights (``initializer_range`` 0.02), stored in bfloat16. Three forms of
the same weights, each decoded by specdec's plain loop (``autoregressive_generate``), greedy:

- ``bf16``: the stored weights as specdec runs them on the CPU (float32 compute, ``specdec.kernels`` installed: the
  blocked kernel reads them as bfloat16 pairs where it pays);
- ``int8``: torchao's ``Int8WeightOnlyConfig`` (one scale per output channel), float32 compute;
- ``int4``: torchao's ``IntxWeightOnlyConfig(int4, PerGroup(--group-size))``, float32 compute;

the quantized forms run specdec's int8 / int4 kernel inside the engine (``specdec.qlinear``) unless
``SPECDEC_LINEAR=off``;

each quantized from the bf16 weights with ``torchao.quantization.quantize_`` (what transformers' ``TorchAoConfig``
applies on load; ``specdec quantize`` writes the same tensors). The forms take turns, prompt by prompt within a
repeat, the order rotating per repeat; the figure is the median over repeats of the ms per decoded token: a run of
``--tokens`` new tokens less a run of one (the prompt's prefill and its first token), over ``--tokens`` - 1. Beside
each form, its floor: one pass over its stored bytes (the linear layers' weights as stored: bfloat16, or the
torchao tensors' int8 values, scales and zero points; the tied head counted once, as the model holds it) and one
pass over the bytes its kernels read (``kernels.bytes_read`` / ``qlinear.bytes_read``: int4 packed two a byte), at
the read bandwidth measured at each repeat (the fastest of a sum, a max and a copy of a 256 MiB buffer), and the time
of one pass over its linear layers with one-row inputs and its kernels (``bench.floor.weight_pass``: the products
alone, no attention, norms or Python of the step), three a repeat, median. The load
average is printed at each repeat. Every output is checked against that form's own ``generate``.

``--compiled``: each form also decoded on the compiled path (``--compile on``: its plain step compiled for one row
and one token, ``specdec.compiled.prepare``; its linears traced as ``specdec::blocked_linear`` or
``specdec::quantized_linear``), taking its turn with the others. The same model object serves both (no second copy
of the weights in memory): its compiled step is registered for the compiled turns and unregistered for the eager
ones (``set_compiled``), where its layers run the same kernels eagerly (the blocked operator on the bf16 pairs, the
quantized operator on the packed copy). The compiled step is kept in specdec's compile cache: a second run loads it.

    OMP_NUM_THREADS=2 python benchmarks/quantized.py --threads 2 --prompts 2 --tokens 17 --repeats 3
    OMP_NUM_THREADS=1 python benchmarks/quantized.py --threads 1 --prompts 1 --tokens 9 --repeats 3 --compiled

Needs torchao (``pip install 'specdec[quant]'``). The figures go in docs/journal/.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import specdec
from specdec import kernels, qlinear, quantized
from specdec.bench.floor import weight_pass


def stored_and_read(model: torch.nn.Module) -> tuple[int, int]:
    """The bytes of ``model``'s linear weights as stored (bfloat16 for a float model: it was stored so) and as its
    kernels read them in a decoding step (installed by a first decode)."""
    stored = read = 0
    for m in {id(m): m for m in model.modules() if isinstance(m, torch.nn.Linear)}.values():
        w = m.weight
        # a compiled step's layer reads its copy in its operator's layout (specdec.compiled.ops: _specdec_* buffers)
        copies = sum(t.numel() * t.element_size() for n, t in m._buffers.items() if n.startswith("_specdec_")
                     and t is not None)
        if type(w) in (torch.Tensor, torch.nn.Parameter):
            stored += w.numel() * 2
            read += copies or kernels.bytes_read(m) or w.numel() * w.element_size()
        else:
            own = sum(getattr(w, n).numel() * getattr(w, n).element_size() for n in w.tensor_data_names)
            stored += own
            read += copies or qlinear.bytes_read(m) or own
    return stored, read


def bandwidth(buffer: torch.Tensor, copy: torch.Tensor) -> float:
    """The fastest of three plain reads of ``buffer`` (bytes/s; a copy counts its write too)."""
    rates = []
    for read, moved in ((buffer.sum, 1), (buffer.max, 1), (lambda: copy.copy_(buffer), 2)):
        start = time.perf_counter()
        read()
        rates.append(moved * buffer.numel() * buffer.element_size() / (time.perf_counter() - start))
    return max(rates)


def build(seed: int) -> LlamaForCausalLM:
    config = LlamaConfig(hidden_size=1536, num_hidden_layers=16, num_attention_heads=12, num_key_value_heads=12,
                         head_dim=128, intermediate_size=3328, vocab_size=8192, tie_word_embeddings=True,
                         max_position_embeddings=1024, initializer_range=0.02, bos_token_id=1, eos_token_id=2,
                         pad_token_id=0)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.bfloat16).eval()  # stored bf16: its values are bf16 numbers
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=17)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--compiled", action="store_true", help="also time each form on the compiled path")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from torchao.quantization import quantize_

    stored = build(0)
    print(f"{sum(p.numel() for p in stored.parameters()) / 1e6:.1f}M parameters, {args.threads} threads, "
          f"torch {torch.__version__}", flush=True)
    forms = {"bf16": stored.float()}
    for name, to, group in (("int8", "int8", None), ("int4", "int4", args.group_size)):
        model = copy.deepcopy(forms["bf16"])
        quantize_(model, quantized.torchao_config(to, group))
        forms[name] = model.eval()
    steps = {}  # form -> its compiled step (``--compiled``)
    if args.compiled:
        from specdec.compiled import compiled_for, prepare, set_compiled

        for name in list(forms):
            started = time.perf_counter()
            choice = prepare(forms[name], "on", tokens=(1,), rows=(1,))
            assert choice.compiled, choice.reason
            print(f"{name} compiled: {choice.reason} ({time.perf_counter() - started:.0f} s)", flush=True)
            steps[name] = compiled_for(forms[name])
            set_compiled(forms[name], None)  # eager until a compiled turn
    for name, model in forms.items():
        weights = sum(t.numel() * t.element_size() for m in model.modules() for t in m._parameters.values()
                      if t is not None and type(t) in (torch.Tensor, torch.nn.Parameter))
        weights += sum(sum(getattr(t, n).numel() * getattr(t, n).element_size() for n in t.tensor_data_names)
                       for t in quantized._weights(model))
        print(f"{name}: {quantized.describe(model) or 'plain'}, {weights / 2**20:.0f} MiB of weights in memory",
              flush=True)
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 8192, (24,), generator=generator).tolist() for _ in range(args.prompts)]
    names = [*forms, *(f"{name} compiled" for name in steps)]
    times: dict[str, list[float]] = {name: [] for name in names}

    def use(name: str) -> torch.nn.Module:
        """The model of ``name``, its compiled step registered for a compiled turn and unregistered for an eager one."""
        form = name.removesuffix(" compiled")
        if steps:
            set_compiled(forms[form], steps[form] if name.endswith(" compiled") else None)
        return forms[form]

    references: dict[str, list[list[int]]] = {}
    for name in names:  # warm up, and the exactness check against each form's own generate
        model = use(name)
        for i, prompt in enumerate(prompts):
            ids = torch.tensor([prompt])
            if name in forms:
                references.setdefault(name, []).append(model.generate(
                    ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.tokens, min_new_tokens=args.tokens,
                    do_sample=False, pad_token_id=0)[0, len(prompt):].tolist())
            ref = references[name.removesuffix(" compiled")][i]
            ours = specdec.autoregressive_generate(model, prompt, max_new_tokens=args.tokens, stop_token_ids=[]).tokens
            assert ours == ref, f"{name}: plain decoding differs from generate\nours {ours}\nref  {ref}"
        if name.endswith(" compiled"):
            assert steps[name.removesuffix(" compiled")].calls["eager"] == 0
        print(f"{name}: plain decoding equals generate on {len(prompts)} prompts; kernels: {kernels.describe(model)}, "
              f"{qlinear.installed(model)} layers on specdec's int8/int4 kernel; helper {kernels.helper_on()}",
              flush=True)
    sizes = {name: stored_and_read(forms[name.removesuffix(" compiled")]) for name in names}
    buffer = torch.ones(64 << 20)
    copy_to = torch.empty_like(buffer)
    rates: list[float] = []
    passes: dict[str, list[float]] = {name: [] for name in names}  # one pass over the linear layers, its kernels

    def run(name: str, prompt: list[int], tokens: int) -> float:
        start = time.perf_counter()
        res = specdec.autoregressive_generate(use(name), prompt, max_new_tokens=tokens, stop_token_ids=[])
        assert len(res.tokens) == tokens
        return time.perf_counter() - start

    for repeat in range(args.repeats):
        order = names[repeat % len(names):] + names[:repeat % len(names)]
        spent = {name: 0.0 for name in names}
        for prompt in prompts:
            for name in order:
                spent[name] += run(name, prompt, args.tokens) - run(name, prompt, 1)
        rates.append(bandwidth(buffer, copy_to))
        for name in order:  # a compiled form's layers are its eager form's: one pass each
            if name in forms:
                passes[name].append(weight_pass(forms[name], passes=3).seconds * 1e3)
        for name in names:
            times[name].append(spent[name] * 1e3 / ((args.tokens - 1) * len(prompts)))
        print(f"repeat {repeat}: " + ", ".join(f"{n} {times[n][-1]:.1f}" for n in names)
              + f" ms/token; read {rates[-1] / 1e9:.1f} GB/s; load {os.getloadavg()[0]:.2f}", flush=True)
    base = statistics.median(times["bf16"])
    rate = statistics.median(rates)
    print(f"read bandwidth (median) {rate / 1e9:.1f} GB/s")
    for name in names:
        med = statistics.median(times[name])
        stored, read = sizes[name]
        each = ", ".join(f"{t:.1f}" for t in times[name])
        linear = passes[name.removesuffix(" compiled")]
        print(f"{name:14s} median {med:7.1f} ms/token ({med / base:.2f}x bf16)  [{each}]"
              f"  stored {stored / 2**20:.0f} MiB: {med / (stored / rate * 1e3):.2f}x one pass;"
              f"  read {read / 2**20:.0f} MiB: {med / (read / rate * 1e3):.2f}x one pass;"
              f"  its linear layers' pass {statistics.median(linear):.1f} ms")


if __name__ == "__main__":
    main()
