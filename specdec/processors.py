"""The target's generation config: its sampling defaults and logits processors, applied as ``generate`` does.

A model's ``generation_config`` is part of what "the model's own output" means: ``generate`` (and vLLM)
take its ``do_sample`` / temperature / top-k / top-p as defaults and build logits processors from its
other settings (``repetition_penalty``, ``no_repeat_ngram_size``, ``min_new_tokens``, ``suppress_tokens``,
``begin_suppress_tokens``, ``bad_words_ids``, ``sequence_bias``, ``forced_bos/eos_token_id``, ...).
``resolve`` reads them once per call, with transformers' own machinery (``_prepare_generation_config``,
``_prepare_special_tokens``, ``_prepare_generated_length``, ``_get_logits_processor``), so the processors
are the very ``LogitsProcessor`` objects ``generate`` would build, in its order, the caller's
``logits_processor`` list merged in as ``generate`` merges it.

- Sampling defaults: a setting the caller leaves unset (None) comes from the generation config when it
  asks to sample (``do_sample``; transformers' global defaults fill what it leaves unset, e.g. top-k 50,
  exactly as in ``generate``), else from ``SamplingConfig``. ``GenerationSettings`` says which
  settings were in force and where each came from.
- Processors: built per row (``Processing.for_row``), since some depend on the row's prompt length
  (``min_new_tokens``, ``begin_suppress_tokens``), its ``max_length`` (``forced_eos_token_id``: prompt +
  ``max_new_tokens``) or its source (``encoder_repetition_penalty``). ``apply`` runs a row's list at every
  verified position with that position's own prefix (committed tokens + the drafts before it), on
  float32 logits as ``generate`` does, so greedy verification takes the argmax of the processed scores
  and speculative sampling's p is the processed distribution. The drafter's logits get the same
  processors (``DraftSampler``: its q is what it draws from, so every rule stays exact; a drafter that
  drafts what the processed target would keep is accepted more often).
- Temperature, top-k and top-p stay with the ``Sampler`` (applied last, to p and q alike, as
  ``generate`` applies its warpers after the processors). A processor that cannot be applied that way,
  per position from its prefix alone, is refused by name before decoding (``REFUSED``): guidance (it
  runs the model a second time with its own cache), watermarking (applied after the warpers), and the
  sampling warpers ``generate`` applies after top-p (min-p, typical-p, epsilon, eta, top-h) when they
  come from the generation config. A processor the caller writes is called the same way: it must be a
  function of (prefix, scores), one row at a time.
- ``ignore_generation_config`` decodes raw: no processors, sampling from the caller and ``SamplingConfig``.
- No processor in force (the shipped models): ``for_row`` returns None and the round loop does no
  extra work at all.
"""

from __future__ import annotations

import copy
import inspect
import warnings
from dataclasses import dataclass, field

import torch
from transformers import GenerationConfig, PreTrainedModel
from transformers.generation import logits_process as lp
from transformers.generation.logits_process import LogitsProcessor, LogitsProcessorList

from specdec.config import SamplingConfig
from specdec.sampling import Sampler

USER, GENERATION_CONFIG, TRANSFORMERS_DEFAULT, SPECDEC_DEFAULT = (
    "user", "generation_config", "transformers default", "specdec default")  # where a setting came from

