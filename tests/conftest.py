"""Shared fixtures of the core tests: tiny causal LMs built from configs, with random weights.

Helpers (import them in other tests with ``from conftest import ...``):
- ``build_tiny(arch, vocab_size=..., layers=..., seed=...)``: a tiny Llama / GPT-2 / Qwen2 /
  GPT-NeoX causal LM in eval mode; ``initializer_range`` is large so logits are spread out and
  greedy near-ties are rare.
- ``truncated_copy(model, layers)``: a drafter that shares the target's embeddings, head and first
  layers, so it agrees with the target often (random weights otherwise agree ~1/V of the time).
- ``ToyLM``: a one-matrix "causal LM" whose logits depend on the whole prefix through its KV
  cache; a real ``PreTrainedModel`` that is fast enough for tens of thousands of generations.
- ``char_tokenizer(vocab_size)``: a character-level fast tokenizer for stop-string tests.
- ``target_with_outputs(root, build)``: a drafter trainer's inputs, a tiny target folder and the outputs file of
  its own continuations (``root/target``, ``root/data.jsonl``).
- ``assert_same_greedy(target, prompt, ours, reference)``: token equality, allowing a divergence
  only at a near tie of the target's top-2 logits (recomputed without a cache).
- ``drive_alike(static, reference, slots, join)``: random ragged forwards, rollbacks, selects, joins and
  compactions on a static cache handle and its eager reference, their logits compared at every step.
- ``shipped_translations`` (fixture): the shipped translate-target, its tokenizer, a few gettext-like
  sources and the target's own greedy ``generate`` of each.
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import os
import random
import shutil
import tempfile
import warnings
from collections.abc import Callable
from typing import NamedTuple

import pytest
import torch
from torch import nn
from transformers import (
    GenerationMixin,
    GPT2Config,
    GPT2LMHeadModel,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)
from transformers.modeling_outputs import CausalLMOutputWithPast

from specdec.batch import kept_order

# The session's own on-disk caches (specdec's compile cache, inductor's code): empty at the start, so what a test
# sees never depends on what an earlier run, or the user, left in ~/.cache (a cached graph loads in a fresh process
# in tests/test_compiled*.py's second-start tests, on purpose).
_CACHE = tempfile.mkdtemp(prefix="specdec-tests-cache-")
os.environ["XDG_CACHE_HOME"] = _CACHE
os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)  # specdec.compiled.use_cache_folder points it into _CACHE
# a server with --compile auto (the default) on a CPU compiles beside serving (specdec.serve.background): the suite's
# servers stay eager, as their tests expect; tests/test_background.py switches it on
os.environ["SPECDEC_COMPILE_BESIDE"] = "off"
atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)

torch.set_num_threads(1)  # tiny models: threads only add contention on a shared 2-core machine

ARCHS = ("llama", "gpt2", "qwen2", "gpt_neox")
TIE_TOL = 1e-4  # a greedy divergence is acceptable only where the target's top-2 logits are this close


def count_calls(monkeypatch, owner: object, name: str, counts: dict[str, int], key: str) -> None:
    """Replace ``owner.name`` (for the test) with itself counting its calls in ``counts[key]``."""
    original = getattr(owner, name)

    def counted(*args, **kwargs):
        counts[key] += 1
        return original(*args, **kwargs)
    monkeypatch.setattr(owner, name, counted)


def ragged_forward(model, ids: torch.Tensor, valid: torch.Tensor | None, within=None, **options):
    """One forward of ``ids`` [B, T] (``valid``: the real ones) into a fresh ``RaggedCache`` of ``model``, inside
    ``within(model)`` where given (a context manager such as ``attention.prefilling``): (its output, the cache)."""
    from specdec.cache import RaggedCache

    cache = RaggedCache(model, ids.shape[0])
    with torch.inference_mode(), within(model) if within is not None else contextlib.nullcontext():
        return cache.forward(ids, valid, **options), cache


def build_tiny(
    arch: str = "llama",
    *,
    vocab_size: int = 96,
    hidden: int = 32,
    layers: int = 2,
    max_positions: int = 256,
    seed: int = 0,
    bos_token_id: int = 1,
    eos_token_id: int = 2,
    init_range: float = 0.3,
) -> PreTrainedModel:
    """A tiny causal LM of ``arch`` with random weights (seeded), in eval mode."""
    common = {"vocab_size": vocab_size, "bos_token_id": bos_token_id, "eos_token_id": eos_token_id,
                  "initializer_range": init_range, "pad_token_id": 0}
    torch.manual_seed(seed)
    if arch == "llama":
        config = LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                             num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=max_positions, **common)
        model = LlamaForCausalLM(config)
    elif arch == "gpt2":
        config = GPT2Config(n_embd=hidden, n_layer=layers, n_head=4, n_positions=max_positions, **common)
        model = GPT2LMHeadModel(config)
    elif arch == "qwen2":
        config = Qwen2Config(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                             num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=max_positions, **common)
        model = Qwen2ForCausalLM(config)
    elif arch == "gpt_neox":
        config = GPTNeoXConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                               num_attention_heads=4, max_position_embeddings=max_positions, **common)
        model = GPTNeoXForCausalLM(config)
    else:
        raise ValueError(f"unknown arch {arch!r}; choose from {ARCHS}")
    model.generation_config.pad_token_id = 0
    return model.eval()


def truncated_copy(model: PreTrainedModel, layers: int = 1) -> PreTrainedModel:
    """A drafter sharing ``model``'s weights but keeping only its first ``layers`` blocks."""
    drafter = copy.deepcopy(model)
    for attr in ("model", "transformer", "gpt_neox"):
        body = getattr(drafter, attr, None)
        if body is None:
            continue
        blocks_name = "layers" if hasattr(body, "layers") else "h"
        setattr(body, blocks_name, getattr(body, blocks_name)[:layers])
        break
    text = drafter.config
    for name in ("num_hidden_layers", "n_layer"):
        if hasattr(text, name):
            setattr(text, name, layers)
    if getattr(text, "layer_types", None) is not None:
        text.layer_types = text.layer_types[:layers]
    return drafter.eval()


