"""Positions from one rule for every model: 0-based, counted in each row's live tokens, given the way its family reads
them.

A token's position is the number of live tokens before it in its row (``RaggedCache``: dead slots,
left padding and rejected drafts, are not counted), which is what ``generate`` gives a row decoded
alone. Families read positions in three ways, and ``Positions`` gives them in that way, on every
forward (holes or not, so a batch of one and a batch of many take the same path):

- ``position_ids``: a decoder-only model whose forward takes them gets them as an argument, as
  ``generate`` passes them (``attention_mask.cumsum(-1) - 1``); an encoder-decoder model whose
  decoder reads them as ``decoder_position_ids`` (T5Gemma 2; EncoderDecoderModel through its
  ``**kwargs``) gets them so, where the rules below find nothing to override. RoBERTa-family decoders need this
  even for one prompt: without it they count from ``padding_idx + 1``.
- A decoder that computes positions from the cache length (BART, mBART, Marian, Pegasus,
  Blenderbot, PLBart, MVP, BigBird-Pegasus, TrOCR, M2M-100, NLLB-MoE, FSMT, decoder-only or
  encoder-decoder) and ignores ``position_ids``: a forward hook on its ``embed_positions`` replaces
  the module's output with the rows of its table at the rows' positions. The table is its
  ``weight`` (an ``nn.Embedding``) or its ``weights`` buffer (sinusoidal modules), indexed at
  ``position + offset`` (BART's learned tables start at 2), or, for fairseq-style modules that
  number positions from ``padding_idx + 1`` and give the pad token its own zero row
  (``make_positions`` / ``create_position_ids_from_input_ids``), at ``position + padding_idx + 1``,
  a pad token at ``padding_idx`` — as their single steps do.
- A module that computes its vectors from ``position_ids`` shared by the whole batch (Pegasus-X's
  sinusoids, ``embed_positions(inputs_embeds, past_length, position_ids)``): a forward hook calls it
  again for each row with that row's positions.
- T5's relative position bias: the ``compute_bias`` of the self-attention layers that hold one (T5:
  the first; UMT5: each) computed from the per-row positions of queries and keys ([B, heads, q, k], which broadcasts
  where T5 adds it).

A model with none of these computes positions its own way: it is decoded without holes only
(``supported`` False; batches of one prompt).
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from transformers import PreTrainedModel


def takes_position_ids(model: PreTrainedModel) -> bool:
    """Whether ``generate`` would pass ``position_ids`` to ``model`` (a decoder-only model whose forward names them)."""
    return (not getattr(model.config, "is_encoder_decoder", False)
            and "position_ids" in inspect.signature(model.forward).parameters)


class Positions:
    """How one model receives per-row positions (see the module docstring)."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.owner = weakref.ref(model)  # the model whose hooks read this (a deep copy's attribute is not its own)
        self.query: torch.Tensor | None = None  # [B, n] positions of the new tokens, while a forward runs
        self.keys: torch.Tensor | None = None  # [B, S + n] positions of every slot (dead ones: any)
        self.argument = takes_position_ids(model)
        self.needs_keys = False
        self.supported = True
        self.loose = False  # position_ids offered in **kwargs beside the mask, for a model that may read them
        encoder_decoder = bool(getattr(model.config, "is_encoder_decoder", False))
        self.keyword = "decoder_position_ids" if encoder_decoder else "position_ids"  # the argument's name
        if self.argument:
            return
        try:
            decoder = model.get_decoder()
        except (AttributeError, NotImplementedError, ValueError):
            decoder = None
        table = getattr(decoder, "embed_positions", None)
        if table is not None and self._table(table) is not None:
            table.register_forward_hook(self._embedding_hook)
        elif table is not None and "position_ids" in inspect.signature(table.forward).parameters:
            table.register_forward_hook(self._computed_hook)
        elif decoder is not None and (attentions := self._relative_attention(decoder)):
            for attention in attentions:
                self._override_bias(attention)
            self.needs_keys = True
        elif encoder_decoder and "decoder_position_ids" in inspect.signature(model.forward).parameters:
            self.argument = True  # T5Gemma 2: its decoder reads them
        else:  # positions of its own (from the mask, like ALiBi, or none): the
               # self-check tells whether holes shift them
            self.supported = False
            self.loose = any(p.kind is inspect.Parameter.VAR_KEYWORD  # EncoderDecoderModel: decoder_* to its decoder
                             for p in inspect.signature(model.forward).parameters.values())

    @staticmethod
    def _table(module: nn.Module) -> torch.Tensor | None:
        """The module's table of position vectors [P, H], or None if it has none."""
        table = module.weight if isinstance(module, nn.Embedding) else getattr(module, "weights", None)
        return table if isinstance(table, torch.Tensor) and table.dim() == 2 else None

    @staticmethod
    def _relative_attention(decoder: nn.Module) -> list[nn.Module]:
        """The decoder's self-attentions that hold a relative position bias (T5: the first; UMT5: every one)."""
        return [module for module in decoder.modules()
                if getattr(module, "has_relative_attention_bias", False) and hasattr(module, "compute_bias")]

    def _override_bias(self, attention: nn.Module) -> None:
        original = attention.compute_bias

        def compute_bias(query_length, key_length, device=None, past_seen_tokens=0):
            if self.query is None:
                return original(query_length, key_length, device=device, past_seen_tokens=past_seen_tokens)
            relative = self.keys[:, None, :] - self.query[:, :, None]  # [B, q, k]
            if list(inspect.signature(attention._relative_position_bucket).parameters) == ["relative_position"]:
                buckets = attention._relative_position_bucket(relative)  # UMT5: its settings read from the module
            else:
                buckets = attention._relative_position_bucket(
                    relative, bidirectional=False, num_buckets=attention.relative_attention_num_buckets,
                    max_distance=attention.relative_attention_max_distance)
            return attention.relative_attention_bias(buckets).permute(0, 3, 1, 2)  # [B, heads, q, k]

        attention.compute_bias = compute_bias

    def _embedding_hook(self, module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        if self.query is None:
            return output
        table = self._table(module)
        fairseq = hasattr(module, "make_positions") or hasattr(module, "create_position_ids_from_input_ids")
        if fairseq and getattr(module, "padding_idx", None) is not None:
            index = self.query + module.padding_idx + 1  # [B, n]
            ids = args[0] if args and isinstance(args[0], torch.Tensor) and args[0].shape == self.query.shape else None
            if ids is not None:
                index = index.masked_fill(ids == module.padding_idx, module.padding_idx)
        else:
            index = self.query + int(getattr(module, "offset", 0))  # [B, n]
        return table[index].to(output.dtype)  # [B, n, H]

    def _computed_hook(self, module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        """A module that computes its vectors from ``position_ids`` [n, 1] shared by the batch (Pegasus-X's
        sinusoids): called again for each row with that row's positions."""
        if self.query is None:
            return output
        rows = [module.forward(output[b : b + 1], 0, self.query[b, :, None])
                for b in range(self.query.shape[0])]  # each [1, n, H]
        return torch.cat(rows).to(output.dtype)  # [B, n, H]

    @contextmanager
    def applied(self, kwargs: dict, query: torch.Tensor, slots: torch.Tensor | None, width: int) -> Iterator[None]:
        """Within the block, a forward with ``kwargs`` gives the new tokens the positions ``query`` [B, n];
        ``slots`` [B, S + n] (live slots and real new tokens; None: all ``width`` = S + n are) gives the keys'."""
        if self.argument or (self.loose and slots is not None):
            kwargs[self.keyword] = query
            yield
            return
        self.query = query
        if self.needs_keys:
            if slots is None:
                self.keys = torch.arange(width, device=query.device)[None].expand(query.shape[0], -1)
            else:
                self.keys = (slots.long().cumsum(dim=1) - 1).clamp_min(0)  # [B, S + n]
        try:
            yield
        finally:
            self.query = self.keys = None


_POSITIONS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its Positions (``positions_for``)


def positions_for(model: PreTrainedModel) -> Positions:
    """The ``Positions`` of ``model``, made (and its hooks installed) on first use and kept in a table keyed weakly
    by the model itself (not set on it; not keyed by ``id(model)``, which a later model can reuse and which a
    compiled graph saved to disk would look up by a number of another process). A ``Positions`` holds its model
    weakly (``owner``), so the entry dies with the model."""
    positions = _POSITIONS.get(model)
    if positions is None or positions.owner() is not model:
        positions = _POSITIONS[model] = Positions(model)
    return positions