# Processors that are functions of (prefix, scores) row by row: applied at every verified position.
PER_POSITION: tuple[type, ...] = (
    lp.SequenceBiasLogitsProcessor, lp.NoBadWordsLogitsProcessor, lp.RepetitionPenaltyLogitsProcessor,
    lp.EncoderRepetitionPenaltyLogitsProcessor, lp.NoRepeatNGramLogitsProcessor,
    lp.EncoderNoRepeatNGramLogitsProcessor, lp.MinLengthLogitsProcessor, lp.MinNewTokensLengthLogitsProcessor,
    lp.PrefixConstrainedLogitsProcessor, lp.ForcedBOSTokenLogitsProcessor, lp.ForcedEOSTokenLogitsProcessor,
    lp.InfNanRemoveLogitsProcessor, lp.ExponentialDecayLengthPenalty, lp.SuppressTokensLogitsProcessor,
    lp.SuppressTokensAtBeginLogitsProcessor, lp.LogitNormalization,
)
# The warpers the Sampler applies itself (to p and q), from the resolved SamplingConfig.
SAMPLER_WARPERS: tuple[type, ...] = (lp.TemperatureLogitsWarper, lp.TopKLogitsWarper, lp.TopPLogitsWarper)
# Warpers that are per-position functions, accepted in a caller's list (applied before the Sampler's own),
# but refused from a generation config, where generate applies them after temperature, top-k and top-p.
LATE_WARPERS: tuple[type, ...] = (lp.MinPLogitsWarper, lp.TypicalLogitsWarper, lp.EpsilonLogitsWarper,
                                  lp.EtaLogitsWarper, lp.TopHLogitsWarper)
# Why a transformers processor cannot be applied per verified position (class name -> reason).
REFUSED: dict[str, str] = {
    "UnbatchedClassifierFreeGuidanceLogitsProcessor": "classifier-free guidance runs the model again on its own "
    "cache, one token at a time (guidance_scale)",
    "ClassifierFreeGuidanceLogitsProcessor": "classifier-free guidance needs a doubled batch of conditional and "
    "unconditional rows",
    "WatermarkLogitsProcessor": "generate applies watermarking after temperature, top-k and top-p, which specdec's "
    "sampler applies last (watermarking_config)",
    "SynthIDTextWatermarkLogitsProcessor": "SynthID watermarking keeps state across steps (watermarking_config)",
    "WhisperTimeStampLogitsProcessor": "it keeps state across steps",
    "WhisperNoSpeechDetection": "it keeps state across steps and runs the model itself",
    "BarkEosPrioritizerLogitsProcessor": "it is made for Bark's codebook generation",
    "AlternatingCodebooksLogitsProcessor": "it is made for Bark's codebook generation",
}
# Generation-config fields of each processor, to name the setting in errors and summaries.
FIELDS: dict[str, str] = {
    "SequenceBiasLogitsProcessor": "sequence_bias", "NoBadWordsLogitsProcessor": "bad_words_ids",
    "RepetitionPenaltyLogitsProcessor": "repetition_penalty",
    "EncoderRepetitionPenaltyLogitsProcessor": "encoder_repetition_penalty",
    "NoRepeatNGramLogitsProcessor": "no_repeat_ngram_size",
    "EncoderNoRepeatNGramLogitsProcessor": "encoder_no_repeat_ngram_size", "MinLengthLogitsProcessor": "min_length",
    "MinNewTokensLengthLogitsProcessor": "min_new_tokens", "ForcedBOSTokenLogitsProcessor": "forced_bos_token_id",
    "ForcedEOSTokenLogitsProcessor": "forced_eos_token_id", "InfNanRemoveLogitsProcessor": "remove_invalid_values",
    "ExponentialDecayLengthPenalty": "exponential_decay_length_penalty",
    "SuppressTokensLogitsProcessor": "suppress_tokens", "SuppressTokensAtBeginLogitsProcessor": "begin_suppress_tokens",
    "LogitNormalization": "renormalize_logits", "UnbatchedClassifierFreeGuidanceLogitsProcessor": "guidance_scale",
    "WatermarkLogitsProcessor": "watermarking_config", "SynthIDTextWatermarkLogitsProcessor": "watermarking_config",
    "MinPLogitsWarper": "min_p", "TypicalLogitsWarper": "typical_p", "EpsilonLogitsWarper": "epsilon_cutoff",
    "EtaLogitsWarper": "eta_cutoff", "TopHLogitsWarper": "top_h",
}
SAMPLING_FIELDS = ("temperature", "top_k", "top_p")
# Processors that read no more than the set of prefix tokens, and drop ids >= V: a row's positions are
# processed in one call, each prefix right-padded with V (see ``apply``).
SET_ONLY: tuple[type, ...] = (lp.RepetitionPenaltyLogitsProcessor, lp.SuppressTokensLogitsProcessor,
                              lp.InfNanRemoveLogitsProcessor, lp.LogitNormalization)


