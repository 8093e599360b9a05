"""One byte-level BPE tokenizer for both sides of a translation pair, trained with ``tokenizers``.

Contract: trained on the English and German texts of the corpus's train split only
(:mod:`specdec.data.gettext`); byte-level, so any text round-trips exactly
(``decode(encode(s)) == s``: format markers, accelerators, newlines and edge spaces included);
saved as a ``transformers`` fast tokenizer that loads with ``AutoTokenizer.from_pretrained``.
Special tokens as Marian (Junczys-Dowmunt et al. 2018; ``MarianTokenizer``) has them:
``<pad>`` = 0 (also the decoder start token), ``</s>`` = 1 (eos, appended to every encoded text),
``<unk>`` = 2 (never produced by a byte-level BPE; declared for the config). One vocabulary for
source and target lets the models tie all embeddings (encoder, decoder, output).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

PAD, EOS, UNK = "<pad>", "</s>", "<unk>"
SPECIAL_TOKENS = (PAD, EOS, UNK)  # ids 0, 1, 2 in this order
MAX_LENGTH = 512  # tokens per side the models are built for (their sinusoidal position tables)


def train_seq2seq_tokenizer(texts: Iterable[str], vocab_size: int = 8000) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on ``texts`` (both languages) and wrap it as a fast tokenizer that
    appends ``</s>`` to every encoded text."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    eos_id = tok.token_to_id(EOS)
    tok.post_processor = processors.TemplateProcessing(single=f"$A {EOS}", pair=f"$A {EOS} $B {EOS}",
                                                       special_tokens=[(EOS, eos_id)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD, eos_token=EOS, unk_token=UNK,
        model_max_length=MAX_LENGTH, clean_up_tokenization_spaces=False,
    )


def train_translation_tokenizer(data_dir: str | Path, out_dir: str | Path,
                                vocab_size: int = 8000) -> PreTrainedTokenizerFast:
    """Train on the train split of a ``specdec data gettext`` folder and save to ``out_dir``."""
    from specdec.data.gettext import load_pairs

    pairs = load_pairs(data_dir, "train")
    tokenizer = train_seq2seq_tokenizer((t for p in pairs for t in (p.src, p.tgt)), vocab_size=vocab_size)
    tokenizer.save_pretrained(str(out_dir))
    return tokenizer