class ToyConfig(PretrainedConfig):
    model_type = "specdec-toy"

    def __init__(self, vocab_size: int = 12, hidden_size: int = 8, max_position_embeddings: int = 64,
                 num_hidden_layers: int = 1, **kwargs):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.max_position_embeddings = max_position_embeddings
        self.num_hidden_layers = num_hidden_layers
        super().__init__(**kwargs)


class ToyLM(PreTrainedModel, GenerationMixin):
    """logits_t = W tanh(e(x_t) + 3 * mean(e(x_<=t))): the prefix enters only through the KV cache; the
    mean runs over the live slots of the attention mask (batches of ragged rows)."""

    config_class = ToyConfig
    base_model_prefix = "toy"

    def __init__(self, config: ToyConfig) -> None:
        super().__init__(config)
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def get_input_embeddings(self) -> nn.Module:
        return self.embed

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def forward(self, input_ids, cache=None, use_cache=True, logits_to_keep=0, attention_mask=None,
                past_key_values=None, **kwargs):
        # ``cache`` as transformers >= 5.24 and its generate name it, ``past_key_values`` as 5.23's generate does
        past_key_values = cache if cache is not None else past_key_values
        x = self.embed(input_ids)  # [B, n, H]
        n = x.shape[1]
        if past_key_values is not None:
            keys, _ = past_key_values.update(x[:, None], x[:, None], 0)  # [B, 1, L, H]
            ctx = keys[:, 0]  # [B, L, H]
        else:
            ctx = x
        length = ctx.shape[1]
        live = torch.ones(ctx.shape[:2]) if attention_mask is None else attention_mask.to(x.dtype)  # [B, L]
        total = (ctx * live[..., None]).cumsum(dim=1)[:, length - n :]  # [B, n, H] over live slots only
        counts = live.cumsum(dim=1)[:, length - n :, None].clamp_min(1)  # [B, n, 1]
        logits = self.lm_head(torch.tanh(x + 3 * total / counts))  # [B, n, V]
        if logits_to_keep:
            logits = logits[:, -logits_to_keep:]
        return CausalLMOutputWithPast(logits=logits, past_key_values=past_key_values)