@dataclass(frozen=True)
class GenerationSettings:
    """What decided a call's tokens besides the logits, and where each setting came from."""

    sampling: SamplingConfig  # the sampling in force (temperature 0 = greedy)
    sources: dict[str, str]  # temperature / top_k / top_p / do_sample -> user,
                             # generation_config, transformers default, specdec default
    processors: tuple[str, ...] = ()  # "ClassName (field)" of each processor applied per position, in order
    generation_config: bool = True  # False: ignore_generation_config (decoded raw)

    def to_dict(self) -> dict:
        """The settings as JSON-ready values (for ``--json`` and the summary)."""
        return {"temperature": self.sampling.temperature, "top_k": self.sampling.top_k, "top_p": self.sampling.top_p,
                "sources": dict(self.sources), "processors": list(self.processors),
                "generation_config": "ignored" if not self.generation_config else "applied"}

    def line(self) -> str:
        """One line for the printed summary: each setting, with its source unless specdec's default."""
        s, sources = self.sampling, self.sources

        def tag(name: str) -> str:
            source = sources.get(name, SPECDEC_DEFAULT)
            return "" if source == SPECDEC_DEFAULT else f" ({source})"

        parts = ["greedy" + tag("temperature") if s.greedy else
                 f"temperature {s.temperature:g}{tag('temperature')}, top-k {s.top_k}{tag('top_k')}, "
                 f"top-p {s.top_p:g}{tag('top_p')}"]
        if not self.generation_config:
            parts.append("generation config ignored")
        if self.processors:
            parts.append("processors: " + ", ".join(self.processors))
        return "; ".join(parts)


@dataclass
class Processing:
    """A call's resolved settings and the recipe of each row's logits processors."""

    settings: GenerationSettings
    model: PreTrainedModel | None = None  # None: no processor in force
    config: GenerationConfig | None = None  # prepared (special tokens as tensors, do_sample off: no warpers)
    user: LogitsProcessorList = field(default_factory=LogitsProcessorList)

    def for_row(self, ids: list[int], max_new_tokens: int, source: list[int] | None = None,
                device: torch.device | str = "cpu") -> RowProcessors | None:
        """The processors of a row whose committed sequence starts with ``ids`` (the prompt; an
        encoder-decoder's decoder start) and whose encoder reads ``source``; None when none is in force."""
        if self.model is None:
            return None
        return RowProcessors(_build(self.model, self.config, len(ids), max_new_tokens,
                                    source if source is not None else ids, self.user, device))


def _build(model: PreTrainedModel, config: GenerationConfig, length: int, max_new_tokens: int,
           encoder_ids: list[int], user: LogitsProcessorList, device: torch.device | str) -> LogitsProcessorList:
    """``generate``'s processors for one row: ``length`` decoder input tokens, ``max_new_tokens`` to come."""
    config = copy.copy(config)
    config.max_new_tokens = max_new_tokens
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = model._prepare_generated_length(config, has_default_max_length=True, has_default_min_length=True,
                                                 model_input_name="input_ids", input_ids_length=length,
                                                 inputs_tensor=None)
        return model._get_logits_processor(config, input_ids_seq_length=length,
                                           encoder_input_ids=torch.tensor([encoder_ids], device=device),
                                           logits_processor=user, device=device, model_kwargs={})


def _label(processor: LogitsProcessor) -> str:
    name = type(processor).__name__
    return f"{name} ({FIELDS[name]})" if name in FIELDS else name


