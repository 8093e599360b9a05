"""A session: the models of one process, their compiled forms and torch's threads, for every front end.

``Session`` loads the models once (target, drafter model or "ngram", tokenizers), sets the thread count before any
model runs (``specdec.threads``), compiles the decode forwards as ``--compile`` says for the shapes of the run
(``specdec.plan``), and runs one decoding mode on a prompt; switching the drafter loads the new one once and keeps
it. The command line, the chat console, the server and its background compiler, and the bench use it.

The Python API's ``specdec.speculative_generate`` and ``specdec.autoregressive_generate`` are the thin functions
here: they apply ``threads=`` and ``compile=`` through the same two steps (``use_threads``, ``compile_models`` over
``specdec.plan``'s plan), then call the core (``specdec.decode``), which never compiles. No terminal imports here.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from specdec.arguments import COMPARE, Settings, UsageError
from specdec.config import DrafterConfig, ModelConfig, ScheduleConfig, SpecConfig, check_kernels, compiles
from specdec.plan import Plan, Shapes, mode_plan
from specdec.threads import ThreadChoice, use_threads

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from specdec.drafters import Drafter
    from specdec.stats import GenerationResult, RoundEvent
    from specdec.target import Target


def compile_models(models: Sequence[tuple[str, PreTrainedModel, Shapes]], how: str, *, cached_only: bool = False,
                   say: Callable[[str], None] | None = None) -> list[str]:
    """Compile each (label, model, shapes) as ``--compile how`` says (``specdec.compiled.prepare``; shapes already
    compiled are kept); returns what was decided, "label: decision" per model. ``say`` hears each decision that did
    something new or left a model eager (not with ``cached_only``, which compiles from the compile cache only, all
    or none, silently)."""
    from specdec.compiled import compiled_for

    decided = []
    for label, model, shapes in models:
        known = compiled_for(model)
        before = set(known.shapes) if known is not None else set()
        choice = shapes.prepare(model, how, cached_only=cached_only)
        decided.append(f"{label}: {choice.describe()}")
        new = choice.compiled and bool(compiled_for(model).shapes - before)
        if say is not None and not cached_only and (not choice.compiled or new):  # said when something new was done
            say(decided[-1])
    return decided


def _stderr(line: str) -> None:
    print(f"specdec: {line}", file=sys.stderr, flush=True)


class Session:
    """The models of one process, loaded on first use and kept: a front end never reloads them."""

    def __init__(self, models: ModelConfig) -> None:
        from transformers.utils import logging

        logging.disable_progress_bar()
        logging.set_verbosity_error()
        self.threads: ThreadChoice = use_threads(models.threads, model=models.target, flag="--threads")  # first
        self.models = models
        self._models: dict[str, PreTrainedModel] = {}
        self._tokenizers: dict[str, PreTrainedTokenizerBase] = {}

    def _name(self, mode: str) -> str:
        """The model whose tokenizer and vocabulary a mode uses."""
        if mode == "drafter":
            if self.models.drafter_model is None:
                raise UsageError("mode 'drafter' decodes with a drafter model; the ngram drafter has none")
            return self.models.drafter_model
        return self.models.target

    def model(self, name: str) -> PreTrainedModel:
        """The causal LM at ``name`` (a shipped name or a folder), loaded once and warmed up."""
        if name not in self._models:
            from specdec.decode import autoregressive_generate
            from specdec.loading import load_model

            model = load_model(name, device=self.models.device, dtype=self.models.dtype)
            if model.get_output_embeddings() is not None:  # a feature drafter has no head of its own until bound
                autoregressive_generate(model, [0], max_new_tokens=1, stop_token_ids=[],
                                        kernels=self.models.kernels)  # warm-up
            self._models[name] = model
        return self._models[name]

    def compile(self, mode: str, spec: SpecConfig, schedule: ScheduleConfig, prompts: int | None = None, *,
                how: str | None = None, cached_only: bool = False) -> list[str]:
        """Compile the decode forwards of the models ``mode`` decodes with, for its shapes (``compile_plan``), as
        ``--compile`` says (``specdec.compiled``; nothing when off or auto, as measured; shapes already compiled are
        kept), at most ``prompts`` rows where the caller knows how many it decodes (one prompt compiles rows of 1
        only). ``how`` overrides ``--compile``; ``cached_only`` takes each model's buckets from the compile cache
        only, all or none (``compiled.prepare``), saying nothing. Returns what was decided, per model."""
        from specdec.loading import resolve_device

        how = how or self.models.compile
        if not compiles(how, resolve_device(self.models.device)):
            return []
        plan = [(name, self.model(name), Shapes(*shapes))
                for name, *shapes in self.compile_plan(mode, spec, schedule, prompts)]
        return compile_models(plan, how, cached_only=cached_only, say=_stderr)

    def compile_plan(self, mode: str, spec: SpecConfig, schedule: ScheduleConfig,
                     prompts: int | None = None) -> list[tuple]:
        """What ``compile`` compiles (``specdec.plan.mode_plan``): (model name, tokens buckets, rows buckets, hidden
        states, the last logits only, the buckets without hidden states too) per model: ``Shapes``' fields."""
        plan = mode_plan(mode, spec.gamma, spec.speculate, self.models.drafter,
                         batch=min(spec.batch_size, prompts or spec.batch_size), schedule=schedule.schedule)
        first = self._name(mode) if mode == "drafter" else self.models.target
        entries = [(first, plan.target)]
        if plan.drafter is not None:
            entries.append((self.models.drafter_model, plan.drafter))
        return [(name, s.tokens, s.rows, s.hidden, s.last, s.bare) for name, s in entries]

    def tokenizer(self, mode: str) -> PreTrainedTokenizerBase:
        """The tokenizer of the model that decodes in ``mode``."""
        name = self._name(mode)
        if name not in self._tokenizers:
            from specdec.loading import load_tokenizer

            self._tokenizers[name] = load_tokenizer(name)
        return self._tokenizers[name]

    def drafter(self) -> Drafter:
        """The drafter, built by the one drafter factory from the loaded models (loaded once)."""
        from specdec.drafters import make_drafter
        from specdec.target import make_target

        target = make_target(self.model(self.models.target), self.models.kernels == "auto")
        try:
            return make_drafter(self.models.drafter_config, target, self.tokenizer("speculative"), loader=self.model,
                                kernels=self.models.kernels == "auto")
        except ValueError as err:
            default = DrafterConfig.name
            if self.models.drafter != default or not re.search("vocabulary|tokenizer", str(err)):
                raise
            # the drafter nobody named: say it was the default, and what drafts for any target
            raise ValueError(f"{err} (the drafter was the default, {default}, drafting for code-target: give "
                             f"--drafter ngram, prompt lookup, which drafts for any target, or --drafter FOLDER of a "
                             "drafter trained with the target's tokenizer)") from None

    def set_drafter(self, name: str) -> None:
        """Switch the drafter (a model name/folder or "ngram"), loading a new model now."""
        previous = self.models
        self.models = dataclasses.replace(self.models, drafter=name)
        try:
            self.drafter()
        except Exception:
            self.models = previous
            raise

    def load(self, mode: str, speculate: str = SpecConfig.speculate) -> None:
        """Load what ``mode`` needs now rather than at the first prompt (no drafter where ``speculate`` is "off")."""
        self.tokenizer(mode)
        if mode in ("target", "speculative", COMPARE):
            self.model(self.models.target)
        if mode == "drafter" or (mode in ("speculative", COMPARE) and speculate != "off"):
            self.drafter()

    def encode(self, prompt: str, settings: Settings) -> list[int]:
        """Prompt text -> token ids, through the chat template when asked."""
        tokenizer = self.tokenizer(settings.mode)
        if not settings.chat_template:
            return list(tokenizer(prompt).input_ids)
        if not getattr(tokenizer, "chat_template", None):
            raise UsageError(f"the tokenizer of {self._name(settings.mode)!r} has no chat template")
        messages = [{"role": "user", "content": prompt}]
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)
                    ["input_ids"])

    def generate(self, prompt_ids: list[int] | list[list[int]], settings: Settings,
                 on_round: Callable[[RoundEvent], None] | None = None,
                 on_result: Callable[[GenerationResult], None] | None = None
                 ) -> GenerationResult | list[GenerationResult]:
        """Decode one prompt's ids (or a list of them) in ``settings.mode`` (speculative, target or drafter)."""
        from specdec import decode

        batch = bool(prompt_ids) and isinstance(prompt_ids[0], list)
        self.compile(settings.mode, settings.spec, settings.schedule, prompts=len(prompt_ids) if batch else 1)
        sampling = {k: None if k in settings.from_model else v
                    for k, v in dataclasses.asdict(settings.sampling).items()}
        kwargs = dict(
            max_new_tokens=settings.spec.max_new_tokens,
            **sampling,
            stop_strings=list(settings.stop_strings) or None,
            tokenizer=self.tokenizer(settings.mode),
            on_round=on_round,
            on_result=on_result,
            batch_size=settings.spec.batch_size,
            kernels=self.models.kernels,
        )
        if settings.mode == "speculative":
            drafter = None if settings.spec.speculate == "off" else self.drafter()  # plain: no drafter to load
            return decode.speculative_generate(self.model(self.models.target), drafter, prompt_ids,
                                               gamma=settings.spec.gamma, speculate=settings.spec.speculate,
                                               verify=settings.verify, schedule=settings.schedule,
                                               tree=settings.spec.tree, **kwargs)
        return decode.autoregressive_generate(self.model(self._name(settings.mode)), prompt_ids, **kwargs)


