"""What the feature drafter and the parallel drafter models share: context slots over the target's features, and
the target's embedding and LM head bound at load.

Both drafters (``specdec.drafters.feature_model``, ``specdec.drafters.parallel_model``) read the same input at a
context slot t: the target's fused feature f_t (``fuse``: Linear(3H -> H) of the three chosen layers' hidden
states) paired with the embedding of x_{t+1}, as ``proj`` Linear(2H -> H) of concat(``embed_norm``(embedding),
``hidden_norm``(f_t)); both end in a final ``norm`` and the target's own LM head. ``ContextSlotsModel`` holds that
part once: the shared modules, ``pairs`` (the slots' input), ``head``, the attention-mask helpers, and ``bind``,
which reads the target's token embedding and LM head (frozen, shared, never saved: the drafter's folder is small)
and refuses, in one line naming both, a target the drafter was not made for (``mismatch``).

A subclass adds its own modules in ``build`` (called between ``proj`` and the rotary embedding, so the modules are
registered, and seeded weights drawn, in the order each drafter always had: its saved folders and its weights for a
given seed are unchanged) and names itself (``noun``, ``command``: the words of its refusals). Its config is a
``FeatureDrafterConfig`` or a subclass (``layer_config``, ``feature_layers``, ``target_config``, ``target_name``,
``target_fingerprint``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import ClassVar

import torch
from torch import nn
from transformers import AutoModel, DynamicCache, PretrainedConfig, PreTrainedModel


def describe(config: PretrainedConfig | dict) -> str:
    """A target's shape in words: type, hidden size, layers, vocabulary (for refusals)."""
    get = config.get if isinstance(config, dict) else (lambda k, d=None: getattr(config, k, d))
    return (f"{get('model_type')}, hidden {get('hidden_size')}, {get('num_hidden_layers')} layers, "
            f"vocabulary {get('vocab_size')}")


def mismatch(config: PretrainedConfig, target_config: PretrainedConfig, fingerprint: str | None, drafter: str,
             target: str, command: str, verb: str = "made") -> str | None:
    """Why a drafter of ``config`` cannot draft for a target of ``target_config`` (one line naming both and the
    ``command`` that trains one), or None. ``fingerprint``: the target's, compared where both are known."""
    saved = config.target_config or {}
    keys = ("model_type", "hidden_size", "num_hidden_layers", "vocab_size")
    differ = [k for k in keys if saved.get(k) != getattr(target_config, k, None)]
    if not differ and fingerprint and config.target_fingerprint and fingerprint != config.target_fingerprint:
        what = f"its tokenizer or config differs: fingerprint {config.target_fingerprint} != {fingerprint}"
    elif differ:
        what = f"{describe(saved)} != {describe(target_config)}"
    else:
        return None
    return (f"{drafter} was {verb} for {config.target_name or 'another target'}, not for {target} ({what}): train one "
            f"for it with `specdec train {command} --target {target} --data OUTPUTS.jsonl --out DIR`")


def layer_classes(config: PretrainedConfig) -> tuple[type, type, type]:
    """(decoder layer, rotary embedding, final norm) classes of the architecture of ``config`` (one layer)."""
    with torch.device("meta"):
        base = AutoModel.from_config(config)
    layers, rotary, norm = (getattr(base, k, None) for k in ("layers", "rotary_emb", "norm"))
    if layers is None or rotary is None or norm is None:
        raise ValueError(f"a feature drafter needs a target with rotary decoder layers (model.layers, "
                         f"model.rotary_emb, model.norm, like Llama or Qwen2); {config.model_type} has none")
    return type(layers[0]), type(rotary), type(norm)


