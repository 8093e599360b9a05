"""A small causal LM as drafter (Leviathan et al. 2023; Chen et al. 2023), for a batch of rows.

Contract: the drafter keeps its own KV cache across rounds (a ``RaggedCache``) and feeds the model only tokens
it has not seen. Between rounds each row holds ``pending`` tokens, committed but not yet in its cache (the
newest committed token, the last draft of an all-accepted round, or everything another drafter proposed).
``propose`` forwards them (left-padded) in the call that yields the first draft, so the catch-up costs no
extra forward, then drafts ``max(limit)`` positions; a row's proposal ends at its own limit or its stop rule.
Invariant after every commit, per row: cache live tokens + pending == committed. Rollback (``follow``) keeps
the longest prefix of this round's forwarded drafts that agrees with what the row committed: one rule for a
rejection, a full acceptance, a shorter limit and rows another drafter proposed.

Logits are aligned to the target's vocabulary (sliced or padded with -inf) before the sampler's warpers, so q
and p share one index space. ``check_vocabularies`` refuses a drafter whose vocabulary is not the target's
(sizes may differ by at most ``PADDING_FRACTION`` of padding; where both tokenizers are known they must agree
on every id).

Forms (``drafter_in``): since the target verifies every draft, the drafter may run cheaper than the target
without changing the output: "int8" (CPU only), "bf16", "float32", or "auto": int8 for a float32 model that
drafts every round on a CPU with quantised kernels, not behind prompt lookup, where the gain was within the
noise. A converted model is a copy, kept while its source lives. The measurements:
docs/journal/drafter-form.md.
"""

from __future__ import annotations

import copy
import warnings
import weakref
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from specdec.batch import PromptBatch, left_mask, left_padded
from specdec.cache import CacheFactory, registered_cache
from specdec.config import DRAFTER_DTYPES
from specdec.drafters.base import (
    ENDED_LIMIT,
    ENDED_NONE,
    ENDED_THRESHOLD,
    DraftStep,
    FollowingDrafter,
    Proposal,
    StopRule,
)
from specdec.kernels import install
from specdec.loading import context_limit, input_device
from specdec.loading import vocab_size as logits_size
from specdec.quantized import describe
from specdec.sampling import Sampler, check_finite
from specdec.selfcheck import checked_for
from specdec.seq2seq import decoder_start_id, decoding_cache, is_encoder_decoder, prefill_into, rows_apart

# Vocabularies of different sizes are one vocabulary with padding when they differ by at most this
# share of the target's (padding to a multiple of 64 or 128 adds far less on real vocabularies).
PADDING_FRACTION = 1 / 32
FIX = "use a drafter trained with the target's tokenizer"


