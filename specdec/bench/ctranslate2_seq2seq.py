"""CTranslate2 as a peer of the translation bench: a Marian model converted as transformers runs it.

CTranslate2's stock Marian converter (``ctranslate2.converters.TransformersConverter``) assumes the
layout of the OPUS-MT checkpoints: ``<pad>`` is the vocabulary's *last* token, added by the port to
transformers, so it drops the last row of every vocabulary matrix (embeddings, output projection and
its bias) whatever that row is, and it starts the decoder from a *zero* embedding with ``</s>`` as
its start token. A Marian model trained in transformers need not follow it: the shipped
``translate-target`` has ``<pad>`` = 0 = the decoder start token with a trained (nonzero)
embedding: the stock conversion cuts its real last token (``ĠSHA``) from the weights while naming all
8,000 tokens, which CTranslate2 refuses ("Source vocabulary 0 has size 8000 but the model expected a
vocabulary of size 7999"), and would start every translation from the wrong vector.

``MarianLoader`` converts what transformers computes instead: every vocabulary row kept (the
tokenizer's tokens in id order, placeholders where the model has more rows than the tokenizer
names), the decoder started from the embedding of the model's own ``decoder_start_token_id``, and
the rest as the stock loader does (post-norm layers, the embeddings scaled as the model scales them,
the sinusoidal position table copied, ``final_logits_bias``). ``CTranslate2Translator`` runs it
greedy (``beam_size`` 1) in float32 on ``threads`` threads, source and output as token ids; the
translation bench checks every output against transformers' greedy ``generate``.

CTranslate2 is an optional extra (``pip install ctranslate2``); this module imports it at the top,
so it is imported only when the peer is asked for.
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence

import ctranslate2
import torch
from ctranslate2.converters.transformers import _SUPPORTED_ACTIVATIONS, MarianMTLoader, TransformersConverter
from ctranslate2.specs import transformer_spec
from transformers import PreTrainedModel, PreTrainedTokenizerBase

PLACEHOLDER = "<specdec-row-{}>"  # the name of a vocabulary row the tokenizer does not name


def vocabulary(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> list[str]:
    """One token name per row of ``model``'s vocabulary matrices, in id order: the tokenizer's tokens (cut to
    the model's rows), placeholders for rows it does not name."""
    rows = model.get_input_embeddings().weight.shape[0]
    names = tokenizer.convert_ids_to_tokens(list(range(min(rows, len(tokenizer)))))
    names += [PLACEHOLDER.format(i) for i in range(len(names), rows)]
    if len(set(names)) != len(names):
        raise ValueError("the tokenizer names two vocabulary rows alike: CTranslate2 keys its vocabulary by name")
    return names


class MarianLoader(MarianMTLoader):
    """CTranslate2's Marian loader without the OPUS-MT assumptions: all rows kept, the decoder started from the
    embedding of the model's ``decoder_start_token_id`` (see the module doc)."""

    def get_model_spec(self, model: PreTrainedModel) -> transformer_spec.TransformerSpec:
        config = model.config
        if not getattr(config, "share_encoder_decoder_embeddings", True):
            raise ValueError("a Marian model with separate source and target vocabularies: the CTranslate2 peer "
                             "converts shared ones only")
        spec = transformer_spec.TransformerSpec.from_config(
            (config.encoder_layers, config.decoder_layers), config.encoder_attention_heads, pre_norm=False,
            activation=_SUPPORTED_ACTIVATIONS[config.activation_function], layernorm_embedding=False)
        self.set_encoder(spec.encoder, model.model.encoder)
        self.set_decoder(spec.decoder, model.model.decoder)
        self.set_linear(spec.decoder.projection, model.lm_head)
        bias = getattr(model, "final_logits_bias", None)
        if bias is not None and bool(bias.any()):
            spec.decoder.projection.bias = bias.squeeze(0)
        return spec  # no row removed: _remove_pad_weights is the stock loader's

    def set_config(self, config, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
        names = vocabulary(model, tokenizer)
        config.eos_token = names[model.config.eos_token_id]
        config.unk_token = tokenizer.unk_token if tokenizer.unk_token in names else names[0]
        config.decoder_start_token = names[model.config.decoder_start_token_id]

    def set_decoder(self, spec, decoder) -> None:
        super().set_decoder(spec, decoder)
        spec.start_from_zero_embedding = False  # the start token's own embedding, as transformers feeds it

    def get_vocabulary(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> list[str]:
        return vocabulary(model, tokenizer)


class _LoadedConverter(TransformersConverter):
    """``TransformersConverter`` on a model already loaded, through a given loader (its ``convert`` validates,
    optimises to the quantization asked and saves the spec)."""

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, loader: MarianLoader) -> None:
        super().__init__(getattr(model, "name_or_path", "") or "")
        self.model, self.tokenizer, self.loader = model, tokenizer, loader

    def _load(self):
        with torch.no_grad():
            return self.loader(self.model, self.tokenizer)


def convert(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, folder: str,
            quantization: str = "float32") -> str:
    """Write ``model`` (a ``MarianMTModel``) as a CTranslate2 translator into ``folder``; returns it."""
    if model.config.model_type != "marian":
        raise ValueError(f"the CTranslate2 translation peer converts Marian models; this one is "
                         f"{model.config.model_type!r}")
    return _LoadedConverter(model, tokenizer, MarianLoader()).convert(folder, quantization=quantization, force=True)


class CTranslate2Translator:
    """CTranslate2's ``Translator`` on the target (converted by ``MarianLoader`` into a temporary folder):
    greedy translation of token ids, float32, ``threads`` intra-op threads."""

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, threads: int) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="specdec-ctranslate2-seq2seq-")  # removed with the engine
        convert(model, tokenizer, self._dir.name)
        self.names = vocabulary(model, tokenizer)
        self.index = {name: i for i, name in enumerate(self.names)}
        self.translator = ctranslate2.Translator(self._dir.name, device="cpu", compute_type="float32",
                                                 intra_threads=threads, inter_threads=1)

    def translate(self, source: Sequence[int], max_new_tokens: int, eos: int) -> list[int]:
        """Greedy new tokens for ``source``: at most ``max_new_tokens``, ending at (and with) ``eos``."""
        result = self.translator.translate_batch(
            [[self.names[i] for i in source]], beam_size=1, max_decoding_length=max_new_tokens,
            min_decoding_length=0, max_input_length=0, end_token=self.names[eos], return_end_token=True)
        return [self.index[name] for name in result[0].hypotheses[0]]
