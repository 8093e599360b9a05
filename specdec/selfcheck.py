"""A self-check instead of a guess: does a model's cached path reproduce its own one-pass forward?

specdec scores drafts with cached multi-token forwards and decodes rows of a batch beside dead
slots, and assumes both equal what the model computes in one pass over the sequence alone. Most
families honour that; some do not (FSMT's cached decoder drops its causal mask; a decoder that
numbers positions its own way shifts them behind a batch's left padding). So, once per model
object, at its first prefill, on the first row's prompt (cycled to at least 9 tokens, at most 512;
an encoder-decoder's decoder reads its source tokens), the cache handle is run as decoding runs it
and compared with the model's one-pass forward (``use_cache=False``, positions as ``generate``
gives them); a recurrent model's with what its ``generate`` computes, a prefill then single cached
steps (``recurrent.cached_steps``: a chunked scan's one pass and its single steps may differ by more
than rounding, and specdec feeds such a model as ``generate`` does):

- alone: one pass over all but the last 7 tokens (the prefill), one 5-token forward (a verify at
  gamma 4), two single steps. A disagreement refuses the model, naming it and where it disagreed.
- batched: the same behind one dead slot (as a shorter row of a batch sits behind left padding) and
  with one after the prefill (as another row's kept draft beside this row's rejected one). A
  disagreement keeps the model's rows apart: the round loop decodes them one at a time, saying why.

"Disagrees": the log-probabilities differ by more than rounding, ``TOLERANCE`` of the dtype times the
largest logit. Families in ``architectures.KNOWN_GOOD`` (the shipped Llama and Marian among them)
skip the check: their start-up is unchanged. It costs about three forwards of the prompt, once.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from transformers import PreTrainedModel

from specdec.architectures import INSTEAD, KNOWN_GOOD
from specdec.batch import PromptBatch
from specdec.positions import takes_position_ids

if TYPE_CHECKING:
    from specdec.cache import RaggedCache

CHUNK = 5  # tokens of the checked multi-token forward (a verify at gamma 4)
STEPS = 2  # single steps checked after it
LONGEST = 512  # prompt tokens the check reads at most
# largest log-probability difference between a cached and a one-pass forward that is rounding, per dtype,
# relative to the largest logit (T5 at 40 tokens, logits up to 29: 1.5e-3 apart in float32)
TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-8, torch.float16: 2e-2, torch.bfloat16: 5e-2}


@dataclass(frozen=True)
class Verdict:
    """The self-check's findings for one model ("" where its cached path agrees)."""

    alone: str  # why a single row would not be decoded exactly
    batched: str  # why a row with dead slots (a batch's shorter or rejecting rows) would not be


_SOURCES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # a drafter's int8 form -> the model it was made from


def checked_for(model: PreTrainedModel, source: PreTrainedModel) -> None:
    """Have ``source``'s self-check stand for ``model``'s (``checked_as``): ``model`` is an int8 form made from it."""
    _SOURCES[model] = source


def checked_as(model: PreTrainedModel) -> PreTrainedModel:
    """The model whose cached path stands for ``model``'s: itself, or for a drafter's int8 form the float
    model it was made from (``drafters.model.drafter_in``): quantising each forward's activations as a
    whole moves its numbers with the tokens beside them, which only the drafts feel (the target verifies)."""
    return _SOURCES.get(model, model)


def verdict_of(model: PreTrainedModel) -> Verdict | None:
    """The model's verdict, None if it was not checked (a known-good family, or not prefilled yet)."""
    return getattr(checked_as(model), "_specdec_verdict", None)


def check_cached_path(model: PreTrainedModel, prompts: PromptBatch, device: torch.device | str,
                      make_cache: Callable, ids: Callable[[torch.Tensor], torch.Tensor] = lambda ids: ids) -> None:
    """Check ``model`` on ``prompts``' first row unless it is known good or checked already; raise the
    reason a single row would be wrong. ``make_cache(model, rows, device)`` builds its cache handle;
    ``ids`` maps token ids as the caller feeds them."""
    model = checked_as(model)
    if getattr(model.config, "model_type", "") in KNOWN_GOOD:
        return
    verdict = verdict_of(model)
    if verdict is None:
        alone, behind = make_cache(model, 1, device), make_cache(model, 1, device)  # refuse what no cache can serve
        behind.refuse_rows = False  # it finds out whether rows of a batch can be decoded
        try:
            with torch.no_grad():
                verdict = _check(model, prompts, device, alone, behind, ids)
        except Exception as error:  # the model's own cached path fails: say so, naming it
            reason = (f"{type(model).__name__}'s cached forward fails where specdec uses it (a prefill, then a "
                      f"{CHUNK}-token forward, then single steps, on a cache it rolls back): {type(error).__name__}: "
                      f"{str(error).removesuffix(INSTEAD).rstrip('. ')}. {INSTEAD}")  # the fix said once
            model._specdec_verdict = Verdict(reason, reason)
            raise ValueError(reason) from error
        model._specdec_verdict = verdict  # on the model: a deep copy (a drafter twin) carries it
    if verdict.alone:
        raise ValueError(verdict.alone)


