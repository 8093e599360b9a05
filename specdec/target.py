"""The Target handle: the model whose output is reproduced, and its cache rule, for a batch of rows.

The round loop talks to the target only through this handle, so it never asks which kind of model
it has:

- ``prefill(prompts)`` adds rows (a ``PromptBatch``) after the current ones and caches each row's
  committed tokens but the newest, which is the next round's first input;
- ``verify(tokens [B, m], lengths [B])`` scores ``m`` tokens per row in one forward pass (row b's
  first ``lengths[b]`` are real: its newest committed token, then its drafts) and returns the
  logits of every position [B, m, V] (and the last hidden states [B, m, H] when asked);
- ``rollback(keep [B])`` keeps the first ``keep[b]`` of the tokens just verified in row b's cache;
- ``select(rows)`` keeps some rows (finished rows leave), ``reset()`` drops them all.

Invariant after every round, per row: cached tokens == committed tokens - 1.

``ModelTarget`` serves a transformers model with a language-model head through its cache handle: a
``RaggedCache`` for a decoder-only causal LM, a ``Seq2SeqCache`` for an encoder-decoder model (whose
rows' committed sequences start with the decoder's start token, their sources encoded once when
they join). ``make_target`` picks the implementation from a registry and refuses, before any
decoding, a model no implementation handles (a model without a language-model head), naming its class.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from specdec.batch import PromptBatch
from specdec.cache import CacheFactory
from specdec.kernels import install
from specdec.loading import context_limit, input_device, vocab_size
from specdec.sampling import check_finite
from specdec.seq2seq import (
    decoder_start_id,
    decoding_cache,
    is_encoder_decoder,
    prefill_into,
    prefilled_parts,
    rows_apart,
    source_limit,
)


@dataclass(frozen=True)
class Scores:
    """The target's verdict material for one round."""

    logits: torch.Tensor  # [B, m, V]
    hidden: torch.Tensor | None = None  # [B, m, H] last hidden states, when asked


class Target(ABC):
    """What the round loop needs from the target (see the module docstring)."""

    model: PreTrainedModel
    vocab_size: int  # size of the logits (output embedding rows, padding included)
    context_limit: int | None  # longest sequence the model accepts; None = unbounded
    device: torch.device
    encoder_decoder: bool = False  # True: each row has a source the encoder reads once, the prompt of its request
    decoder_start: int | None = None  # an encoder-decoder's decoder start token (its rows' first committed id)
    source_limit: int | None = None  # the longest source its encoder accepts; None = unbounded or decoder-only

    def stop_token_ids(self) -> list[int]:
        """The model's end-of-sequence id(s), from its generation config (else its config)."""
        config = getattr(self.model, "generation_config", None)
        eos = getattr(config, "eos_token_id", None)
        if eos is None:
            eos = getattr(self.model.config, "eos_token_id", None)
        if eos is None:
            return []
        return [eos] if isinstance(eos, int) else [int(t) for t in eos]

    @property
    @abstractmethod
    def rows(self) -> int:
        """Rows in the batch."""

    @abstractmethod
    def prefill(self, prompts: PromptBatch) -> int:
        """Add the rows of ``prompts``; return the forward passes spent."""

    def prefill_beside(self, prompts: PromptBatch) -> Callable[[], Callable[[], int]] | None:
        """``prefill`` in two parts, for a decoder that prefills joining rows while its batch decodes: a function that
        runs the model on the new rows alone (it touches no state of the running batch, so it may run on another
        thread meanwhile) and returns one that adds them to the batch (on the decoding thread, between rounds),
        returning the forward passes spent; or None where the target cannot split it (then ``prefill``)."""
        return None

    def rows_apart(self, prompts: PromptBatch) -> str | None:
        """Why rows of different lengths cannot share the target's forwards (then each decodes alone), or None;
        ``prompts`` (one row will do) serves the model's self-check. May raise what refuses even one row."""
        return None

    @abstractmethod
    def verify(self, tokens: torch.Tensor, lengths: torch.Tensor, hidden: bool = False) -> Scores:
        """Score ``tokens`` [B, m] (row b's first ``lengths[b]`` real) in one forward pass."""

    @abstractmethod
    def rollback(self, keep: torch.Tensor) -> None:
        """Keep the first ``keep[b]`` tokens of the last ``verify`` in row b's cache."""

    @abstractmethod
    def select(self, rows: torch.Tensor) -> None:
        """Keep only the rows ``rows`` [B'] (in that order)."""

    @abstractmethod
    def reset(self) -> None:
        """Drop every row."""

    @abstractmethod
    def cached(self) -> torch.Tensor:
        """[B] tokens in each row's cache (for tests of the invariant)."""


