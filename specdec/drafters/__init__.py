"""Drafters behind one base class, and the one factory that builds them from what a user names.

``make_drafter`` turns what the API, the CLI, the chat or the bench was given into a ready
``Drafter`` for a target:

- a ``Drafter`` object: checked against the target (``align``) and used as is;
- a transformers model: wrapped by the first entry of ``MODEL_DRAFTERS`` that accepts it (a causal
  LM: ``ModelDrafter``) and checked against the target (vocabulary, device);
- a name or a ``DrafterConfig``: a registered model-free drafter ("ngram"), a model to load (a
  shipped name or a folder, through ``loader``: by default ``load_model`` on the target's device
  and dtype; callers that keep models pass their own, which decides what a name means), or "lookup+NAME": prompt lookup
  first and the drafter NAME when lookup finds nothing (``LookupDrafter``). A block drafter model (SpecDec,
  ``BlockDrafterModel``, or an encoder-decoder with ``config.block_drafter``) drafts through
  ``BlockDrafter``; "block" names the shipped block drafter for the target's kind
  (``code-block-drafter``, or ``translate-block-drafter`` for an encoder-decoder target) and
  "block:PATH" a block drafter folder (so "lookup+block" is prompt lookup
  first, the block drafter otherwise). A loaded model runs in the form ``DrafterConfig.dtype`` names
  (``drafter_in``: by default int8 on CPU for a model drafting alone, as loaded behind lookup); a model
  passed in runs as it is.

New drafters register with ``register_drafter`` (by name) or ``register_model_drafter`` (by the
kind of model they wrap).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from specdec.config import BLOCK, LOOKUP, DrafterConfig
from specdec.drafters import block_model  # noqa: F401  (registers the block drafter with the Auto classes)
from specdec.drafters.base import Drafter, FollowingDrafter, NoDrafter, Proposal, StopRule
from specdec.drafters.block import BlockDrafter, is_block_drafter
from specdec.drafters.feature import FeatureDrafter
from specdec.drafters.feature_model import is_feature_drafter
from specdec.drafters.hybrid import LookupDrafter
from specdec.drafters.model import ModelDrafter, drafter_in
from specdec.drafters.ngram import NgramDrafter
from specdec.drafters.parallel import ParallelDrafter
from specdec.drafters.parallel_model import is_parallel_drafter

# name -> factory taking no arguments: the model-free drafters a name selects
DRAFTERS: dict[str, Callable[[], Drafter]] = {"ngram": NgramDrafter}
# (accepts a model?, wraps it) in the order tried: which Drafter drafts with a given kind of model
MODEL_DRAFTERS: list[tuple[Callable[[PreTrainedModel], bool], Callable[..., Drafter]]] = []

Loader = Callable[[str], PreTrainedModel]
SHIPPED_BLOCK = {False: "code-block-drafter", True: "translate-block-drafter"}  # by target.encoder_decoder


def register_drafter(name: str, factory: Callable[[], Drafter]) -> None:
    """Make the drafter name ``name`` build ``factory()``."""
    DRAFTERS[name] = factory


def register_model_drafter(accepts: Callable[[PreTrainedModel], bool], wrap: Callable[..., Drafter]) -> None:
    """Let models that ``accepts`` draft through ``wrap(model)``; tried before earlier entries. A call that asks for
    no kernels wraps ``wrap(model, kernels=False)``."""
    MODEL_DRAFTERS.insert(0, (accepts, wrap))


def _language_model(model: PreTrainedModel) -> bool:
    """A causal LM or an encoder-decoder model with its language-model head (``ModelDrafter`` drafts with both)."""
    return model.get_output_embeddings() is not None


register_model_drafter(_language_model, ModelDrafter)
register_model_drafter(is_block_drafter, BlockDrafter)
register_model_drafter(is_feature_drafter, FeatureDrafter)  # EAGLE-3 style: reads the target's features
register_model_drafter(is_parallel_drafter, ParallelDrafter)  # PARD / DFlash style: a block from the features


def _block_name(name: str, encoder_decoder: bool) -> tuple[str, bool]:
    """A drafter model name with the block aliases resolved: (model name or folder, whether a block drafter is
    required)."""
    if name == BLOCK:
        return SHIPPED_BLOCK[encoder_decoder], True
    if name.startswith(BLOCK + ":"):
        path = name[len(BLOCK) + 1:]
        if not path:
            raise ValueError(f"drafter {name!r}: block:PATH needs the folder of a block drafter after the ':'")
        return path, True
    return name, False


def model_drafter(model: PreTrainedModel, kernels: bool = True) -> Drafter:
    """The drafter that drafts with ``model``; a clear error for a kind of model none handles. ``kernels``: whether
    it gives the model specdec's linear kernels (``ModelDrafter``)."""
    for accepts, wrap in MODEL_DRAFTERS:
        if accepts(model):
            return wrap(model) if kernels else wrap(model, kernels=False)
    raise TypeError(f"drafter {type(model).__name__} is a model that no drafter handles: draft with a language "
                    "model with its head (load it with AutoModelForCausalLM, AutoModelForSeq2SeqLM or "
                    "specdec.load_model)")


