"""Byte-level BPE tokenizer for Python source, trained with the ``tokenizers`` library.

Contract: trained on the train split of :mod:`specdec.data.stdlib` only; byte-level, so any text
round-trips exactly (``decode(encode(s)) == s``); saved as a ``transformers`` fast tokenizer that
loads with ``AutoTokenizer.from_pretrained``, with ``<|endoftext|>`` as its eos (and bos/pad) token.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from specdec.data.stdlib import load_split

EOS = "<|endoftext|>"


def train_tokenizer(texts: Iterable[str], vocab_size: int = 8192) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on ``texts`` and wrap it as a transformers fast tokenizer."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS, bos_token=EOS, pad_token=EOS, unk_token=None,
        model_max_length=512, clean_up_tokenization_spaces=False,
    )


def train_code_tokenizer(out_dir: str | Path, vocab_size: int = 8192,
                         root: str | None = None) -> PreTrainedTokenizerFast:
    """Train on the stdlib train split and save to ``out_dir``."""
    tokenizer = train_tokenizer((f.text for f in load_split("train", root)), vocab_size=vocab_size)
    tokenizer.save_pretrained(str(out_dir))
    return tokenizer
