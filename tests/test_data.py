"""The stdlib corpus split, the tokenizer and the held-out prompts."""

from __future__ import annotations

import string

from hypothesis import given, settings
from hypothesis import strategies as st

import specdec
from specdec.data.prompts import code_completion_prompts
from specdec.data.stdlib import SPLITS, _corpus_paths, load_split, split_of, stdlib_root
from specdec.data.tokenizer import EOS, train_tokenizer


def test_split_is_deterministic_disjoint_and_covers_the_corpus():
    root = stdlib_root()
    rels = [p.relative_to(root).as_posix() for p in _corpus_paths(root)]
    assert not any("site-packages" in r for r in rels)
    assert [split_of(r) for r in rels] == [split_of(r) for r in rels]
    names = {s: {f.relpath for f in load_split(s)} for s in SPLITS}
    assert all(names[s] for s in SPLITS), "every split must be non-empty"
    assert not names["train"] & names["test"]
    assert not names["train"] & names["validation"]
    assert not names["validation"] & names["test"]
    assert set().union(*names.values()) <= set(rels)
    assert len(names["train"]) > 10 * len(names["test"])
    for s in SPLITS:  # every file is where the hash says
        assert all(split_of(r) == s for r in names[s])


def test_split_does_not_depend_on_the_other_files():
    """A file's split is a function of its own path only (adding files elsewhere moves nothing)."""
    assert split_of("json/decoder.py") == split_of("json/decoder.py")
    buckets = {split_of(f"pkg/mod{i}.py") for i in range(400)}
    assert buckets == set(SPLITS)


_TOKENIZER = None


def _small_tokenizer():
    global _TOKENIZER
    if _TOKENIZER is None:
        texts = [f.text for f in load_split("train")[:60]]
        _TOKENIZER = train_tokenizer(texts, vocab_size=600)
    return _TOKENIZER


def test_tokenizer_round_trips_held_out_source_exactly(tmp_path):
    from transformers import AutoTokenizer

    _small_tokenizer().save_pretrained(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    assert tok.eos_token == EOS and tok.eos_token_id is not None
    assert len(tok) == 600
    for f in load_split("test")[:15]:
        ids = tok(f.text, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == f.text, f.relpath
    ids = tok("x = 1\n")["input_ids"]
    assert tok.eos_token_id not in ids, "no special tokens are added to plain text"


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet=st.characters(codec="utf-8") | st.sampled_from(list(string.whitespace)), max_size=80))
def test_tokenizer_round_trips_any_text(text):
    tok = _small_tokenizer()
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text


def test_prompts_are_held_out_deterministic_function_prefixes():
    prompts = code_completion_prompts(20)
    assert len(prompts) == 20
    assert prompts == code_completion_prompts(20)
    test_files = {f.relpath for f in load_split("test")}
    ids = [p["id"] for p in prompts]
    assert len({i.rsplit(":", 1)[0] for i in ids}) == len(ids), "one function per file"
    for p in prompts:
        assert p["id"].rsplit(":", 1)[0] in test_files
        last = p["prompt"].rstrip().splitlines()[-1].strip()
        # ends at a signature (":" ends the def) or right after a docstring
        assert last.endswith((":", '"""', "'''")) or last[-1] in "\"'", last


def test_prompts_end_on_a_token_boundary_of_the_source():
    """The prompt's tokens are a prefix of the source's tokens: no split newline-and-indent token."""
    tok = specdec.load_tokenizer("code-target")
    texts = {f.relpath: f.text for f in load_split("test")}
    for p in code_completion_prompts(20):
        source = texts[p["id"].rsplit(":", 1)[0]]
        start = source.index(p["prompt"])
        prompt_ids = tok(p["prompt"])["input_ids"]
        source_ids = tok(source[start : start + len(p["prompt"]) + 200])["input_ids"]
        assert source_ids[: len(prompt_ids)] == prompt_ids, p["id"]
        assert not p["prompt"].endswith("\n")
