"""Drafters behind one protocol, and a registry of the model-free ones by name.

``make_drafter`` turns what the user passed into a ``Drafter``: a registered name ("ngram"), a
``transformers`` causal LM (wrapped in ``ModelDrafter`` and checked against the target), or any
object implementing the protocol (used as is). New drafters register with ``register_drafter``.
"""

from __future__ import annotations

from collections.abc import Callable

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from specdec.drafters.base import Drafter, Proposal
from specdec.drafters.hybrid import LookupModelDrafter
from specdec.drafters.model import ModelDrafter
from specdec.drafters.ngram import NgramDrafter

# name -> factory taking no arguments; used when ``drafter`` is a string
DRAFTERS: dict[str, Callable[[], Drafter]] = {"ngram": NgramDrafter}


def register_drafter(name: str, factory: Callable[[], Drafter]) -> None:
    """Make ``speculative_generate(target, name, ...)`` use ``factory()``."""
    DRAFTERS[name] = factory


def make_drafter(
    drafter: object, target: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None = None
) -> Drafter:
    """A ready drafter for ``target`` from a name, a causal LM or a protocol object."""
    if isinstance(drafter, str):
        if drafter not in DRAFTERS:
            raise ValueError(
                f"unknown drafter {drafter!r}: use one of {', '.join(sorted(DRAFTERS))}, "
                "a transformers causal LM, or an object with prefill/propose/commit"
            )
        return DRAFTERS[drafter]()
    if isinstance(drafter, PreTrainedModel):
        return ModelDrafter(drafter).align(target, tokenizer)
    if isinstance(drafter, (ModelDrafter, LookupModelDrafter)):
        return drafter.align(target, tokenizer)
    if isinstance(drafter, Drafter):
        return drafter
    raise TypeError(
        f"drafter must be a transformers causal LM, a drafter name ({', '.join(sorted(DRAFTERS))}) or an "
        f"object with prefill/propose/commit methods, got {type(drafter).__name__}"
    )


__all__ = ["DRAFTERS", "Drafter", "LookupModelDrafter", "ModelDrafter", "NgramDrafter", "Proposal", "make_drafter", "register_drafter"]
