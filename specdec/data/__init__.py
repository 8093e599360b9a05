"""Corpora built from text present on every machine (no dataset downloads).

- :mod:`specdec.data.stdlib`: Python source of the running interpreter's standard library,
  split deterministically by file path into train / validation / test.
- :mod:`specdec.data.tokenizer`: the byte-level BPE tokenizer trained on the train split.
- :mod:`specdec.data.prompts`: held-out code-completion prompts (function prefixes) from the test split.
- :mod:`specdec.data.gettext`: English→German message pairs from the installed gettext catalogues,
  split by catalogue (``specdec data gettext``).
- :mod:`specdec.data.seq2seq_tokenizer`: the byte-level BPE shared by English and German.
"""
