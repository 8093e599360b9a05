"""The KV-cache handle: one model's ``DynamicCache`` with a length we can roll back.

Contract: ``KVCache.length`` is the number of tokens whose keys and values are stored; a forward
through ``KVCache.forward`` feeds only new tokens and appends them; ``crop_to(n)`` drops
everything after the first ``n`` tokens (``DynamicCache.crop`` with a negative count, the
transformers 5 API). Sliding-window layers record their past so they can be cropped too.
Caches that cannot be rolled back (recurrent / linear-attention layers) are refused up front.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer


class KVCache:
    """A model's KV cache with an explicit, cheap-to-read length."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.cache = DynamicCache(config=model.config)
        for layer in self.cache.layers:
            if not isinstance(layer, DynamicLayer):
                raise TypeError(
                    f"{type(model).__name__} uses cache layers of type {type(layer).__name__}, which cannot "
                    "be rolled back after a rejected draft; use an attention-only model"
                )
            if isinstance(layer, DynamicSlidingWindowLayer):
                layer.activate_past_recording()
        self._sliding = any(isinstance(layer, DynamicSlidingWindowLayer) for layer in self.cache.layers)
        self.length = 0  # tokens stored; kept in Python to avoid reading tensor shapes each round

    def forward(self, input_ids: torch.Tensor, logits_to_keep: int = 1) -> torch.Tensor:
        """Run the model on ``input_ids`` [1, n] (uncached tokens only).

        Returns the logits of the last ``logits_to_keep`` positions [1, logits_to_keep, V].
        """
        out = self.model(
            input_ids=input_ids,
            past_key_values=self.cache,
            use_cache=True,
            logits_to_keep=logits_to_keep,
        )
        self.length += input_ids.shape[1]
        return out.logits

    def crop_to(self, n: int) -> None:
        """Keep the first ``n`` cached tokens (``n <= length``)."""
        drop = self.length - n
        if drop < 0:
            raise ValueError(f"cannot crop a cache of {self.length} tokens to {n}")
        if drop or self._sliding:  # sliding layers also shrink back to their window on crop(0)
            self.cache.crop(-drop)
        self.length = n

    def stored_length(self) -> int:
        """The length read from the cache tensors themselves (for tests of the invariant)."""
        return self.cache.get_seq_length()