def _check(model: PreTrainedModel, prompts: PromptBatch, device: torch.device | str, alone: RaggedCache,
           behind: RaggedCache, ids: Callable[[torch.Tensor], torch.Tensor]) -> Verdict:
    encoder_decoder = bool(getattr(model.config, "is_encoder_decoder", False))
    row, source, valid = prompts.rows()[0], None, None
    if encoder_decoder:
        width = int(prompts.source_lengths[0])
        source, valid = prompts.source[:1, :width], prompts.source_valid()[:1, :width]  # [1, S]
        row = row + source[0].tolist()  # decoder tokens to check: any will do
        alone.encode(source, valid)
        behind.encode(source, valid)
    length = min(max(len(row), CHUNK + STEPS + 2), LONGEST)
    seq = ids(torch.tensor([(row * length)[:length]], device=device))  # [1, L]
    first = length - CHUNK - STEPS
    if encoder_decoder:
        reference = model(input_ids=source, attention_mask=valid.long(), decoder_input_ids=seq, use_cache=False).logits
    elif alone.recurrent:  # generate's own path: the prefill, then single cached steps (RecurrentCache's)
        reference = alone.generate_logits(seq, first)  # [1, L, V]
    else:  # positions as generate gives them
        positions = {"position_ids": torch.arange(length, device=seq.device)[None]} if takes_position_ids(model) else {}
        reference = model(input_ids=seq, use_cache=False, **positions).logits  # [1, L, V]
    scale = max(1.0, float(reference.float().abs().max()))  # rounding grows with the logits' size
    tolerance = TOLERANCE.get(reference.dtype, TOLERANCE[torch.bfloat16]) * scale
    reference = reference.float().log_softmax(-1)  # [1, L, V]
    pieces = [(first, first + CHUNK)] + [(t, t + 1) for t in range(first + CHUNK, length)]
    name = type(model).__name__

    def gap(cache, prefill: torch.Tensor) -> torch.Tensor:
        logits = [prefill[:, -first:]]  # (some models return every position's logits whatever logits_to_keep says)
        logits += [cache.forward(seq[:, a:b], logits_to_keep=b - a).logits[:, a - b:] for a, b in pieces]
        return (torch.cat(logits, dim=1).float().log_softmax(-1) - reference).abs().amax(-1)[0]  # [L]

    found = gap(alone, alone.forward(seq[:, :first], logits_to_keep=first).logits)
    if float(found.max()) > tolerance:
        where = int(found.argmax())
        step = ("the one-pass prefill" if where < first else f"a {CHUNK}-token cached forward (a verify at gamma "
                f"{CHUNK - 1})" if where < first + CHUNK else "a single cached step")
        reason = (f"{name}'s cached forward disagrees with its own one-pass forward (log-probabilities differ by "
                  f"{float(found.max()):.2g} at position {where} of {length}, in {step}): specdec verifies drafts "
                  f"with cached multi-token forwards, so it would not reproduce this model's output. {INSTEAD}")
        return Verdict(reason, reason)
    padded = torch.cat([torch.zeros_like(seq[:, :1]), seq[:, :first]], dim=1)  # [1, 1 + first]: a dead slot first
    real = torch.ones_like(padded, dtype=torch.bool)
    real[:, 0] = False
    prefill = behind.forward(padded, real, logits_to_keep=first).logits
    # a dead slot inside the row (a recurrent state would run over it: only keep() mends it; sparse attention's
    # rows never share a forward, and compaction would not move its indexer's keys)
    if not behind.recurrent and not behind.one_at_a_time:
        behind.forward(seq[:, :1], torch.zeros_like(seq[:, :1], dtype=torch.bool))
    found = gap(behind, prefill)
    if float(found.max()) > tolerance:
        return Verdict("", "a row behind a dead slot and with one inside it (a shorter row's left padding, a draft "
                           "another row kept and it rejected) decodes differently from the row alone in specdec's "
                           f"self-check (log-probabilities differ by {float(found.max()):.2g})")
    return Verdict("", "")