class ContextSlotsModel(PreTrainedModel):
    """Context slots over the target's features and the target's bound embedding and head (module docstring)."""

    base_model_prefix = "drafter"
    _supports_sdpa = True
    _supports_attention_backend = False
    _no_split_modules: ClassVar[list[str]] = []
    noun: ClassVar[str] = "drafter"  # "feature drafter", "parallel drafter": in messages
    command: ClassVar[str] = ""  # its trainer: `specdec train COMMAND`
    verb: ClassVar[str] = "made"  # "... was VERB for TARGET" in a refusal

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__(config)
        layer_config = config.layer_config()
        layer_class, rotary_class, norm_class = layer_classes(layer_config)
        width = layer_config.hidden_size
        eps = getattr(layer_config, "rms_norm_eps", 1e-6)
        self.fuse = nn.Linear(len(config.feature_layers) * width, width, bias=False)
        self.embed_norm = norm_class(width, eps=eps)
        self.hidden_norm = norm_class(width, eps=eps)
        if getattr(config, "layout", "proj") == "proj":  # the feature drafter's eagle3 layout has none
            self.proj = nn.Linear(2 * width, width, bias=False)
        self.build(layer_class, layer_config)
        self.rotary_emb = rotary_class(config=layer_config)
        self.norm = norm_class(width, eps=eps)
        self._shared: tuple[nn.Module, nn.Module] | None = None  # the bound target's (embedding, LM head)
        self.post_init()

    def build(self, layer_class: type, layer_config: PretrainedConfig) -> None:
        """The subclass's own modules (its decoder layers, ...), registered after ``proj``."""
        raise NotImplementedError

    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=self.config.target_config.get("initializer_range", 0.02))

    def get_input_embeddings(self) -> nn.Module | None:
        return self._shared[0] if self._shared else None

    def get_output_embeddings(self) -> None:
        return None  # the LM head is the target's: this is not a language model of its own

    # ------------------------------------------------------------------------------------ the target

    @classmethod
    def mismatch(cls, config: PretrainedConfig, target_config: PretrainedConfig, fingerprint: str | None = None,
                 drafter: str | None = None, target: str = "this target") -> str | None:
        """Why a drafter of ``config`` cannot draft for a target of ``target_config``, or None (``mismatch``)."""
        return mismatch(config, target_config, fingerprint, drafter or f"the {cls.noun}", target, cls.command,
                        cls.verb)

    def bind(self, target: PreTrainedModel, fingerprint: str | None = None, name: str = "this target"
             ) -> ContextSlotsModel:
        """Draft for ``target``: read its token embedding and LM head (frozen, shared, not copied). A target of
        another shape (or fingerprint, where given) is refused with one line naming both."""
        why = self.mismatch(self.config, target.config, fingerprint, target=name,
                            drafter=f"{self.noun} {self.name_or_path or ''}".strip())
        if why:
            raise ValueError(why)
        head = target.get_output_embeddings()
        if head is None:
            raise ValueError(f"{name} has no LM head (get_output_embeddings()): load it as a causal LM")
        from specdec.drafters.model import int8_head, is_int8

        if is_int8(self):  # its own layers draft in int8: so does a copy of the head, the larger half of a step
            head = int8_head(head)
        self._shared = (target.get_input_embeddings(), head)
        return self

    def shared(self) -> tuple[nn.Module, nn.Module]:
        if self._shared is None:
            raise ValueError(f"the {self.noun} is not bound to its target: call drafter.bind(target) first")
        return self._shared

    @classmethod
    def load(cls, path: str, target: PreTrainedModel, fingerprint: str | None = None, name: str = "this target",
             dtype: torch.dtype | None = None, hint: str = "") -> ContextSlotsModel:
        """The drafter saved in ``path``, bound to ``target`` (refused, one line, when made for another, when the
        folder holds none or another kind of model). ``hint``: words after the trainer's name in the first case."""
        saved = Path(path) / "config.json"
        if not saved.is_file():
            raise ValueError(f"no {cls.noun} at {path}: give the folder `specdec train {cls.command}` wrote{hint}")
        kind = json.loads(saved.read_text()).get("model_type")
        model_type = cls.config_class.model_type
        if kind != model_type:
            raise ValueError(f"{path} holds a {kind} model, not a {cls.noun} ({model_type}): train one with "
                             f"`specdec train {cls.command}`")
        config = cls.config_class.from_pretrained(path)
        why = cls.mismatch(config, target.config, fingerprint, drafter=f"{cls.noun} {path}", target=name)
        if why:
            raise ValueError(why)
        drafter = cls.from_pretrained(path, dtype=dtype or torch.float32)
        return drafter.bind(target, fingerprint, name)

    # ------------------------------------------------------------------------------------ the slots

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype its layers take inputs in: its weights' (float32 for int8 dynamically quantized linears, whose
        norms stay float)."""
        return self.norm.weight.dtype

    def fuse_features(self, features: torch.Tensor) -> torch.Tensor:
        """[B, n, 3H] target features -> [B, n, H], the hidden input f_t of a context slot."""
        return self.fuse(features.to(self.compute_dtype))

    def pairs(self, input_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """[B, n, H]: the slots' input, ``proj`` of concat(norm(embedding of ``input_ids``), norm(``hidden``)) (the
        ``proj`` layout's; the feature drafter's eagle3 layout feeds the pair to its widened layer instead)."""
        dtype = self.compute_dtype
        embed = self.shared()[0]
        return self.proj(torch.cat([self.embed_norm(embed(input_ids).to(dtype)), self.hidden_norm(hidden.to(dtype))],
                                   dim=-1))

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [B, n, V] of output hidden states [B, n, H] (final norm, then the target's LM head)."""
        lm_head = self.shared()[1]
        weight = lm_head.weight
        return lm_head(self.norm(hidden).to(weight.dtype if isinstance(weight, torch.Tensor) else torch.float32))

    def step_inputs(self, batch: int, n: int, dtype: torch.dtype, device: torch.device,
                    position_ids: torch.Tensor | None, attention_mask: torch.Tensor | None,
                    past_key_values: DynamicCache | None, use_cache: bool,
                    pattern) -> tuple[DynamicCache | None, torch.Tensor, torch.Tensor]:
        """The cache (a new one where one is wanted and none given), the position ids and the additive mask of one
        forward over ``n`` slots after the cache's. ``position_ids`` None: the slots after the cache's. A 2D
        ``attention_mask`` [B, past + n] (1 = live slot; None: all live) becomes ``pattern(mask)``'s boolean
        [B, 1, n, S]; a 4D one is taken as given: boolean (True = may attend) or additive (0 = may attend, as
        ``RaggedCache.tree_forward`` builds it)."""
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache()
        past = past_key_values.get_seq_length() if past_key_values is not None else 0
        if position_ids is None:
            position_ids = (past + torch.arange(n, device=device)).expand(batch, n)
        if attention_mask is None:
            attention_mask = torch.ones(batch, past + n, dtype=torch.long, device=device)
        if attention_mask.dim() == 2:
            if attention_mask.shape != (batch, past + n):
                raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)} but the cache holds {past} "
                                 f"slots and {n} inputs: pass a 2D mask [{batch}, {past + n}] (1 = live slot)")
            allowed = pattern(attention_mask)
        elif attention_mask.is_floating_point():
            allowed = attention_mask == 0
        else:
            allowed = attention_mask.bool()
        return past_key_values, position_ids, self.additive_mask(allowed, dtype)

    @staticmethod
    def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """A boolean pattern [B, 1, n, S] as the additive mask eager and sdpa attention both read."""
        return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(
            ~allowed, torch.finfo(dtype).min)

    @staticmethod
    def causal(live: torch.Tensor, n: int) -> torch.Tensor:
        """Boolean [B, 1, n, S]: query i (slot S - n + i) sees live slots up to itself, and always itself."""
        total = live.shape[1]
        slot = torch.arange(total, device=live.device)
        query = (total - n + torch.arange(n, device=live.device))[:, None]  # [n, 1]
        allowed = (slot[None, :] <= query) & live[:, None, :].bool()  # [B, n, S]
        return (allowed | (slot[None, :] == query))[:, None]
