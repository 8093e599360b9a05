"""The Target handle: the model whose output is reproduced, and its cache rule, for a batch of rows.

The round loop talks to the target only through this handle, so it never asks which kind of model
it has:

- ``prefill(prompts)`` adds rows (a ``PromptBatch``) after the current ones and caches each row's
  committed tokens but the newest, which is the next round's first input;
- ``verify(tokens [B, m], lengths [B])`` scores ``m`` tokens per row in one forward pass (row b's
  first ``lengths[b]`` are real: its newest committed token, then its drafts) and returns the
  logits of every position [B, m, V] (and the last hidden states [B, m, H] when asked);
- ``rollback(keep [B])`` keeps the first ``keep[b]`` of the tokens just verified in row b's cache;
- ``select(rows)`` keeps some rows (finished rows leave), ``reset()`` drops them all;
- ``want_features(layers)`` / ``take_features()``: the hidden states of chosen layers at every position the target
  keeps in its cache, captured on the same forwards, for a feature drafter (``ModelTarget.take_features``).

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
from specdec.features import Capture, FeatureLog, decoder_layers, features_of, resolve_layers, selection
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

    def want_features(self, layers: tuple[int, ...] | str | None) -> tuple[int, ...] | None:
        """Capture the hidden states of ``layers`` from now on (``ModelTarget.want_features``); a target that
        cannot refuses by name."""
        raise TypeError(f"{type(self).__name__} does not capture the target's features: a feature drafter needs "
                        "a ModelTarget")

    def take_features(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The features kept since they were last taken (``ModelTarget.take_features``)."""
        raise TypeError(f"{type(self).__name__} does not capture the target's features")


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
        self.feature_layers: tuple[int, ...] | None = None  # the layers captured (``want_features``); None: none
        self.features: FeatureLog | None = None  # per row, the features kept and not yet taken
        self._verified: torch.Tensor | None = None  # [B, m, F] the last verify's features, until its rollback

    @property
    def rows(self) -> int:
        return self.cache.rows

    def prefill(self, prompts: PromptBatch) -> int:
        capture = self._capture()
        calls = prefill_into(self.cache, self.model, prompts, self.device, capture=capture)
        self._log_rows(capture)
        return calls

    def prefill_beside(self, prompts: PromptBatch) -> Callable[[], Callable[[], int]] | None:
        if type(self).prefill is not ModelTarget.prefill:  # a subclass's own prefill: not split here
            return None
        cache, capture = self.cache, self._capture()

        def run() -> Callable[[], int]:
            parts, calls = prefilled_parts(cache, self.model, prompts, self.device, capture=capture)

            def add() -> int:
                if self.cache is not cache:
                    raise RuntimeError("the target's cache was replaced while joining rows were prefilled beside it")
                for part in parts:
                    cache.merge(part)
                self._log_rows(capture)
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
        layers = self.feature_layers
        asked = hidden if layers is None else selection(layers, decoder_layers(self.model) if hidden else None)
        out = self.cache.forward(tokens, valid, logits_to_keep=width, output_hidden_states=asked)
        check_finite(out.logits, "target", valid)
        states = (out.decoder_hidden_states if self.encoder_decoder else out.hidden_states) if asked else None
        if layers is not None:
            self._verified = features_of(states, layers, type(self.model).__name__)
        return Scores(out.logits, states[-1] if hidden else None)

    def rollback(self, keep: torch.Tensor) -> None:
        assert self._mark is not None, "rollback() follows verify()"
        self.cache.keep(self._mark + keep)
        self._mark = None
        if self._verified is not None:  # the kept positions' features, as their cache entries
            self.features.extend(self._verified, keep)
            self._verified = None

    def select(self, rows: torch.Tensor) -> None:
        self.cache.select(rows.to(self.device))
        if self.features is not None:
            self.features.select(rows)

    def reset(self) -> None:
        self.cache = decoding_cache(self.model, self.device, self.caches)
        if self.features is not None:
            self.features = self._new_log()

    # ------------------------------------------------------------------------------------ features

    def want_features(self, layers: tuple[int, ...] | str | None = "eagle3") -> tuple[int, ...] | None:
        """Capture, from now on, the hidden states of decoder ``layers`` on the prefill and every verify forward
        (the same forwards, no second pass): ``"eagle3"`` (``features.eagle3_layers``: L = 32 layers give
        (2, 16, 29)) or indices of transformers' ``hidden_states`` (0: the embeddings' output, i: decoder layer
        i - 1's output, i.e. layer i's input; L: the last layer's output after the final norm), kept in layer order
        (sorted, repeats kept); None: capture nothing again. Returns the layers. Asked again with other layers while
        rows are held: a ValueError (their features would mix). Rows held before the call have no features for the
        positions cached before it. A target nobody asked passes its model nothing more (no ``output_hidden_states``,
        no hook). Encoder-decoder targets are refused (a TypeError naming the model)."""
        if layers is None:
            self.feature_layers, self.features, self._verified = None, None, None
            return None
        if self.encoder_decoder:
            raise TypeError(f"{type(self.model).__name__} is an encoder-decoder model: specdec captures the features "
                            "of decoder-only targets")
        chosen = resolve_layers(self.model, layers)
        if chosen == self.feature_layers:
            return chosen
        if self.feature_layers is not None and self.rows:
            raise ValueError(f"the target captures layers {self.feature_layers} for its {self.rows} rows; asking for "
                             f"{chosen} would mix them: reset() first")
        self.feature_layers = chosen
        self.features = self._new_log()
        return chosen

    @property
    def feature_size(self) -> int | None:
        """F, the size of a position's features: len(layers) x the hidden size (None: no features asked)."""
        if self.feature_layers is None:
            return None
        return len(self.feature_layers) * int(self.model.config.get_text_config().hidden_size)

    def take_features(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The features of the positions each row's cache kept since they were last taken, and the log emptied:
        ``(features [B, n, F] right-padded with zeros, lengths [B])``, rows in the batch's (cache-row) order, F =
        ``feature_size``, the chosen layers concatenated in layer order.

        Alignment: row b's committed sequence is x_0 .. x_{N-1}; the target caches x_0 .. x_{N-2} (its
        invariant) and has computed, for each of them, f_p = the chosen layers' hidden states at position p
        (causal: over x_0 .. x_p), from the forward that cached it. ``features[b, :lengths[b]]`` is f_t .. f_{N-2},
        t being the positions taken before (0 for a row that joined since). So after a prefill of prompt
        x_0 .. x_{T-1}, the row holds f_0 .. f_{T-2}; after a round that kept a accepted drafts (committing a + 1
        tokens: the drafts, then the recovered or bonus token), it holds the newest committed token's before the
        round and the a accepted drafts' (a + 1 positions; the rejected drafts' are dropped with their cache
        entries). Its newest committed token x_{N-1} has no features yet: it is the next verify's first input.
        An EAGLE-style drafter pairs f_p with the token x_{p+1} to draft x_{p+2}: after taking, f_{N-2} with
        x_{N-1} drafts x_N, the first token of the next round.

        When: the target logs features in ``prefill`` (and, beside the batch, when the joining rows are added) and
        ``rollback``; the round loop calls those before the drafter's ``prefill`` and ``commit``, so a drafter
        that takes them there gets its rows' new positions. Rows leaving (``select``) and ``reset`` drop theirs.
        Features not taken accumulate (a drafter sitting out a plain stretch takes them all when it drafts
        again)."""
        if self.features is None:
            raise ValueError("the target captures no features: call want_features(layers) first")
        return self.features.take()

    def _new_log(self) -> FeatureLog:
        """An empty log for the rows held (none of their positions so far has features)."""
        dtype = self.model.dtype if self.model.dtype.is_floating_point else torch.float32
        log = FeatureLog(self.feature_size, dtype, self.device)
        log.add_rows(torch.zeros(self.rows, 0, log.size, dtype=dtype, device=self.device),
                     torch.zeros(self.rows, dtype=torch.long, device=self.device))
        return log

    def _capture(self) -> Capture | None:
        """What a prefill captures (``features.Capture``), or None: no features asked."""
        if self.feature_layers is None:
            return None
        return Capture(self.feature_layers, decoder_layers(self.model), type(self.model).__name__)

    def _log_rows(self, capture: Capture | None) -> None:
        """The prefilled rows' features join the log (after the rows held), as their cache rows joined."""
        if capture is not None and self.features is not None:
            self.features.add_rows(*capture.rows(self.feature_size, self.features.dtype, self.device))

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