@lru_cache(maxsize=16)
def _folder_vocab(folder: str) -> tuple[tuple[int, str], ...] | None:
    """(id, token) pairs of the tokenizer stored in a model folder, or None when there is none."""
    path = Path(folder)
    if not any((path / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        return None
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    except (OSError, ValueError):
        return None
    return tuple(sorted((i, t) for t, i in tokenizer.get_vocab().items()))


def _folder(model: PreTrainedModel) -> str | None:
    """The folder a model was loaded from, or None."""
    folder = getattr(model, "name_or_path", "") or ""
    return folder if folder and Path(folder).is_dir() else None


def _vocab(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None = None) -> dict[int, str] | None:
    """id -> token of ``tokenizer``, else of the tokenizer in the model's folder, else None."""
    if tokenizer is not None and hasattr(tokenizer, "get_vocab"):
        return {i: t for t, i in tokenizer.get_vocab().items()}
    folder = _folder(model)
    pairs = _folder_vocab(folder) if folder is not None else None
    return dict(pairs) if pairs is not None else None


def _difference(mine: dict[int, str] | None, theirs: dict[int, str] | None) -> tuple[int, str, str] | None:
    """The lowest id both vocabularies hold with different tokens: (id, mine, theirs); None if none (or unknown)."""
    if mine is None or theirs is None:
        return None
    return next(((i, mine[i], theirs[i]) for i in sorted(mine.keys() & theirs.keys()) if mine[i] != theirs[i]), None)


@lru_cache(maxsize=16)
def _folders_difference(target: str | None, drafter: str | None) -> tuple[int, str, str] | None:
    """``_difference`` of the tokenizers stored in two model folders (kept: a drafter is checked once per
    pair of folders, not at every call)."""
    pairs = [_folder_vocab(folder) if folder is not None else None for folder in (target, drafter)]
    return _difference(*(dict(p) if p is not None else None for p in pairs))


def _bos_id(model: PreTrainedModel) -> object:
    """The beginning-of-sequence id(s) a model's config declares, or None."""
    return getattr(model.config.get_text_config(), "bos_token_id", None)


def check_vocabularies(
    target: PreTrainedModel, drafter: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None = None, *,
    drafter_size: int | None = None, who: str = "drafter", fix: str = FIX,
) -> None:
    """Refuse a drafter whose vocabulary is not the target's (padding aside), with a clear ValueError.

    ``tokenizer`` (the target's, when the caller has it) must fit in both models' outputs. Sizes may
    differ by at most ``PADDING_FRACTION`` of the target's vocabulary; tokenizers known for both sides
    must map every shared id to the same token. A bos mismatch is a warning. ``drafter_size``: the
    drafter's vocabulary when its logits do not say it (a block drafter's head covers a subset);
    ``who`` names the drafter in the messages, ``fix`` says what to do.
    """
    v_target = logits_size(target)
    v_drafter = logits_size(drafter) if drafter_size is None else drafter_size
    if tokenizer is not None and hasattr(tokenizer, "__len__"):
        n = len(tokenizer)
        for name, v in (("target", v_target), (who, v_drafter)):
            if v < n:
                raise ValueError(f"the tokenizer has {n} tokens but the {name} emits only {v}: {FIX}")
    if abs(v_target - v_drafter) > v_target * PADDING_FRACTION:
        raise ValueError(
            f"{who} vocabulary ({v_drafter} tokens) differs from the target's ({v_target}) by more than "
            f"padding (at most {PADDING_FRACTION:.1%} of the target's): {fix}"
        )
    if tokenizer is not None and hasattr(tokenizer, "get_vocab"):
        difference = _difference(_vocab(target, tokenizer), _vocab(drafter))
    else:
        difference = _folders_difference(_folder(target), _folder(drafter))
    if difference is not None:
        i, mine, theirs = difference
        raise ValueError(f"the {who}'s tokenizer differs from the target's: id {i} is {theirs!r} for "
                         f"the {who} and {mine!r} for the target: {fix}")
    t_bos, d_bos = _bos_id(target), _bos_id(drafter)
    if t_bos is not None and d_bos is not None and t_bos != d_bos:
        warnings.warn(f"{who} and target declare different bos_token_id ({d_bos} vs {t_bos}); the prompt "
                      "decides what both see, so decoding stays exact", stacklevel=3)


QUANTISED_ENGINES = ("x86", "fbgemm", "onednn", "qnnpack")  # torch's CPU backends with int8 linear kernels
_FORMS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {form: its converted copy}


def _quantize_dynamic():
    """torch's dynamic quantisation (deprecated in torch.ao, still shipped), or None where it is gone."""
    quantization = getattr(getattr(torch, "ao", None), "quantization", None)
    return getattr(quantization, "quantize_dynamic", None)


def is_int8(model: torch.nn.Module) -> bool:
    """Whether ``model``'s linear layers are dynamically quantised already."""
    return any(type(m).__module__.startswith("torch.ao.nn.quantized.dynamic") for m in model.modules())


def int8_available() -> bool:
    """Whether this torch runs int8 dynamic quantisation on the CPU."""
    return _quantize_dynamic() is not None and torch.backends.quantized.engine in QUANTISED_ENGINES


def drafter_form(model: PreTrainedModel, dtype: str = "auto", lookup: bool = False) -> str:
    """The form ``dtype`` means for ``model``: auto resolved to int8 (a float32 model drafting every round,
    not behind prompt lookup (``lookup``) unless it reads the target's features, on a CPU with int8 kernels, not
    compiled) or the model's own form
    ("int8", "bf16", "float32", or its dtype's name). A model compiled by ``--compile on``
    (``specdec.compiled.prepare``) keeps its float32 form: an int8 copy cannot be compiled and runs eagerly,
    slower than the compiled step (docs/journal/drafter-form.md)."""
    if dtype != "auto":
        return dtype
    if is_int8(model):
        return "int8"
    # a drafter reading the target's features drafts in int8 behind prompt lookup too: its float32 layer and head
    # cost more of a round than a small draft model's (docs/journal/2026-12-07-code-feature-drafter.md)
    if ((not lookup or reads_features(model)) and input_device(model).type == "cpu" and model.dtype == torch.float32
            and int8_available() and registered_cache(model) is None and describe(model) is None):  # torchao's: kept
        return "int8"
    return _own_form(model)


def _own_form(model: PreTrainedModel) -> str:
    """The form ``model`` is in as loaded: "float32", "bf16", or its dtype's name."""
    return {torch.float32: "float32", torch.bfloat16: "bf16"}.get(model.dtype, str(model.dtype).removeprefix("torch."))


def _convert(model: PreTrainedModel, form: str) -> PreTrainedModel:
    """A copy of ``model`` in ``form`` (a form that needs no change returns ``model`` itself)."""
    if (name := describe(model)) is not None and form != _own_form(model):
        raise ValueError(f"the drafter is quantized already ({name}): it drafts as it was loaded; leave "
                         "--drafter-dtype at auto")
    if is_int8(model):
        if form == "int8":
            return model
        raise ValueError(f"the drafter is int8 (dynamically quantised) and cannot run in {form}: load it again "
                         f"and ask for --drafter-dtype {form}")
    if form in ("float32", "bf16"):
        wanted = torch.float32 if form == "float32" else torch.bfloat16
        return model if model.dtype == wanted else copy.deepcopy(model).to(wanted)
    if form != "int8":  # the model's own form, named by drafter_form for a dtype outside DRAFTER_DTYPES
        return model
    if input_device(model).type != "cpu":
        raise ValueError(f"int8 drafters run on the CPU only (dynamic quantisation) but this drafter is on "
                         f"{input_device(model)}: use --drafter-dtype bf16 there")
    quantize = _quantize_dynamic()
    if quantize is None or not int8_available():
        raise ValueError(f"this torch ({torch.__version__}, quantised engine {torch.backends.quantized.engine!r}) "
                         "has no int8 dynamic quantisation: use --drafter-dtype float32 or bf16")
    source = model if model.dtype == torch.float32 else copy.deepcopy(model).to(torch.float32)
    int8 = _int8_linears(source)
    # the float model is what the self-check of the cached path checks (specdec.selfcheck.checked_as)
    checked_for(int8, model)
    return int8


def _int8_linears(module: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``module`` with its linear layers dynamically quantized to int8 (torch's ``quantize_dynamic``)."""
    with warnings.catch_warnings():  # torch.ao.quantization's deprecation notices: the API is what this torch ships
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", UserWarning)
        return _quantize_dynamic()(module, {torch.nn.Linear}, dtype=torch.qint8, inplace=False).eval()


_INT8_HEADS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # target head -> (its weight's key, int8 copy)


def int8_head(head: torch.nn.Module) -> torch.nn.Module:
    """An int8 copy of a target's LM head for an int8 drafter that drafts through it (``ContextSlotsModel.bind``): a
    plain float32 ``nn.Linear`` quantized once per head and weight (such a drafter is bound again by every
    ``speculative_generate`` call); any other head is returned as it is. Drafts only: verification reads the
    target's own head, so the output stays exact."""
    if type(head) is not torch.nn.Linear or head.weight.dtype != torch.float32:
        return head
    key = (head.weight.data_ptr(), head.weight._version)
    made = _INT8_HEADS.get(head)
    if made is None or made[0] != key:
        plain = torch.nn.Linear(head.in_features, head.out_features, bias=head.bias is not None)
        with torch.no_grad():  # a plain Linear of the same weights: the target's may carry specdec's kernel forward
            plain.weight.copy_(head.weight)
            if head.bias is not None:
                plain.bias.copy_(head.bias)
        made = _INT8_HEADS[head] = (key, _int8_linears(torch.nn.Sequential(plain))[0])
    return made[1]


def reads_features(model: torch.nn.Module) -> bool:
    """Whether ``model`` drafts from the target's features (a feature or parallel drafter), not from a step of its
    own on its own tokens."""
    return getattr(getattr(model, "config", None), "model_type", "") in ("specdec-feature-drafter",
                                                                         "specdec-parallel-drafter")


def drafter_in(model: PreTrainedModel, dtype: str = "auto", lookup: bool = False) -> PreTrainedModel:
    """``model`` in the form ``dtype`` names (see ``DRAFTER_DTYPES``; ``lookup``: it drafts behind prompt
    lookup, where auto keeps it as loaded): itself when already in it, else a converted copy, the same
    copy each time while ``model`` lives. A clear ValueError for a form this machine cannot run (int8
    off the CPU or without quantised kernels, an int8 model back to floats)."""
    if dtype not in DRAFTER_DTYPES:
        raise ValueError(f"drafter dtype must be one of {', '.join(DRAFTER_DTYPES)}, got {dtype!r}")
    form = drafter_form(model, dtype, lookup)
    forms = _FORMS.setdefault(model, {})
    if form not in forms:
        converted = _convert(model, form)
        if converted is model:
            return model
        forms[form] = converted
    return forms[form]


def check_device(target_device: torch.device, drafter_device: torch.device) -> None:
    """Refuse a drafter on another device than the target's."""
    if drafter_device != target_device:
        raise ValueError(
            f"drafter is on {drafter_device} but the target is on {target_device}: "
            f"move it with drafter.to({str(target_device)!r})"
        )


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def in_target_vocabulary(logits: torch.Tensor, vocab_size: int | None) -> torch.Tensor:
    """Drafter logits [..., V_d] -> [..., V]: padding rows cut, or missing ids at -inf (None: as they are)."""
    if vocab_size is None or logits.shape[-1] == vocab_size:
        return logits
    if logits.shape[-1] > vocab_size:
        return logits[..., :vocab_size]
    pad = logits.new_full((*logits.shape[:-1], vocab_size - logits.shape[-1]), float("-inf"))
    return torch.cat([logits, pad], dim=-1)


def check_kind(target, drafter: PreTrainedModel) -> None:
    """Refuse a drafter model that does not read what the target reads: a decoder-only drafter for an
    encoder-decoder target or the reverse, or an encoder-decoder drafter with another decoder start token."""
    mine = is_encoder_decoder(drafter)
    if target.encoder_decoder != mine:
        kinds = {True: "an encoder-decoder", False: "a decoder-only"}
        raise ValueError(f"the drafter {type(drafter).__name__} is {kinds[mine]} model but the target is "
                         f"{kinds[target.encoder_decoder]} one: the drafter must read what the target reads (use a "
                         "drafter of the target's kind, or prompt lookup)")
    if mine and decoder_start_id(drafter) != target.decoder_start:
        raise ValueError(f"the drafter starts its decoder with token {decoder_start_id(drafter)} but the "
                         f"target with {target.decoder_start}: {FIX}")


class CachedDrafter(FollowingDrafter):
    """A drafter model's per-row state: ``cache`` (the rows' committed tokens, selectable by row),
    ``pending`` (committed tokens not yet in the cache), each row's length and the last proposal's drafts.

    A row's token at position p is fed only while p < ``context_limit`` (the drafter's positions): the round loop
    asks no drafts past it (``Decoder._budget``), and a row whose sequence has outgrown it is no longer followed
    (nothing pending, nothing fed: its cache is never read again). Draft steps and a block's mask positions that
    would pass it, for a row drafting less than the batch's longest, go in as dead tokens."""

    model: PreTrainedModel
    cache: Any  # a cache with select(rows [B'])
    pending: list[list[int]]  # per row: committed tokens not yet in the cache
    lengths: list[int]  # per row: its sequence's tokens so far (cached or pending), on the host
    context_limit: int | None  # the drafter's positions (None: no limit)
    _drafts: list[list[int]]  # per row: the last proposal's drafts
    device: torch.device

    def _ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids as the model takes them (by default: as they are)."""
        return ids

    def last_drafts(self) -> list[list[int]]:
        return self._drafts

    def prefill(self, prompts: PromptBatch) -> int:
        """Cache the new rows' prompts except their last tokens, which stay pending (an encoder-decoder
        drafter first encodes the rows' sources with its own encoder, once). A prompt longer than the drafter's
        context is not fed: its row is never drafted for."""
        rows = prompts.rows()
        reach = [self._within(len(row)) for row in rows]
        if not all(reach):
            sources = None if prompts.source is None else prompts.source_rows()
            prompts = PromptBatch.from_lists([row if ok else row[-1:] for row, ok in zip(rows, reach)],
                                             prompts.ids.device, sources)
        calls = prefill_into(self.cache, self.model, prompts, self.device, self._ids)
        self.pending += [[row[-1]] if ok else [] for row, ok in zip(rows, reach)]
        self.lengths += [len(row) for row in rows]
        self._drafts = self._drafts + [[] for _ in range(prompts.size)]  # a new list: the last one is a proposal's
        return calls

    def _within(self, length: int) -> bool:
        """Whether a sequence of ``length`` tokens fits the drafter's positions."""
        return self.context_limit is None or length <= self.context_limit

    def _grown(self, tokens: list[list[int]]) -> list[bool]:
        """Each row's length after it commits ``tokens[b]``; whether it still fits the drafter's positions."""
        self.lengths = [n + len(t) for n, t in zip(self.lengths, tokens)]
        return [self._within(n) for n in self.lengths]

    def _within_room(self, limit: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """``limit`` [B] cut to the drafts each row's sequence leaves room for in the drafter's positions (a drafter
        composed with prompt lookup is asked for rows the round loop does not cap at its context), and as a list."""
        limits = limit.tolist()
        if self.context_limit is None or max(self.lengths, default=0) < self.context_limit:
            return limit, limits
        room = [max(0, self.context_limit - n + 1) for n in self.lengths]
        if all(n <= r for n, r in zip(limits, room)):
            return limit, limits
        limits = [min(n, r) for n, r in zip(limits, room)]
        return torch.tensor(limits, dtype=limit.dtype, device=limit.device), limits

    def _fits(self, offset: int, width: int = 1) -> torch.Tensor | None:
        """[B, width] bool: which of the ``width`` tokens from ``offset`` past each row's sequence still have a
        position in the drafter's context; None when all of them have."""
        limit = self.context_limit
        if limit is None or max(self.lengths, default=0) + offset + width <= limit:
            return None
        return torch.tensor([[n + offset + j < limit for j in range(width)] for n in self.lengths], device=self.device)

    def rows_apart(self, prompts: PromptBatch) -> str | None:
        return rows_apart(self.model, prompts, self.device, self._ids)

    def select(self, rows: torch.Tensor) -> None:
        index = rows.tolist()
        self.cache.select(rows.to(self.device))
        self.pending = [self.pending[i] for i in index]
        self.lengths = [self.lengths[i] for i in index]
        self._drafts = [self._drafts[i] for i in index]


class ModelDrafter(CachedDrafter):
    """Drafts with a causal LM and its KV cache; q is the warped drafter distribution."""

    returns_hidden = True

    def __init__(self, model: PreTrainedModel, vocab_size: int | None = None, kernels: bool = True,
                 caches: CacheFactory | None = None) -> None:
        """``kernels``: install specdec's linear kernels on ``model`` (the caller's choice); ``caches``: the factory of
        its cache handles (``specdec.compiled.prepare``'s ``CompileChoice.caches``); None: the one registered for
        ``model``, else the eager cache (``seq2seq.decoding_cache``)."""
        self.model = model.eval()  # every module (a submodule left in training mode would decode wrong)
        if kernels:
            install(model)  # its linear layers' fast kernels, used while specdec decodes (specdec.kernels)
        self.caches = caches
        self.vocab_size = vocab_size  # the target's logits size; None = the drafter's own
        self.own_vocab_size = logits_size(model)  # rows of the drafter's own embedding
        self.context_limit = context_limit(model)
        self.hidden_size = model.config.get_text_config(decoder=True).hidden_size
        self.device = input_device(model)
        self.encoder_decoder = is_encoder_decoder(model)
        self.cache = decoding_cache(model, self.device, caches)
        self.pending: list[list[int]] = []  # per row: committed tokens not yet in the cache
        self.lengths: list[int] = []  # per row: its sequence's tokens so far
        self._drafts: list[list[int]] = []  # per row: the last proposal's drafts
        self._fed: list[list[int]] | None = None  # per row: drafts forwarded into the cache since the last commit
        self._mark: torch.Tensor | None = None  # [B] live tokens before those drafts

    def head_path(self) -> str | None:
        """``acceptance_head/`` in the drafter model's folder."""
        folder = getattr(self.model, "name_or_path", "") or ""
        return str(Path(folder) / "acceptance_head") if folder and Path(folder).is_dir() else None

    def align(self, target, tokenizer: PreTrainedTokenizerBase | None = None) -> ModelDrafter:
        """Check the drafter against the target (kind, vocabulary, device) and adopt its vocabulary size."""
        check_kind(target, self.model)
        check_vocabularies(target.model, self.model, tokenizer)
        check_device(target.device, self.device)
        self.vocab_size = target.vocab_size
        return self

    def _aligned(self, logits: torch.Tensor) -> torch.Tensor:
        """Drafter logits [B, V_d] -> [B, V] in the target's vocabulary."""
        return in_target_vocabulary(logits, self.vocab_size)

    def _ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids the drafter has rows for (a larger target's extra ids read as its last row)."""
        if self.vocab_size is not None and self.own_vocab_size < self.vocab_size:
            return ids.clamp(max=self.own_vocab_size - 1)
        return ids

    def _step(self, ids: torch.Tensor, valid: torch.Tensor | None,
              hidden: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Forward ``ids`` [B, n] -> (aligned logits of the last position [B, V], its hidden state [B, H] | None)."""
        out = self.cache.forward(self._ids(ids), valid, output_hidden_states=hidden)
        logits = out.logits[:, -1]  # [B, V_d]
        check_finite(logits, "drafter")
        if not hidden:
            return self._aligned(logits), None
        states = out.decoder_hidden_states if self.encoder_decoder else out.hidden_states
        return self._aligned(logits), states[-1][:, -1]

    def propose(self, limit: torch.Tensor, sampler: Sampler, stop: StopRule | None = None) -> Proposal:
        """Draft ``max(limit)`` positions for the batch: that many forwards, the first also catching up on
        the pending tokens; row b's proposal ends at ``limit[b]`` or where ``stop`` stops it."""
        rows = len(self.pending)
        limit, limits = self._within_room(limit)
        steps = max(max(limits, default=0), 0)
        if steps == 0:
            self._drafts = [[] for _ in range(rows)]
            return Proposal.empty(rows, self.device)
        hidden = stop is not None and stop.needs_hidden
        ids, counts = left_padded(self.pending, self.device)  # [B, P], [B]
        valid = None if len({len(p) for p in self.pending}) == 1 else left_mask(counts, ids.shape[1])  # [B, P]
        logits, state = self._step(ids, valid, hidden)
        self._mark, self.pending = self.cache.live.clone(), [[] for _ in range(rows)]
        tokens, probs, states, lengths, stopped = self._draft(logits, state, limits, limit, steps, sampler, stop,
                                                              hidden)
        if stop is None:
            counts, halted = [max(n, 0) for n in limits], [False] * rows
        else:
            counts, halted = torch.stack([lengths, stopped.long()]).tolist()
        drafted = torch.stack(tokens, dim=1)  # [B, k]
        lists = drafted.tolist()
        fed = len(tokens) - 1  # drafts forwarded, each row's within its context (``_fits``)
        self._fed = [row[: fed if self.context_limit is None else max(0, min(fed, self.context_limit - n))]
                     for row, n in zip(lists, self.lengths)]
        ended = tuple(ENDED_NONE if n == 0 else ENDED_THRESHOLD if s else ENDED_LIMIT for n, s in zip(counts, halted))
        proposal = Proposal(drafted, lengths, None if probs[0] is None else torch.stack(probs, dim=1),
                            torch.stack(states, dim=1) if hidden else None, calls=len(tokens), ended=ended)
        self._drafts = proposal.knowing([row[:n] for row, n in zip(lists, counts)]).drafts()
        return proposal

    def _draft(self, logits: torch.Tensor, state: torch.Tensor | None, limits: list[int], limit: torch.Tensor,
               steps: int, sampler: Sampler, stop: StopRule | None, hidden: bool) -> tuple[list, list, list,
                                                                                        torch.Tensor, torch.Tensor]:
        """Up to ``steps`` drafted positions, row b drafting at the first ``limits[b]`` of them, or until ``stop``
        (when given) stops it after a position: the tokens [B], probabilities [B, V] | None and hidden states
        [B, H] | None of each position, the drafts per row [B] and the rows the rule stopped [B] bool. Without a
        stop rule which rows draft where is known on the host: no host sync per position."""
        active = limit > 0  # [B] rows still drafting
        stopped = torch.zeros_like(active)  # [B] rows the stop rule stopped
        lengths = limit.clamp_min(0) if stop is None else torch.zeros_like(limit)
        tokens, probs, states = [], [], []
        for i in range(steps):
            if stop is None:
                active = None if min(limits) > i else limit > i  # [B] | None (every row)
            token, q = sampler.draft(logits, active)  # [B], [B, V] | None; only drafting rows draw
            tokens.append(token)
            probs.append(q)
            states.append(state)
            if stop is not None:
                lengths = lengths + active.long()
                halt = active & stop(DraftStep(i, token, logits, q, state, active))
                stopped, active = stopped | halt, active & ~halt & (limit > i + 1)
                if not bool(active.any()):
                    break
            if i == steps - 1:
                break
            logits, state = self._step(token[:, None], self._fits(i), hidden)
        return tokens, probs, states, lengths, stopped

    def follow(self, tokens: list[list[int]]) -> None:
        """Each row keeps the forwarded drafts that agree with its committed ``tokens``; the rest is pending."""
        reach = self._grown(tokens)  # a row past the drafter's context is no longer followed
        if self._fed is None:  # nothing forwarded since the last commit: all of it waits
            self.pending = [p + t if ok else [] for p, t, ok in zip(self.pending, tokens, reach)]
            return
        # the newest committed token stays pending even when it was forwarded (a row that drafted nothing
        # may have had exactly it forwarded): the next round's first forward starts from it
        keep = [min(common_prefix(fed, new), len(new) - 1) for fed, new in zip(self._fed, tokens)]
        assert self._mark is not None
        self.cache.keep(self._mark + torch.tensor(keep, dtype=torch.long, device=self.device))
        self.pending = [new[n:] if ok else [] for new, n, ok in zip(tokens, keep, reach)]
        self._fed, self._mark = None, None

    def reset(self) -> None:
        self.cache = decoding_cache(self.model, self.device, self.caches)
        self.pending, self.lengths, self._drafts, self._fed, self._mark = [], [], [], None, None
