"""The target's features: hidden states of chosen decoder layers, captured on the forwards it runs anyway.

A feature drafter (EAGLE-3, Li et al. 2025) drafts from the target's own hidden states at a low, a middle and a
high layer. ``ModelTarget.want_features(layers)`` asks the target to capture them; from then on its prefill and
every verify forward return them (transformers' ``output_hidden_states``, which selects hidden states by index: the
other layers' are not kept) from the same forward, no second pass, and the target logs, per row, the features of
the positions it keeps in its cache (``FeatureLog``); ``take_features`` hands them over. A target nobody asked
passes nothing more to its model.

Layer indices are those of transformers' ``hidden_states`` tuple: 0 is the embeddings' output (the input of
decoder layer 0), ``i`` the output of decoder layer ``i - 1`` (the input of layer ``i``), ``L`` (the number of
decoder layers) the last layer's output after the final norm. EAGLE-3's rule (``eagle3_layers``) reads the input of
layers 2, L // 2 and L - 3, as its reference code and vLLM's ``aux_hidden_state_layers`` do.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

EAGLE3 = "eagle3"  # the name of EAGLE-3's rule (``eagle3_layers``)


def decoder_layers(model: PreTrainedModel) -> int:
    """L, the decoder layers of a decoder-only ``model`` (its text config's ``num_hidden_layers``)."""
    return int(model.config.get_text_config().num_hidden_layers)


def eagle3_layers(layers: int) -> tuple[int, int, int]:
    """EAGLE-3's three feature layers for a decoder of ``layers`` (L) layers: the inputs of layers 2, L // 2 and
    L - 3 (indices of ``hidden_states``), each clamped into 0..L-1 (a layer's input, never the final norm's output)
    and sorted, so a small model still gets three (some repeated): L = 32 gives (2, 16, 29), L = 6 (code-target)
    (2, 3, 3), L = 4 (1, 2, 2), L = 2 (0, 1, 1), L = 1 (0, 0, 0)."""
    top = max(layers - 1, 0)
    return tuple(sorted(min(max(i, 0), top) for i in (2, layers // 2, layers - 3)))


def resolve_layers(model: PreTrainedModel, layers: tuple[int, ...] | list[int] | str) -> tuple[int, ...]:
    """The feature layers ``layers`` names for ``model`` (``EAGLE3``, or indices of ``hidden_states``), in layer
    order; a ValueError naming the model and the range where one is out of it."""
    count = decoder_layers(model)
    if isinstance(layers, str):
        if layers != EAGLE3:
            raise ValueError(f"feature layers {layers!r}: give {EAGLE3!r} or a tuple of layer indices")
        return eagle3_layers(count)
    chosen = tuple(layers)
    if not chosen or any(not isinstance(i, int) or isinstance(i, bool) or not 0 <= i <= count for i in chosen):
        raise ValueError(f"feature layers {chosen} must be indices in 0..{count} for {type(model).__name__} "
                         f"({count} decoder layers: 0 is the embeddings, i the output of layer i - 1)")
    return tuple(sorted(chosen))


def drafter_layers(config: object) -> tuple[int, ...] | None:
    """The ``hidden_states`` indices a drafter of ``config`` (a config object or its ``config.json`` as a dict) asks
    the target for, once each in order, or None where it reads no features: a feature or parallel drafter's
    ``feature_layers`` are the 0-based decoder layers whose outputs it reads, index ``i + 1`` each. What its
    ``align`` asks (``want_features``) and what a compiled target's buckets return (``specdec.plan``) alike."""
    get = config.get if isinstance(config, dict) else (lambda key, default=None: getattr(config, key, default))
    layers, target = get("feature_layers"), get("target_config")
    if not isinstance(layers, (list, tuple)) or not layers or target is None:
        return None
    return tuple(sorted({int(i) + 1 for i in layers}))


def selection(layers: tuple[int, ...], last: int | None = None) -> list[int]:
    """What a forward passes as ``output_hidden_states`` to capture ``layers`` (and ``last``, the final hidden
    state's index, where the last hidden state is asked for too): each index once, in order."""
    return sorted(set(layers) | ({last} if last is not None else set()))


def features_of(states: tuple[torch.Tensor | None, ...], layers: tuple[int, ...], who: str) -> torch.Tensor:
    """The features [B, n, len(layers) * H]: the hidden states ``states`` (a forward's ``hidden_states``) of
    ``layers`` concatenated in that order; a RuntimeError naming ``who`` where the forward did not return one."""
    if states is None or any(i >= len(states) or states[i] is None for i in layers):
        got = "none" if states is None else f"{len(states)} entries"
        raise RuntimeError(f"{who} returned no hidden states for feature layers {layers} ({got})")
    if (odd := next((i for i in layers if states[i].dim() != 3), None)) is not None:  # Gemma 3n: [AltUp, B, n, H]
        raise TypeError(f"{who}'s hidden state {odd} has shape {tuple(states[odd].shape)}, not [rows, tokens, "
                        "hidden]: specdec cannot take its features; choose a target whose layers pass one hidden state")
    return torch.cat([states[i] for i in layers], dim=-1)


def right_aligned(features: torch.Tensor, valid: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ``features`` [B, T, F] (``valid`` [B, T] marks the real positions, the last ``n[b]`` of row b;
    None: all) as right-padded (features [B, T, F], n [B])."""
    rows, width = features.shape[:2]
    if valid is None:
        return features, torch.full((rows,), width, dtype=torch.long, device=features.device)
    n = valid.sum(dim=1)
    index = (torch.arange(width, device=features.device)[None, :] + (width - n)[:, None]).clamp_max(width - 1)
    moved = features.gather(1, index[:, :, None].expand(-1, -1, features.shape[2]))
    return moved.masked_fill(~_first(n, width)[:, :, None], 0), n


def _first(n: torch.Tensor, width: int) -> torch.Tensor:
    """[B, width] bool: the first ``n[b]`` positions of each row."""
    return torch.arange(width, device=n.device)[None, :] < n[:, None]


class FeatureLog:
    """Per row, the features of the positions a target has kept since they were last taken: ``features``
    [B, P, F] right-padded, ``lengths`` [B]. Rows follow the target's cache rows (``add_rows``, ``select``,
    ``reset``); ``extend`` appends a round's kept positions; ``take`` hands everything over and empties the log."""

    def __init__(self, size: int, dtype: torch.dtype, device: torch.device | str) -> None:
        self.size, self.dtype, self.device = size, dtype, torch.device(device)
        self.features = torch.zeros(0, 0, size, dtype=dtype, device=self.device)
        self.lengths = torch.zeros(0, dtype=torch.long, device=self.device)

    @property
    def rows(self) -> int:
        return self.lengths.shape[0]

    def add_rows(self, features: torch.Tensor, lengths: torch.Tensor) -> None:
        """Append rows (after the current ones) holding ``features`` [b, W, F] (right-padded, ``lengths`` [b])."""
        width = max(self.features.shape[1], features.shape[1])
        parts = [torch.nn.functional.pad(t, (0, 0, 0, width - t.shape[1])) for t in (self.features, features)]
        self.features = torch.cat([parts[0], parts[1].to(self.dtype)])
        self.lengths = torch.cat([self.lengths, lengths.to(self.device)])

    def extend(self, features: torch.Tensor, keep: torch.Tensor) -> None:
        """Append to each row b the first ``keep[b]`` positions of ``features`` [B, m, F] (a round's verify)."""
        if not bool(self.lengths.any()):  # nothing held (a drafter that takes every round): the round's, as it is
            width = int(keep.max()) if keep.numel() else 0
            kept = features[:, :width].masked_fill(~_first(keep, width)[:, :, None], 0)  # a rejected position: 0
            self.features, self.lengths = kept.to(self.dtype), keep.clone()
            return
        total = self.lengths + keep
        width = int(total.max())
        grown = self.features.new_zeros(self.rows, width, self.size)
        held = self.features[:, :width]
        grown[:, : held.shape[1]] = held
        row, column = _first(keep, features.shape[1]).nonzero(as_tuple=True)
        grown[row, self.lengths[row] + column] = features[row, column].to(self.dtype)
        self.features, self.lengths = grown, total

    def select(self, rows: torch.Tensor) -> None:
        """Keep the rows ``rows`` [B'] (in that order)."""
        rows = rows.to(self.device)
        self.features, self.lengths = self.features[rows], self.lengths[rows]
        width = int(self.lengths.max()) if self.rows else 0
        self.features = self.features[:, :width]

    def take(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(features [B, n, F] right-padded, lengths [B]) held, and the log emptied (its rows kept)."""
        out = (self.features, self.lengths)
        self.features = self.features.new_zeros(self.rows, 0, self.size)
        self.lengths = torch.zeros_like(self.lengths)
        return out


class Capture:
    """What a prefill captures for ``layers`` of a model of ``count`` decoder layers: each forward's (or each group's,
    in row order: ``seq2seq.prefilled_caches``) features of the positions it cached, right-aligned (``took``), joined
    by ``rows``."""

    def __init__(self, layers: tuple[int, ...], count: int, who: str) -> None:
        self.layers, self.who = layers, who
        self.asks = selection(layers)  # the forward's ``output_hidden_states``
        self.whole_last = count in layers  # the last layer's output is read: the prefill runs it whole (``tail``)
        self.parts: list[tuple[torch.Tensor, torch.Tensor] | int] = []

    def took(self, states: tuple[torch.Tensor | None, ...], valid: torch.Tensor | None) -> None:
        """A prefill forward's ``hidden_states`` (``valid`` [b, T]: its real positions, left-padded; None: all)."""
        self.parts.append(right_aligned(features_of(states, self.layers, self.who), valid))

    def nothing(self, rows: int) -> None:
        """``rows`` rows fed no forward (one-token prompts: nothing cached)."""
        self.parts.append(rows)

    def rows(self, size: int, dtype: torch.dtype, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
        """Every row's features, in order: (features [b, W, ``size``] right-padded, lengths [b])."""
        parts = [part if not isinstance(part, int) else
                 (torch.zeros(part, 0, size, dtype=dtype, device=device),
                  torch.zeros(part, dtype=torch.long, device=device)) for part in self.parts]
        width = max((f.shape[1] for f, _ in parts), default=0)
        features = [torch.nn.functional.pad(f.to(dtype), (0, 0, 0, width - f.shape[1])) for f, _ in parts]
        return (torch.cat(features) if features else torch.zeros(0, 0, size, dtype=dtype, device=device),
                torch.cat([n for _, n in parts]) if parts else torch.zeros(0, dtype=torch.long, device=device))