def _refuse(processor: LogitsProcessor, whose: str) -> None:
    """Raise for a processor that cannot be applied per verified position (see REFUSED)."""
    name = type(processor).__name__
    is_transformers = type(processor).__module__.startswith("transformers.")
    if isinstance(processor, PER_POSITION + SAMPLER_WARPERS) or (whose == "logits_processor" and (
            isinstance(processor, LATE_WARPERS) or not is_transformers)):
        return
    if isinstance(processor, LATE_WARPERS):
        reason = "generate applies it after temperature, top-k and top-p, which specdec's sampler applies last"
    else:
        reason = REFUSED.get(name, "specdec does not know it to be a function of each position's prefix alone")
    setting = f"sets {FIELDS[name]} ({name})" if name in FIELDS else f"holds {name}"
    fix = ("pass ignore_generation_config=True (--ignore-generation-config) to decode without the generation "
           "config, or unset it" if whose == "generation_config" else "leave it out of logits_processor")
    raise ValueError(f"the target's {whose} {setting}, which speculative decoding cannot apply at each verified "
                     f"position: {reason}; {fix}")


def _sampling(model: PreTrainedModel, prepared: GenerationConfig | None, given: dict[str, object],
              seed: int | None, ignore: bool) -> tuple[SamplingConfig, dict[str, str]]:
    """The sampling in force: the caller's values, else the generation config's when it samples
    (``do_sample``), else SamplingConfig's. Returns it with each setting's source."""
    own = getattr(model, "generation_config", None)
    samples = prepared is not None and bool(prepared.do_sample) and given["temperature"] != 0
    values: dict[str, object] = {}
    sources: dict[str, str] = {}
    for name in SAMPLING_FIELDS:
        if given[name] is not None:
            values[name], sources[name] = given[name], USER
        elif samples:
            value = getattr(prepared, name)
            values[name] = {"temperature": 1.0, "top_k": 0, "top_p": 1.0}[name] if value is None else value
            explicit = own is not None and getattr(own, name, None) is not None
            sources[name] = GENERATION_CONFIG if explicit else TRANSFORMERS_DEFAULT
        else:
            values[name], sources[name] = getattr(SamplingConfig, name), SPECDEC_DEFAULT
    sources["do_sample"] = (USER if given["temperature"] is not None
                            else GENERATION_CONFIG if samples else SPECDEC_DEFAULT)
    return SamplingConfig(**values, seed=seed, ignore_generation_config=ignore), sources


def resolve(model: PreTrainedModel, *, temperature: float | None = None, top_k: int | None = None,
            top_p: float | None = None, seed: int | None = None, logits_processor: LogitsProcessorList | None = None,
            ignore_generation_config: bool = False, device: torch.device | str = "cpu") -> Processing:
    """The sampling and processors of a call to ``model`` (see the module docstring); refuses, by name, a
    processor that cannot be applied at each verified position."""
    given = {"temperature": temperature, "top_k": top_k, "top_p": top_p}
    user = LogitsProcessorList(logits_processor or [])
    if logits_processor is not None and not all(isinstance(p, LogitsProcessor) or callable(p) for p in user):
        raise TypeError("logits_processor must be a LogitsProcessorList of LogitsProcessor objects")
    for processor in user:
        _refuse(processor, "logits_processor")
    prepared = None
    if not ignore_generation_config and getattr(model, "generation_config", None) is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                prepared, _ = model._prepare_generation_config(None)
            except ValueError as err:  # generate refuses it too (generation settings in model.config)
                raise ValueError(f"the target's generation settings cannot be read: {err} (or pass "
                                 "ignore_generation_config=True, --ignore-generation-config, to decode raw)") from err
            model._prepare_special_tokens(prepared, None, device=device)
    sampling, sources = _sampling(model, prepared, given, seed, ignore_generation_config)
    if prepared is None:
        if not user:
            return Processing(GenerationSettings(sampling, sources, (), not ignore_generation_config))
        prepared = GenerationConfig()
        model._prepare_special_tokens(prepared, None, device=device)
    # Inspect what generate would build; rows are built without its warpers, since the Sampler applies
    # temperature, top-k and top-p (to p and q) from the resolved SamplingConfig.
    prepared = copy.copy(prepared)
    if prepared.do_sample and not sampling.greedy:
        for processor in _build(model, prepared, 1, 1, [0], LogitsProcessorList(), device):
            if not isinstance(processor, SAMPLER_WARPERS):
                _refuse(processor, "generation_config")
    prepared.do_sample = False
    built = _build(model, prepared, 1, 1, [0], user, device)
    for processor in built:
        if not any(processor is mine for mine in user):
            _refuse(processor, "generation_config")
    settings = GenerationSettings(sampling, sources, tuple(_label(p) for p in built), not ignore_generation_config)
    if not built:
        return Processing(settings)
    return Processing(settings, model, prepared, user)