def build_toy(vocab_size: int = 12, hidden_size: int = 8, seed: int = 0, scale: float = 1.0) -> ToyLM:
    """A seeded ToyLM; ``scale`` multiplies the head (larger = peakier distributions)."""
    torch.manual_seed(seed)
    model = ToyLM(ToyConfig(vocab_size=vocab_size, hidden_size=hidden_size, eos_token_id=None))
    with torch.no_grad():
        nn.init.normal_(model.embed.weight)
        nn.init.normal_(model.lm_head.weight, std=scale)
    return model.eval()


def target_with_outputs(root, build: Callable[[int], PreTrainedModel]):
    """``build(vocab)``'s model saved to ``root/target`` with the tests' word tokenizer (``tiny_models``), its pad,
    bos and eos the tokenizer's end token, and ``root/data.jsonl``: its continuations (12 new tokens) of 24 short code
    prompts, a fifth held out, as ``specdec data outputs`` writes them. Returns ``root``."""
    from tiny_models import build_tokenizer

    from specdec.train.outputs import user_outputs

    tok = build_tokenizer()
    target = build(len(tok))
    target.config.pad_token_id = target.config.bos_token_id = target.config.eos_token_id = tok.eos_token_id
    target.save_pretrained(root / "target")
    tok.save_pretrained(root / "target")
    prompts = [f"def f{i}(x{i}):" for i in range(12)] + [f"for i in range({i}):" for i in range(12)]
    (root / "prompts.txt").write_text("\n".join(prompts) + "\n")
    user_outputs(str(root / "target"), root / "prompts.txt", root / "data.jsonl", max_new_tokens=12, batch_size=8,
                 valid_share=0.2, progress=False, log=lambda m: None)
    return root


def char_tokenizer(chars: str = "abcdefghijklmnopqrstuvwxyz .,!?\n") -> PreTrainedTokenizerFast:
    """A character-level fast tokenizer: id 0 <pad>, 1 <s>, 2 </s>, then one id per character."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{c: i + 3 for i, c in enumerate(chars)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def hf_greedy(target: PreTrainedModel, prompt: list[int], max_new_tokens: int, stop_ids: list[int]) -> list[int]:
    """The target's own greedy decoding via ``generate`` (new tokens only)."""
    out = target.generate(
        torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new_tokens,
        eos_token_id=stop_ids or None, pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
    )
    tokens = out[0, len(prompt):].tolist()
    if stop_ids:  # generate pads finished rows; cut at the first stop token (kept)
        for i, t in enumerate(tokens):
            if t in stop_ids:
                return tokens[: i + 1]
    return tokens


def top2_gap(target: PreTrainedModel, sequence: list[int]) -> float:
    """Gap between the target's two largest next-token logits after ``sequence`` (no cache)."""
    with torch.no_grad():
        logits = target(torch.tensor([sequence]), use_cache=False).logits[0, -1].float()
    top = logits.topk(2).values
    return float(top[0] - top[1])


def assert_same_greedy(target: PreTrainedModel, prompt: list[int], ours: list[int], reference: list[int]) -> None:
    """``ours == reference``, except a divergence at a near tie (then the rest may differ)."""
    for i, (a, b) in enumerate(zip(ours, reference)):
        if a != b:
            gap = top2_gap(target, prompt + reference[:i])
            assert gap < TIE_TOL, (
                f"greedy mismatch at new token {i}: ours {a}, target {b}, top-2 logit gap {gap:.2e} "
                f"(not a tie)\nours {ours}\nref  {reference}"
            )
            return
    assert len(ours) == len(reference), f"lengths differ: ours {len(ours)}, reference {len(reference)}"


@pytest.fixture(scope="session", params=("llama", "gpt2", "qwen2"))
def arch(request) -> str:
    return request.param


@pytest.fixture(scope="session")
def llama_target() -> PreTrainedModel:
    return build_tiny("llama", seed=0)


@pytest.fixture(scope="session")
def llama_drafter(llama_target) -> PreTrainedModel:
    """A drafter that agrees with ``llama_target`` often (its truncated copy)."""
    return truncated_copy(llama_target, 1)


