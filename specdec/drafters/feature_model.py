"""An EAGLE-3-style feature drafter as a transformers model: one decoder layer that reads the target's features.

Follows EAGLE-3 (Li et al. 2025): the drafter reads the hidden states of three of the target's layers (a low,
a middle and a high one, ``config.feature_layers``), fused by a linear map (3H -> H), together with the
embedding of the next token, and predicts the target's next distribution through the target's own LM head.

Alignment (slot ``t`` of a sequence x_0 .. x_{T-1}): the drafter's input at slot t is the target's fused
feature f_t (the target's state at position t, the one whose logits gave x_{t+1}) and the embedding of
x_{t+1}; its output at slot t, at position id t, predicts the target's distribution at position t + 1
(over x_{t+2}). A drafting step after the first reads the drafter's own output hidden state instead of f_t
(EAGLE-3 at inference), which training-time test trains for (``specdec.train.feature_drafter``).

Parameters (the drafter's own, all saved): ``fuse`` Linear(3H -> H) on the concatenated target features;
``embed_norm``, ``hidden_norm`` and ``proj`` Linear(2H -> H) on concat(norm(embedding), norm(hidden)); one decoder
``layer`` of the target's own class; a final ``norm`` (all but the layer: ``specdec.drafters.context_model``, shared
with the parallel drafter). The token embedding and the LM head are the target's, frozen and shared: not saved in
the drafter's folder, bound at load (``bind``), so the folder is small and a drafter given another target is refused
(``target_mismatch``: hidden size, layer count, vocabulary, architecture, and the target's fingerprint where the
caller knows it).

Why one layer of the target's class: the drafter's inputs are the target's own features, so the
target's layer already speaks their language, and every engine that runs the target runs this layer.
Layouts (``config.layout``): ``proj`` (default) projects the pair 2H -> H into an unchanged layer of the target's
class (residual from the projection); ``eagle3`` is EAGLE-3's layer as vLLM and SGLang run it (q/k/v read the 2H
pair, residual from the fused feature h, ``embed_norm`` its input norm): the one ``specdec.export`` can write.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, DynamicCache, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import ModelOutput

from specdec.compat import LAYER_KEYWORD
from specdec.drafters.context_model import ContextSlotsModel

MODEL_TYPE = "specdec-feature-drafter"
LAYOUTS = ("proj", "eagle3")  # how the (embedding, feature) pair enters the layer: see the module docstring
# config keys that say how the target was saved or loaded, not what it computes (as specdec.train.outputs)
_VOLATILE = ("transformers_version", "_name_or_path", "dtype", "torch_dtype", "_commit_hash",
             "_attn_implementation_autoset", "use_cache", "architectures")


def default_feature_layers(layers: int) -> list[int]:
    """EAGLE-3's choice of a low, a middle and a high layer (0-based decoder layers whose outputs are read):
    layer 1, the middle one and the last but one (the first three where the target has fewer than 5)."""
    if layers < 3:
        raise ValueError(f"a feature drafter reads three layers of the target, which has {layers}")
    if layers < 5:
        return [0, 1, 2]
    return [1, layers // 2, layers - 2]


class FeatureDrafterConfig(PretrainedConfig):
    """The feature drafter's config: the target's config (to build its layer and to recognise the target) and
    which of its layers are read."""

    model_type = MODEL_TYPE

    target_config: dict | None = None  # the target's config (less how it was saved); builds the drafter's layer
    feature_layers: list[int] | None = None  # 0-based decoder layers of the target whose outputs are read
    target_fingerprint: str = ""  # specdec.fingerprint.fingerprint of the target (config + tokenizer); "" = unknown
    target_name: str = ""  # the target as the trainer was given it (for messages)
    ttt_steps: int = 0  # drafting depth trained by training-time test (0 = unknown)
    layout: str = "proj"  # LAYOUTS: "proj" (2H -> H projection, then the target's layer) or "eagle3" (EAGLE-3's)

    @classmethod
    def for_target(cls, target_config: PretrainedConfig, feature_layers: list[int] | None = None,
                   target_fingerprint: str = "", target_name: str = "", **kwargs) -> FeatureDrafterConfig:
        """The config of a feature drafter for a target of ``target_config``."""
        saved = {k: v for k, v in target_config.to_dict().items() if k not in _VOLATILE}
        layers = list(feature_layers or default_feature_layers(target_config.num_hidden_layers))
        return cls(target_config=saved, feature_layers=layers, target_fingerprint=target_fingerprint,
                   target_name=target_name, vocab_size=target_config.vocab_size,
                   hidden_size=target_config.hidden_size, **kwargs)

    def validate_architecture(self) -> None:
        super().validate_architecture()
        if self.target_config is None:
            return  # a bare config (AutoConfig's registry builds one): nothing to check yet
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {self.layout!r}")
        n = self.target_config.get("num_hidden_layers")
        layers = self.feature_layers or []
        if len(layers) != 3 or len(set(layers)) != 3 or not all(0 <= i < (n or 0) for i in layers):
            raise ValueError(f"feature_layers must be 3 distinct decoder layers of the target (0..{(n or 1) - 1}), "
                             f"got {layers}")

    def layer_config(self) -> PretrainedConfig:
        """The target's config with one decoder layer: what the drafter's layer and rotary embedding are built from."""
        if self.target_config is None:
            raise ValueError("this feature drafter config has no target_config: build it with "
                             "FeatureDrafterConfig.for_target(target.config)")
        cfg = dict(self.target_config)
        model_type = cfg.pop("model_type")
        config = AutoConfig.for_model(model_type, **cfg)
        config.num_hidden_layers = 1
        if isinstance(getattr(config, "layer_types", None), list):
            config.layer_types = config.layer_types[:1]
        config._attn_implementation = self._attn_implementation or "sdpa"
        return config


def target_mismatch(config: FeatureDrafterConfig, target_config: PretrainedConfig, fingerprint: str | None = None,
                    drafter: str = "the feature drafter", target: str = "this target") -> str | None:
    """Why a drafter of ``config`` cannot draft for a target of ``target_config`` (one line naming both), or None.
    ``fingerprint``: the target's ``specdec.fingerprint.fingerprint``, compared where both are known."""
    return FeatureDrafterModel.mismatch(config, target_config, fingerprint, drafter, target)