class RowProcessors(LogitsProcessorList):
    """One row's processors, called in order exactly as ``LogitsProcessorList`` calls them with no extra
    arguments, less its ``inspect.signature`` of every processor at every call (it cost more than a
    repetition penalty itself): checked once here, where a processor whose ``__call__`` needs more than
    (input_ids, scores) is refused, as the list would refuse it at its first call."""

    def __init__(self, processors: LogitsProcessorList) -> None:
        super().__init__(processors)
        for processor in self:
            parameters = list(inspect.signature(processor.__call__).parameters)
            if len(parameters) > 2:
                raise ValueError(f"logits processor {type(processor).__name__} needs {parameters[2:]} besides "
                                 "(input_ids, scores), which speculative decoding cannot pass at each verified "
                                 "position: leave it out")
        # every processor reads only the set of prefix tokens and ignores ids >= V (see SET_ONLY)
        self.set_only = all(type(p) in SET_ONLY and getattr(p, "prompt_ignore_length", None) is None for p in self)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        for processor in self:
            scores = processor(input_ids, scores)
        return scores


Rows = list[tuple[torch.Tensor | None, RowProcessors | None]]  # per row: (committed tokens [C],
                                                               # processors) or (None, None)


def round_rows(rows: list[tuple[list[int], LogitsProcessorList | None]], device: torch.device | str) -> Rows:
    """A round's rows for ``apply`` and ``DraftSampler``: each row with processors gets its committed tokens
    as a tensor [C], built once and shared by the drafter's positions and the verification (a list not
    made by ``Processing.for_row`` is wrapped in ``RowProcessors``)."""
    return [(torch.tensor(ids, dtype=torch.long, device=device),
             p if isinstance(p, RowProcessors) else RowProcessors(p)) if p else (None, None) for ids, p in rows]


def apply(logits: torch.Tensor, tokens: torch.Tensor, lengths: torch.Tensor, rows: Rows) -> torch.Tensor:
    """Processed float32 scores of a verify: ``logits`` [B, m, V] of ``tokens`` [B, m] (row b's first
    ``lengths[b]`` real: its newest committed token, then its drafts). ``rows[b]``: (row b's committed
    tokens [C], its processors), or None's. Position j of row b is processed with the prefix committed +
    the row's first j drafts, exactly the ``input_ids`` ``generate`` would hold there."""
    out = logits.to(torch.float32, copy=True)  # [B, m, V]
    counts = lengths.tolist()
    for b, (committed, processors) in enumerate(rows):
        if not processors:
            continue
        n, start = counts[b], committed.shape[0]
        prefix = torch.cat([committed, tokens[b, 1:n]])  # [C + n - 1]
        if processors.set_only:  # all positions at once, as rows: position j's prefix, then ids V (ignored)
            ends = start + torch.arange(n, device=tokens.device)  # [n]
            columns = torch.arange(prefix.shape[0], device=tokens.device)  # [C + n - 1]
            padded = prefix.expand(n, -1).masked_fill(columns[None, :] >= ends[:, None], out.shape[-1])
            out[b, :n] = processors(padded, out[b, :n])  # [n, V]
            continue
        for j in range(n):
            out[b, j] = processors(prefix[None, :start + j], out[b, j:j + 1])[0]
    return out