@pytest.fixture(scope="session")
def llama_wild_drafter() -> PreTrainedModel:
    """A drafter with independent random weights: it disagrees with the target almost always."""
    return build_tiny("llama", seed=1, layers=1, hidden=16)


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module (``pytestmark = pytest.mark.usefixtures("one_thread")``): tiny models
    gain nothing from two, and two threads on a shared, busy CPU spin against each other (runs 20-40x slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def drive_alike(static, reference, slots: int, join: Callable[[random.Random], None], *, hidden: bool = False) -> int:
    """Drive a static cache handle (``specdec.compiled``) and its eager reference (``RaggedCache``,
    ``Seq2SeqCache``) alike through 40 random forwards of 1-3 tokens (left and right padding), rollbacks
    (``keep``), selects, joins (``join(rng)`` merges new rows into both, up to 4 rows) and compactions
    (forced when fewer than 4 of the ``slots`` would be left): their logits agree at every step (with ``hidden``,
    every other step's last hidden states too) and so do the rows' live counts. Nothing is compiled here (the
    static step runs eagerly). Returns how many compactions there were."""
    rng = random.Random(0)
    compactions = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # every shape runs eagerly here, by design
        for step in range(40):
            rows, n = static.rows, rng.randint(1, 3)
            ids = torch.randint(3, 96, (rows, n))
            valid = None
            if rows > 1 and rng.random() < 0.5:
                counts = torch.tensor([rng.randint(1, n) for _ in range(rows)])
                columns = torch.arange(n)[None]
                valid = columns >= n - counts[:, None] if rng.random() < 0.5 else columns < counts[:, None]
            wanted = hidden and step % 2 == 1  # the last hidden states too (an acceptance head reads them)
            extra = {"output_hidden_states": wanted} if hidden else {}
            with torch.no_grad():
                a = static.forward(ids, valid, logits_to_keep=n, **extra)
                b = reference.forward(ids, valid, logits_to_keep=n, **extra)
            real = valid if valid is not None else torch.ones(rows, n, dtype=torch.bool)
            assert torch.allclose(a.logits[real], b.logits[real], atol=1e-5), f"step {step}"
            if wanted:
                assert torch.allclose(a.hidden_states[-1][real], b.hidden_states[-1][real], atol=1e-5), f"step {step}"
            assert static.live.tolist() == reference.live.tolist()
            fed = real.sum(1)
            keep = torch.tensor([rng.randint(0, int(f)) for f in fed]) + static.live - fed
            before = static.used
            static.keep(keep)
            reference.keep(keep)
            compactions += static.used < before - n  # the pointer fell back past this step's slots
            if step % 9 == 4 and static.rows > 1:  # a row leaves: the rest in order, as
                                                   # the decoder moves them, or mixed
                stay = sorted(rng.sample(range(static.rows), static.rows - 1))
                how = step // 9 % 3  # not drawn from rng: the joins and steps after stay those of before
                order = stay if how == 0 else kept_order([i not in stay for i in range(static.rows)]) if how == 1 else \
                    random.Random(step).sample(stay, len(stay))
                rows = torch.tensor(order)
                static.select(rows)
                reference.select(rows)
            if step % 9 == 7 and static.rows < 4:
                join(rng)
            if static.used + 3 > slots - 4:
                static.compact()
                compactions += 1
    return compactions


TRANSLATE_SOURCES = ("Cannot open file %s: No such file or directory", "Save the document before closing?",
                     "The file %s could not be copied to %s.", "%d files removed")
TRANSLATE_NEW = 40  # new tokens a translation may take


class Translations(NamedTuple):
    """The shipped translate-target (float32, eval), its tokenizer, ``TRANSLATE_SOURCES`` and each source's
    greedy ``generate`` (new tokens, the decoder's start token dropped)."""

    target: PreTrainedModel
    tokenizer: object
    sources: list[str]
    expected: list[list[int]]


@pytest.fixture(scope="module")
def shipped_translations() -> Translations:
    """``Translations`` of models/translate-target, loaded once per test module (a module may compile it)."""
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    from specdec.loading import default_model_path

    folder = default_model_path("translate-target")
    target = AutoModelForSeq2SeqLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    expected = []
    for source in TRANSLATE_SOURCES:
        ids = tokenizer(source, return_tensors="pt").input_ids
        with torch.no_grad():
            expected.append(target.generate(ids, attention_mask=torch.ones_like(ids), num_beams=1, do_sample=False,
                                            max_new_tokens=TRANSLATE_NEW)[0, 1:].tolist())
    return Translations(target, tokenizer, list(TRANSLATE_SOURCES), expected)
