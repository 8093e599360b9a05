"""specdec.compat on the installed transformers: every forward specdec calls gets its cache under the keyword that
forward's signature names (``cache`` from 5.24, ``past_key_values`` / ``cache_params`` before), so a renamed keyword
is never passed (it warns at every call from 5.24, and 5.23 silently drops an unknown ``cache``), and no
FutureWarning reaches the user; decoding still equals the model's own ``generate``."""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch
from conftest import assert_same_greedy, build_tiny, hf_greedy, truncated_copy
from test_recurrent import build_recurrent

import specdec
from specdec.compat import NAMES, cache_keyword, cache_of

pytestmark = pytest.mark.usefixtures("one_thread")


def record_cache_keywords(*models: torch.nn.Module) -> list[tuple[str, set[str], set[str]]]:
    """(class name, cache keywords passed, the forward's parameters) for every call of ``models`` given a cache."""
    calls: list[tuple[str, set[str], set[str]]] = []

    def hook(module, args, kwargs):
        passed = {name for name in NAMES if name in kwargs}
        if passed:
            calls.append((type(module).__name__, passed, set(inspect.signature(module.forward).parameters)))

    for model in models:
        model.register_forward_pre_hook(hook, with_kwargs=True)
    return calls


@pytest.mark.parametrize("arch", ["llama", "gpt2", "mamba", "bamba"])
def test_every_forward_gets_its_cache_under_its_own_keyword(arch):
    if arch in ("llama", "gpt2"):
        target = build_tiny(arch)
        drafter = truncated_copy(target, 1)
    else:
        target = build_recurrent(arch)
        drafter = build_recurrent(arch, seed=1)
    prompt = [5, 9, 14, 5, 9, 14, 5, 9]
    reference = hf_greedy(target, prompt, 12, [])
    calls = record_cache_keywords(target, drafter)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        result = specdec.speculative_generate(target, drafter, prompt, max_new_tokens=12, gamma=3, stop_token_ids=[])
    assert_same_greedy(target, prompt, result.tokens, reference)
    target_calls = [c for c in calls if c[0] == type(target).__name__]
    assert target_calls, "no cached forward of the target was seen"
    for name, passed, parameters in calls:
        assert passed <= parameters, f"{name} got {passed}, its forward takes {sorted(parameters & set(NAMES))}"
    assert {next(iter(passed)) for name, passed, _ in target_calls} == {cache_keyword(target)}


def test_a_models_returned_cache_is_read_under_its_field():
    target = build_tiny("llama")
    with torch.no_grad():
        out = target(torch.tensor([[3, 4, 5]]), use_cache=True)
    cache = cache_of(out)
    assert cache is not None and cache.get_seq_length() == 3


def test_xlm_s_dict_cache_is_no_cache_keyword():
    """XLM keeps its own ``cache`` dict (refused by name elsewhere): it is not taken for a transformers Cache."""
    from transformers import XLMConfig, XLMWithLMHeadModel

    model = XLMWithLMHeadModel(XLMConfig(vocab_size=50, emb_dim=32, n_layers=1, n_heads=2))
    assert cache_keyword(model) is None
    assert cache_keyword(build_tiny("llama")) in ("cache", "past_key_values")