# ------------------------------------------------------------------------------------------ the Python API

API_COMPILE = "off"  # the API's compile= default: as before compile= existed (the CLI's auto compiles on CUDA)


def _prompt_count(prompts: object) -> int | None:
    """How many prompts ``prompts`` holds (token ids or a string: one), None when it does not say."""
    if isinstance(prompts, str):
        return 1
    if isinstance(prompts, (list, tuple)):
        return 1 if not prompts or isinstance(prompts[0], int) else len(prompts)
    return None


def _use_threads(threads: int | None, model: PreTrainedModel) -> ThreadChoice:
    """``threads=``: the count asked for; None: a choice specdec already applied in this process stays (a
    ``Session``'s, the bench's, an earlier call's: each call does not re-read the machine, and a count set with
    ``torch.set_num_threads`` after it is kept), else the command line's choice for ``model`` (``specdec.threads``)."""
    from specdec.threads import applied, current

    if threads is None and applied() is not None:
        return current()
    return use_threads(threads, model=model, flag="threads=")


def _drafter_parts(drafter: object) -> tuple[bool, bool]:
    """(prompt lookup before a model, a drafter model to compile) of the API's ``drafter`` argument: a name, a
    ``DrafterConfig`` or a transformers model; a ``Drafter`` built by the caller compiles nothing of its own."""
    from transformers import PreTrainedModel

    from specdec.plan import drafter_parts

    if isinstance(drafter, PreTrainedModel):
        return False, True
    name = drafter.name if isinstance(drafter, DrafterConfig) else drafter if isinstance(drafter, str) else None
    lookup, model = drafter_parts(name)
    return lookup, model is not None


