"""One compile plan: the shapes a run's decode forwards take, for every front end that compiles them.

The command line, the chat console, the Python API (``specdec.session``), the server's background compiler and the
bench all ask ``decode_plan`` which (tokens, rows) buckets to compile (``specdec.compiled.prepare``), so a compiled
run of any of them finds the buckets its forwards take. The shapes follow the decoder's calls: the target verifies
``gamma + 1`` tokens (and a prompt-lookup copy, and steps 1 token when it decodes plainly), a drafter model steps 1
token and catches up (``specdec.compiled.token_buckets``); rows of 1, 4, 16, ... below the batch size and the batch
size (``specdec.compiled.row_buckets``). The block drafter has no static form and decodes eagerly. A drafter that
reads the target's features (a feature or parallel drafter, ``drafter_features``) decodes eagerly too, and the
target's buckets return those features from the graph (``Shapes.hidden`` = their layers): its verify forwards ask
for them on every round, so without them each would run outside the graph.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from specdec.arguments import COMPARE
from specdec.config import BLOCK, LOOKUP, NGRAM

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from specdec.compiled import CompileChoice


@dataclass(frozen=True)
class Shapes:
    """The buckets one model's decode forwards are compiled for (``specdec.compiled.prepare``'s arguments)."""

    tokens: tuple[int, ...]  # tokens per row
    rows: tuple[int, ...]  # rows per forward
    # the forwards return hidden states: True the last (a drafter model under the ada schedule), a tuple of
    # ``hidden_states`` indices those layers' (a target whose drafter reads its features, ``specdec.features``)
    hidden: bool | tuple[int, ...] = False
    last: bool = False  # the forwards of more than one token keep their last token's logits only (a drafter's catch-up)
    bare: bool = True  # the buckets without hidden states too (False: every forward asks for them, ``decode_plan``)

    def prepare(self, model: PreTrainedModel, how: str = "on", *, cached_only: bool = False) -> CompileChoice:
        """``specdec.compiled.prepare`` of ``model`` for these buckets, under ``--compile how``."""
        from specdec.compiled import prepare

        return prepare(model, how, tokens=self.tokens, rows=self.rows, hidden=self.hidden, last=self.last,
                       bare=self.bare, cached_only=cached_only)


@dataclass(frozen=True)
class Plan:
    """What a run compiles: the target's buckets, and the drafter model's (None where no drafter model decodes:
    prompt lookup alone, the block drafter, plain decoding)."""

    target: Shapes
    drafter: Shapes | None


def decode_plan(gamma: int, *, lookup: bool, drafter_model: bool, speculating: bool, plain: bool,
                batch: int = 1, hidden: bool = False, features: tuple[int, ...] | None = None,
                featureless: bool = False) -> Plan:
    """The buckets of a run drafting ``gamma`` tokens a round: with prompt lookup before a model (``lookup``: its
    copies run longer than gamma) and/or a drafter model
    (``drafter_model``: one with a static form, not the block drafter) when ``speculating``, the target alone when
    ``plain`` (both: a run that may do either, as ``--speculate auto`` or the bench), in batches of up to ``batch``
    rows; ``hidden``: the drafter model returns its hidden states (the ada schedule reads them); ``features``: the
    target's layers a drafter reads (``drafter_features``; its verify forwards return them, so its buckets are
    compiled returning them only, unless ``featureless``: the target decodes without that drafter too, as the chat's
    compare does), whose own model then has no buckets (it decodes eagerly)."""
    from specdec.compiled import row_buckets, token_buckets
    from specdec.drafters.hybrid import LOOKUP_NGRAM

    rows = row_buckets(batch)
    verify, steps = token_buckets(gamma, LOOKUP if lookup else None, speculating, plain,
                                  LOOKUP_NGRAM.copy_length(gamma))
    drafter = Shapes(steps, rows, hidden, True) if speculating and drafter_model and not features else None
    return Plan(Shapes(verify, rows, features or False, bare=not features or featureless), drafter)


def drafter_features(drafter: object) -> tuple[int, ...] | None:
    """The target's ``hidden_states`` indices that ``drafter`` reads (``specdec.features.drafter_layers``), or None:
    a drafter name (``lookup+NAME``, a shipped name or a folder: its config.json is read, nothing loaded; a name
    that is none of these is None here and refused where the drafter is made), a ``DrafterConfig``, a transformers
    model, or a ``Drafter`` (a prompt-lookup drafter's fallback)."""
    import json

    from specdec.config import DrafterConfig
    from specdec.features import drafter_layers

    if isinstance(drafter, DrafterConfig):
        drafter = drafter.name
    if isinstance(drafter, str):
        _, model = drafter_parts(drafter)
        if model is None:
            return None
        from specdec.folders import resolve_model_path

        try:
            config = json.loads((resolve_model_path(model) / "config.json").read_text(encoding="utf-8"))
        except (ValueError, OSError):  # not a folder (or not JSON): make_drafter says why, in its words
            return None
        return drafter_layers(config) if isinstance(config, dict) else None
    inner = getattr(drafter, "fallback", None)  # prompt lookup in front of a drafter
    if inner is not None:
        return drafter_features(inner)
    model = getattr(drafter, "model", drafter)  # a Drafter's model, or the model itself
    config = getattr(model, "config", None)
    return drafter_layers(config) if config is not None else None


def drafter_parts(name: str | None) -> tuple[bool, str | None]:
    """(whether prompt lookup drafts in front of a model, copying up to ``LOOKUP_NGRAM``'s longer copies; the drafter
    model's name or None) of a drafter name ("ngram", "lookup+NAME", NAME); the block drafter ("block",
    "block:PATH") counts as no model here: it decodes eagerly."""
    if name is None:
        return False, None
    lookup = name.startswith(LOOKUP)
    model = None if name == NGRAM else name.removeprefix(LOOKUP)
    if model is not None and (model == BLOCK or model.startswith(BLOCK + ":")):
        model = None
    return lookup, model or None


def mode_plan(mode: str, gamma: int, speculate: str, drafter: str | None, *, batch: int = 1,
              schedule: str | None = None) -> Plan:
    """``decode_plan`` of a run in ``mode`` (speculative, target, drafter, or the chat's compare) under
    ``--speculate speculate``, drafting with the drafter named ``drafter``, under the schedule named ``schedule``."""
    speculating = mode in ("speculative", COMPARE) and speculate != "off"
    plain = mode != "speculative" or speculate != "on"
    lookup, model = drafter_parts(drafter)
    features = drafter_features(drafter) if mode in ("speculative", COMPARE) else None  # the drafter is made
    return decode_plan(gamma, lookup=lookup, drafter_model=model is not None, speculating=speculating, plain=plain,
                       batch=batch, hidden=schedule == "ada", features=features, featureless=mode != "speculative")