def features_of(hidden_states: tuple[torch.Tensor, ...], layers: list[int]) -> torch.Tensor:
    """The concatenated outputs of decoder ``layers`` from a transformers ``output_hidden_states`` tuple (entry 0 is
    the embeddings, entry i + 1 layer i's output; transformers 5 puts the final norm's output in the last entry, so
    the last layer is read after the norm). [B, T, 3H]"""
    return torch.cat([hidden_states[i + 1] for i in layers], dim=-1)


_EAGLE3_PARTS = {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}


def widen_for_eagle3(layer: nn.Module, width: int) -> None:
    """Make ``layer`` EAGLE-3's first layer: q/k/v read 2 * ``width`` inputs (concat(embedding, feature)) and the
    input norm goes (the drafter's ``embed_norm`` is it). Refused, one line, for a layer that is not Llama-shaped
    (pre-norm attention and MLP, nothing else: e.g. Gemma's extra norms would have no place in EAGLE-3's layer)."""
    parts = {name for name, _ in layer.named_children()}
    attn = getattr(layer, "self_attn", None)
    if parts != _EAGLE3_PARTS or not all(isinstance(getattr(attn, k, None), nn.Linear) for k in ("q_proj", "k_proj",
                                                                                                 "v_proj")):
        raise ValueError(f"the eagle3 layout needs a Llama-style decoder layer ({', '.join(sorted(_EAGLE3_PARTS))} "
                         f"with q_proj/k_proj/v_proj); {type(layer).__name__} has {', '.join(sorted(parts))}: "
                         "use --layout proj")
    for name in ("q_proj", "k_proj", "v_proj"):
        old = getattr(attn, name)
        setattr(attn, name, nn.Linear(2 * width, old.out_features, bias=old.bias is not None))
    layer.input_layernorm = nn.Identity()


@dataclass
class FeatureDrafterOutput(ModelOutput):
    """What the feature drafter returns."""

    logits: torch.Tensor | None = None  # [B, n, V] (None where not asked)
    hidden: torch.Tensor | None = None  # [B, n, H] the layer's output, fed to the next drafting step
    past_key_values: DynamicCache | None = None  # the cache, with the inputs' slots appended (when use_cache)


