"""Corpora built from text present on every machine (no dataset downloads).

- :mod:`specdec.data.stdlib`: Python source of the running interpreter's standard library,
  split deterministically by file path into train / validation / test.
- :mod:`specdec.data.tokenizer`: the byte-level BPE tokenizer trained on the train split.
- :mod:`specdec.data.prompts`: held-out code-completion prompts (function prefixes) from the test split.
"""