class ModelTarget(Target):
    """A transformers model with a language-model head behind its cache handle (decoder-only or
    encoder-decoder: the round loop does not ask which). ``kernels``: give the model's linear layers specdec's CPU
    kernels (``specdec.kernels.install``: may build them, probe their timings, keep the plan in ~/.cache and set the
    layers' forwards; the session or API call decides, ``kernels=`` "auto" or "off")."""

    def __init__(self, model: PreTrainedModel, kernels: bool = True, caches: CacheFactory | None = None) -> None:
        """``kernels``: install specdec's linear kernels on ``model`` (the caller's choice); ``caches``: the factory of
        its cache handles (``specdec.compiled.prepare``'s ``CompileChoice.caches``); None: the one registered for
        ``model``, else the eager cache (``seq2seq.decoding_cache``)."""
        self.model = model.eval()  # every module (a submodule left in training mode would decode wrong)
        if kernels:
            install(model)  # its linear layers' fast kernels, used while specdec decodes (specdec.kernels)
        self.caches = caches
        self.vocab_size = vocab_size(model)
        self.encoder_decoder = is_encoder_decoder(model)
        self.context_limit = context_limit(model)  # the decoder's positions
        self.decoder_start = decoder_start_id(model) if self.encoder_decoder else None
        self.source_limit = source_limit(model) if self.encoder_decoder else None
        self.device = input_device(model)
        self.cache = decoding_cache(model, self.device, caches)
        self._mark: torch.Tensor | None = None  # [B] live tokens before the last verify

    @property
    def rows(self) -> int:
        return self.cache.rows

    def prefill(self, prompts: PromptBatch) -> int:
        return prefill_into(self.cache, self.model, prompts, self.device)

    def prefill_beside(self, prompts: PromptBatch) -> Callable[[], Callable[[], int]] | None:
        if type(self).prefill is not ModelTarget.prefill:  # a subclass's own prefill: not split here
            return None
        cache = self.cache

        def run() -> Callable[[], int]:
            parts, calls = prefilled_parts(cache, self.model, prompts, self.device)

            def add() -> int:
                if self.cache is not cache:
                    raise RuntimeError("the target's cache was replaced while joining rows were prefilled beside it")
                for part in parts:
                    cache.merge(part)
                return calls
            return add
        return run

    def rows_apart(self, prompts: PromptBatch) -> str | None:
        return rows_apart(self.model, prompts, self.device)

    def verify(self, tokens: torch.Tensor, lengths: torch.Tensor, hidden: bool = False) -> Scores:
        width = tokens.shape[1]
        valid = None
        if width > 1 and any(n != width for n in lengths.tolist()):  # one token per row: every row is full
            valid = torch.arange(width, device=tokens.device)[None, :] < lengths[:, None]  # [B, m]
        self._mark = self.cache.live.clone()
        out = self.cache.forward(tokens, valid, logits_to_keep=width, output_hidden_states=hidden)
        check_finite(out.logits, "target", valid)
        states = (out.decoder_hidden_states if self.encoder_decoder else out.hidden_states) if hidden else None
        return Scores(out.logits, states[-1] if states is not None else None)

    def rollback(self, keep: torch.Tensor) -> None:
        assert self._mark is not None, "rollback() follows verify()"
        self.cache.keep(self._mark + keep)
        self._mark = None

    def select(self, rows: torch.Tensor) -> None:
        self.cache.select(rows.to(self.device))

    def reset(self) -> None:
        self.cache = decoding_cache(self.model, self.device, self.caches)

    def cached(self) -> torch.Tensor:
        return self.cache.live


# (accepts a model?, builds its Target) in the order tried; encoder-decoder targets register here too.
TARGETS: list[tuple[Callable[[PreTrainedModel], bool], Callable[[PreTrainedModel], Target]]] = []


def register_target(accepts: Callable[[PreTrainedModel], bool], build: Callable[..., Target]) -> None:
    """Let ``make_target`` build ``build(model)`` for models that ``accepts``; tried before earlier ones. A call that
    asks for no kernels builds ``build(model, kernels=False)``."""
    TARGETS.insert(0, (accepts, build))


def _language_model(model: PreTrainedModel) -> bool:
    return model.get_output_embeddings() is not None


register_target(_language_model, ModelTarget)


def make_target(model: object, kernels: bool = True) -> Target:
    """The ``Target`` handle of ``model`` (a transformers model with a language-model head, or a Target); ``kernels``:
    whether a handle made here gives the model specdec's linear kernels (``ModelTarget``)."""
    if isinstance(model, Target):
        return model
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"target must be a transformers causal LM, got {type(model).__name__}")
    if model.get_output_embeddings() is None:
        raise TypeError(f"target {type(model).__name__} has no language-model head: load it with "
                        "AutoModelForCausalLM (or specdec.load_model), not AutoModel")
    for accepts, build in TARGETS:
        if accepts(model):
            return build(model) if kernels else build(model, kernels=False)
    raise TypeError(f"target {type(model).__name__} is a model that no Target implementation handles")