class FeatureDrafterModel(ContextSlotsModel):
    """One decoder layer of the target's class over the target's features (see the module docstring); the context
    slots, the target's embedding and head are ``ContextSlotsModel``'s."""

    config: FeatureDrafterConfig
    config_class = FeatureDrafterConfig
    noun = "feature drafter"
    command = "feature-drafter"
    verb = "trained"

    def build(self, layer_class: type, layer_config: PretrainedConfig) -> None:
        self.layer = layer_class(layer_config, layer_idx=0)
        if self.config.layout == "eagle3":
            widen_for_eagle3(self.layer, layer_config.hidden_size)

    # ------------------------------------------------------------------------------------ forward

    def forward(self, input_ids: torch.LongTensor, hidden: torch.Tensor, position_ids: torch.LongTensor | None = None,
                attention_mask: torch.Tensor | None = None, past_key_values: DynamicCache | None = None,
                use_cache: bool = False, logits: bool = True, logits_to_keep: int = 0,
                **kwargs: object) -> FeatureDrafterOutput:
        """One drafting step over ``n`` slots. ``logits=False`` skips the head; ``logits_to_keep`` > 0: the logits of
        the last that many slots only.

        The forward contract::

            out = model(input_ids [B, n], hidden [B, n, H], position_ids [B, n] | None,
                        attention_mask=None | [B, past + n] (1 = live slot)
                                       | [B, 1, n, past + n] bool (True = may attend)
                                       | [B, 1, n, past + n] float (additive: 0 = may attend),
                        past_key_values=None | Cache, use_cache=False)
            out.logits  # [B, n, V] the target's vocabulary
            out.hidden  # [B, n, H] the layer's output (before the final norm): the hidden state of the next step

        A 2D mask is causal over the cache's slots and the inputs (dead slots anywhere, each query sees itself); a
        4D mask is taken as given (training-time test's, a token tree's). The cache is a transformers ``Cache`` (one
        layer).
        """
        batch, n = input_ids.shape
        embed = self.shared()[0]
        dtype = self.compute_dtype
        h = hidden.to(dtype)
        x = torch.cat([self.embed_norm(embed(input_ids).to(dtype)), self.hidden_norm(h)], dim=-1)  # [B, n, 2H]
        if self.config.layout == "proj":
            x = h = self.proj(x)  # [B, n, H]: the layer's input and residual stream
        past_key_values, position_ids, mask = self.step_inputs(
            batch, n, x.dtype, x.device, position_ids, attention_mask, past_key_values, use_cache,
            lambda live: self.causal(live, n))
        layer_kwargs = dict(attention_mask=mask, position_ids=position_ids, use_cache=use_cache,
                            position_embeddings=self.rotary_emb(h, position_ids=position_ids),
                            **{LAYER_KEYWORD: past_key_values})
        if self.config.layout == "proj":
            out = self.layer(x, **layer_kwargs)
            out = out[0] if isinstance(out, tuple) else out
        else:  # EAGLE-3's first layer: attention reads the 2H pair, the residual stream starts from the feature h
            attn = self.layer.self_attn(hidden_states=x, **layer_kwargs)
            out = h + (attn[0] if isinstance(attn, tuple) else attn)
            out = out + self.layer.mlp(self.layer.post_attention_layernorm(out))
        kept = out[:, -logits_to_keep:] if logits_to_keep else out
        return FeatureDrafterOutput(logits=self.head(kept) if logits else None, hidden=out,
                                    past_key_values=past_key_values if use_cache else None)


def is_feature_drafter(model: object) -> bool:
    """Whether ``model`` is a feature drafter (by its config's model type)."""
    return getattr(getattr(model, "config", None), "model_type", None) == MODEL_TYPE


def new_feature_drafter(target: PreTrainedModel, feature_layers: list[int] | None = None, fingerprint: str = "",
                        name: str = "", seed: int = 0, layout: str = "proj") -> FeatureDrafterModel:
    """A fresh feature drafter for ``target`` (float32, bound to it), its weights drawn from ``seed``."""
    config = FeatureDrafterConfig.for_target(target.config, feature_layers, fingerprint, name, layout=layout)
    torch.manual_seed(seed)
    drafter = FeatureDrafterModel(copy.deepcopy(config)).float()
    return drafter.bind(target, fingerprint or None, name or "the target")


def load_feature_drafter(path: str, target: PreTrainedModel, fingerprint: str | None = None,
                         name: str = "this target", dtype: torch.dtype | None = None) -> FeatureDrafterModel:
    """The feature drafter saved in ``path``, bound to ``target`` (refused, one line, when made for another)."""
    return FeatureDrafterModel.load(path, target, fingerprint, name, dtype, hint=" (its OUT/final)")


AutoConfig.register(MODEL_TYPE, FeatureDrafterConfig)
AutoModel.register(FeatureDrafterConfig, FeatureDrafterModel)
# so that `load_model` (AutoModelForCausalLM) loads a feature drafter folder too (`--drafter PATH`); it drafts only once
# bound to its target (``FeatureDrafter.align``)
AutoModelForCausalLM.register(FeatureDrafterConfig, FeatureDrafterModel)