def _check_name(name: str) -> None:
    """Refuse a name that is neither registered nor a shipped model nor an existing folder."""
    from specdec.loading import SHIPPED_MODELS

    if name not in DRAFTERS and name not in SHIPPED_MODELS and not Path(name).expanduser().exists():
        raise ValueError(
            f"unknown drafter {name!r}: use {', '.join(sorted(DRAFTERS))}, lookup+NAME, block, block:PATH, a shipped "
            f"model ({', '.join(SHIPPED_MODELS)}) or a model folder"
        )


def make_drafter(drafter: object, target, tokenizer: PreTrainedTokenizerBase | None = None,
                 loader: Loader | None = None, kernels: bool = True) -> Drafter:
    """A ready drafter for ``target`` (a ``Target``) from a Drafter, a model, a name or a DrafterConfig; ``kernels``:
    whether a drafter made here from a model gives it specdec's linear kernels (``ModelDrafter``)."""
    if isinstance(drafter, Drafter):
        return drafter.align(target, tokenizer)
    if isinstance(drafter, PreTrainedModel):
        return model_drafter(drafter, kernels).align(target, tokenizer)
    if isinstance(drafter, str):
        drafter = DrafterConfig(drafter)
    if not isinstance(drafter, DrafterConfig):
        raise TypeError(
            f"drafter must be a transformers model, a drafter name ({', '.join(sorted(DRAFTERS))}, lookup+NAME, a "
            f"model name or folder), a DrafterConfig or a Drafter, got {type(drafter).__name__}"
        )
    if drafter.name in DRAFTERS:
        return DRAFTERS[drafter.name]().align(target, tokenizer)
    assert drafter.model is not None
    name, block = _block_name(drafter.model, target.encoder_decoder)
    if loader is None:
        from specdec.loading import load_model

        _check_name(name)

        def loader(path: str) -> PreTrainedModel:
            return load_model(path, device=target.device, dtype=target.model.dtype)

    model = drafter_in(loader(name), drafter.dtype, lookup=drafter.lookup)
    if block and not is_block_drafter(model):
        raise ValueError(f"drafter {drafter.model!r}: {name} holds a {type(model).__name__}, not a block drafter "
                         "(train one with specdec train block-drafter)")
    inner = make_drafter(model, target, tokenizer, kernels=kernels)
    if not drafter.name.startswith(LOOKUP):
        return inner
    if not isinstance(inner, FollowingDrafter):
        raise TypeError(f"lookup+{name}: the drafter {name!r} cannot follow tokens that lookup drafted")
    return LookupDrafter(inner)


__all__ = [
    "DRAFTERS",
    "MODEL_DRAFTERS",
    "BlockDrafter",
    "Drafter",
    "FeatureDrafter",
    "FollowingDrafter",
    "LookupDrafter",
    "ModelDrafter",
    "NgramDrafter",
    "NoDrafter",
    "ParallelDrafter",
    "Proposal",
    "StopRule",
    "drafter_in",
    "make_drafter",
    "model_drafter",
    "register_drafter",
    "register_model_drafter",
]