def prepare_call(target: PreTrainedModel | Target, drafter: object, prompts: object, *, compile: str,
                 threads: int | None, gamma: int = SpecConfig.gamma, speculate: str = SpecConfig.speculate,
                 batch_size: int = SpecConfig.batch_size, schedule: object = None,
                 tokenizer: PreTrainedTokenizerBase | None = None,
                 kernels: str = ModelConfig.kernels) -> tuple[PreTrainedModel | Target, object, Plan | None]:
    """What the API does before the core decodes, as a ``Session`` does: set torch's threads (``threads=``), then
    compile the target's and the drafter model's decode forwards for the call's shapes (``specdec.plan``) as
    ``compile`` says ("on", "auto": on CUDA only, "off": nothing). ``drafter`` None: plain decoding. A drafter named
    by a string or ``DrafterConfig`` is loaded (as the core would) and compiled before it is built; returns the
    target and drafter to decode with, and the plan compiled (None: nothing compiled)."""
    import torch

    from specdec.loading import input_device, load_model
    from specdec.plan import decode_plan, drafter_features
    from specdec.target import Target, make_target

    model = target.model if isinstance(target, Target) else target
    if not isinstance(model, torch.nn.Module):  # the core refuses it in its own words (a TypeError naming the fix)
        return target, drafter, None
    _use_threads(threads, model)
    if not compiles(compile, input_device(model)):
        return target, drafter, None
    speculating = drafter is not None and speculate != "off"
    lookup, drafter_model = _drafter_parts(drafter) if speculating else (False, False)
    features = drafter_features(drafter) if drafter is not None else None  # the target's, from its graph
    count = _prompt_count(prompts)
    name = schedule if isinstance(schedule, str) else getattr(schedule, "schedule", None)
    plan = decode_plan(gamma, lookup=lookup, drafter_model=drafter_model, speculating=speculating,
                       plain=drafter is None or speculate != "on", batch=min(batch_size, count or batch_size),
                       hidden=name == "ada", features=features)
    compile_models([("target", model, plan.target)], compile)
    if plan.drafter is None:
        return target, drafter, plan
    if not isinstance(drafter, (str, DrafterConfig)):  # a transformers model
        compile_models([("drafter", drafter, plan.drafter)], compile)
        return target, drafter, plan
    from specdec.drafters import make_drafter

    fast = check_kernels(kernels)
    handle = make_target(target, fast)

    def loader(path: str) -> PreTrainedModel:  # make_drafter's own loading, then compiled
        loaded = load_model(path, device=handle.device, dtype=handle.model.dtype)
        compile_models([("drafter", loaded, plan.drafter)], compile)
        return loaded

    return handle, make_drafter(drafter, handle, tokenizer, loader=loader, kernels=fast), plan


