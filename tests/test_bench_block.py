"""The block drafter sweep's own pieces (``specdec/bench/block.py``): edit distance against a plain
recursive definition, the sweep's settings checked by the core's rules, the table and the plot."""

from __future__ import annotations

from functools import cache

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.bench.block import edit_distance, plot_acceptance, summary_markdown
from specdec.bench.config import BenchConfig


def levenshtein(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """The definition: delete, insert or substitute one token at a time."""

    @cache
    def d(i: int, j: int) -> int:
        if i == 0 or j == 0:
            return i + j
        return min(d(i - 1, j) + 1, d(i, j - 1) + 1, d(i - 1, j - 1) + (a[i - 1] != b[j - 1]))

    return d(len(a), len(b))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=9), st.lists(st.integers(0, 3), max_size=9))
def test_edit_distance_is_levenshtein(a, b):
    assert edit_distance(a, b) == levenshtein(tuple(a), tuple(b))


def test_sweep_settings_are_checked():
    with pytest.raises(ValueError, match="beta must be an int >= 1"):
        BenchConfig(block="block", beta=(0,))
    with pytest.raises(ValueError, match="tau must be a number >= 0"):
        BenchConfig(block="block", tau=(-1.0,))
    with pytest.raises(ValueError, match="block_k and relaxed_k"):
        BenchConfig(block="block", block_k=(0, 4))


def test_table_and_plot(tmp_path):
    method = {"name": "block k=4", "kind": "block", "gamma": 4, "beta": 1, "tau": None, "speed_vs_plain": 1.5,
              "speed_vs_model": 1.2, "tokens_per_round": 2.5, "identical_share": 1.0, "mean_edit_distance": 0.0,
              "acceptance_by_position": [0.75, 0.5, 0.25, 0.125]}
    relaxed = {**method, "name": "block k=4 b=5 t=3", "kind": "block-relaxed", "beta": 5, "tau": 3.0,
               "identical_share": 0.25, "mean_edit_distance": 7.5}
    summary = {"prompts": 4, "methods": [method, relaxed]}
    table = summary_markdown(summary)
    assert "| block k=4 | 1.50x | 1.20x | 2.50 | 100% | 0.00 |" in table
    assert "| block k=4 b=5 t=3 | 1.50x | 1.20x | 2.50 | 25% | 7.50 |" in table
    assert "- block k=4: 0.75 0.50 0.25 0.12" in table
    plot_acceptance(summary, tmp_path / "acceptance.png")
    assert (tmp_path / "acceptance.png").stat().st_size > 1000