@dataclass
class DraftSampler(Sampler):
    """The round's ``Sampler`` as the drafter sees it when processors are in force: each call of ``draft``
    drafts the next position of every row, after applying the row's processors to its logits [B, V] with
    the prefix committed + the tokens drafted before it this round (drafters call ``draft`` once per
    position, in order). q is the processed distribution the token was drawn from. Rows that no longer
    draft (``rows`` False) are not processed: their tokens are padding."""

    rows: Rows = field(default_factory=list)
    prefixes: list[torch.Tensor | None] = field(default_factory=list)  # per row: [1, C + i] after i drafts
    last: torch.Tensor | None = None  # [B] the tokens of the previous call

    @classmethod
    def wrap(cls, sampler: Sampler, rows: Rows) -> DraftSampler:
        return cls(sampler.configs, sampler.generators, rows, [None if c is None else c[None] for c, _ in rows])

    def draft(self, logits: torch.Tensor, rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        out = logits.to(torch.float32, copy=True)  # [B, V]
        drafting = [True] * len(self.rows) if rows is None or len(self.rows) == 1 else rows.tolist()
        for b, (committed, processors) in enumerate(self.rows):
            if processors is None:
                continue
            if self.last is not None:
                self.prefixes[b] = torch.cat([self.prefixes[b], self.last[b:b + 1, None]], dim=1)  # [1, C + i]
            if not drafting[b]:
                continue
            if len(self.rows) == 1:
                out = processors(self.prefixes[b], out)
            else:
                out[b] = processors(self.prefixes[b], out[b:b + 1])[0]
        token, q = super().draft(out, rows)
        self.last = token
        return token, q


@dataclass(frozen=True)
class Penalties:
    """OpenAI's per-request logits adjustments (``logit_bias``, ``presence_penalty``, ``frequency_penalty``), as data
    (a request crosses a process boundary to its engine); ``processor`` makes the row's processor of them."""

    bias: tuple[tuple[int, float], ...] = ()  # (token id, value added to its logit), values in [-100, 100]
    presence: float = 0.0  # subtracted once from the logit of every token the output holds so far
    frequency: float = 0.0  # subtracted from a token's logit once per time the output holds it

    def __bool__(self) -> bool:
        return bool(self.bias) or self.presence != 0.0 or self.frequency != 0.0

    def processor(self, prompt_length: int) -> PenaltyProcessor:
        """The processor of a row whose committed sequence starts with ``prompt_length`` prompt tokens."""
        return PenaltyProcessor(self, prompt_length)


class PenaltyProcessor(LogitsProcessor):
    """OpenAI's adjustments, per position, as its API reference defines them: ``logits[j] += bias[j] -
    frequency * c[j] - presence * (c[j] > 0)``, where ``c[j]`` counts token ``j`` in the output so far (the prefix
    past the prompt: OpenAI and vLLM penalise generated tokens only). A function of (prefix, scores) alone, so the
    round loop applies it at every verified position and to the drafter's q alike (``apply``, ``DraftSampler``),
    and speculative sampling stays exact."""

    def __init__(self, penalties: Penalties, prompt_length: int) -> None:
        self.penalties = penalties
        self.prompt_length = prompt_length
        self._bias: torch.Tensor | None = None  # [V] built at the first call, on the scores' device

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        out = scores.clone()  # [N, V]
        vocab = out.shape[-1]
        p = self.penalties
        if p.bias:
            if self._bias is None or self._bias.shape[0] != vocab or self._bias.device != out.device:
                bias = torch.zeros(vocab, dtype=out.dtype, device=out.device)
                ids = torch.tensor([t for t, _ in p.bias], dtype=torch.long, device=out.device)
                keep = ids < vocab  # a drafter with a smaller vocabulary: its ids only
                bias[ids[keep]] = torch.tensor([v for _, v in p.bias], dtype=out.dtype, device=out.device)[keep]
                self._bias = bias
            out += self._bias
        if p.presence or p.frequency:
            output = input_ids[:, self.prompt_length:]  # [N, L - prompt]
            counts = torch.zeros(out.shape, dtype=out.dtype, device=out.device)  # [N, V]
            real = output < vocab  # ids >= V: padding (``apply``'s set-only rows), never counted
            counts.scatter_add_(1, output.clamp_max(vocab - 1), real.to(out.dtype))
            out -= p.frequency * counts + p.presence * (counts > 0).to(out.dtype)
        return out