def speculative_generate(target: PreTrainedModel | Target, drafter: object, prompts: object, *,
                         compile: str = API_COMPILE, threads: int | None = None,
                         **options) -> GenerationResult | list[GenerationResult]:
    """Generate with ``target``, drafting with ``drafter``, for one prompt or a list of prompts:
    ``specdec.decode.speculative_generate`` (``options``: its keywords, ``max_new_tokens``, ``gamma``,
    ``temperature``, ``batch_size``, ...; its contract) after the command line's preparations (``prepare_call``).

    ``threads``: torch's CPU thread count, set for this call and after it (None: the command line's choice,
    ``specdec.threads``: ``OMP_NUM_THREADS`` when set, else one thread for a target under 200M parameters and the
    physical cores above; made once a process, so a count set with ``torch.set_num_threads`` after it is kept).
    ``compile``: "on" compiles the target's and the drafter model's decode forwards for the call's shapes
    (``specdec.compiled``; kept for later calls), "auto" on CUDA only (CUDA graphs), "off" (the default, as before
    ``compile=`` existed) nothing. The output is the same tokens either way."""
    from specdec import decode

    target, drafter, _ = prepare_call(target, drafter, prompts, compile=compile, threads=threads,
                                      **{k: options[k] for k in ("gamma", "speculate", "batch_size", "schedule",
                                                                 "tokenizer", "kernels") if k in options})
    return decode.speculative_generate(target, drafter, prompts, **options)


def autoregressive_generate(target: PreTrainedModel | Target, prompts: object, *, compile: str = API_COMPILE,
                            threads: int | None = None, **options) -> GenerationResult | list[GenerationResult]:
    """Plain decoding with the target alone: ``specdec.decode.autoregressive_generate`` (``options``: its keywords)
    after ``threads`` and ``compile`` are applied as in ``speculative_generate``."""
    from specdec import decode

    target, _, _ = prepare_call(target, None, prompts, compile=compile, threads=threads,
                                **{k: options[k] for k in ("batch_size", "kernels") if k in options})
    return decode.autoregressive_generate(target, prompts, **options)
