"""``specdec export``: a feature drafter written in the layouts the serving engines load for EAGLE-3 drafters.

Formats (``FORMATS``):

- ``eagle3``: the EAGLE-3 reference layout (SafeAILab's checkpoints): a Llama ``config.json`` with
  ``architectures: ["LlamaForCausalLMEagle3"]`` and weights ``fc``, ``midlayer.*``, ``norm``, ``lm_head`` and
  ``embed_tokens``. SGLang (``srt/models/llama_eagle3.py``) and vLLM (``model_executor/models/llama_eagle3.py``,
  registered under that architecture) load it; ``speculators convert`` converts it.
- ``speculators``: vLLM's ``speculators`` library layout (``speculators_model_type: "eagle3"``, a nested
  ``transformer_layer_config``, weights ``layers.0.*``), which vLLM reads through its speculators config.

What is checked before anything is written (one line each, exit 2): the drafter has the ``eagle3`` layout (specdec's
default ``proj`` layout computes another function: ``specdec.drafters.feature_model``); the target's layer is
Llama's as those engines build it (model type llama, no attention or MLP bias, SiLU); no feature is read at the
target's last layer (the engines capture the residual stream entering a layer, so the last layer's output, which
transformers gives after the final norm, is not one of theirs).

The maths is the same term by term (``tests/test_export.py`` recomputes the logits from the written tensors):
fused feature h = fc(concat of the three features); attention over concat(input_layernorm(embedding),
hidden_norm(h)), the embedding first; residual stream from h (``norm_before_residual`` false); post-attention norm
and MLP; logits = lm_head(norm(out)); the next step reads ``out`` before the final norm. Layer ids: vLLM's (and
``speculators``') ``eagle_aux_hidden_state_layer_ids`` index the residual stream entering a layer (specdec's layer
i + 1); SGLang's ``eagle_config.eagle_aux_hidden_state_layer_ids`` index layer outputs (specdec's i; SGLang adds 1).
The vocabulary is the target's whole (``draft_vocab_size`` = ``vocab_size``, no ``d2t``/``t2d``: both engines then
map draft ids to target ids one to one); ``lm_head`` and ``embed_tokens`` are the target's, copied from it.
"""

from __future__ import annotations

FORMATS = ("eagle3", "speculators")
DTYPES = ("fp32", "bf16", "fp16")
ARCHITECTURE = "LlamaForCausalLMEagle3"  # the EAGLE-3 reference config's architecture (vLLM and SGLang register it)
PREFIX = {"eagle3": "midlayer.", "speculators": "layers.0."}  # where each format keeps the decoder layer's weights
# the keys of a transformers config that say how it was saved or used, not what the layer computes
_NOISE = ("transformers_version", "architectures", "output_hidden_states", "return_dict", "dtype", "torch_dtype",
          "chunk_size_feed_forward", "is_encoder_decoder", "id2label", "label2id", "problem_type", "_name_or_path",
          "output_attentions", "use_cache", "layer_types", "_attn_implementation_autoset", "_commit_hash")


def register(subparsers) -> None:
    """Add ``specdec export`` (light: its help imports no torch)."""
    parser = subparsers.add_parser(
        "export",
        description="Write a feature drafter (`specdec train feature-drafter --layout eagle3`) in the layout vLLM, "
        "SGLang and vLLM's speculators library load for EAGLE-3 drafters, with the target's embedding and LM head "
        "copied in. Formats: eagle3 (EAGLE-3's reference layout: SGLang, vLLM), speculators (vLLM, speculators).",
    )
    parser.add_argument("drafter", metavar="DRAFTER", help="the feature drafter's folder (a run's final)")
    parser.add_argument("--format", required=True, metavar="FORMAT", help=f"one of {', '.join(FORMATS)}")
    parser.add_argument("--out", required=True, metavar="DIR", help="the folder to write (must not exist, or be empty)")
    parser.add_argument("--target", default=None, metavar="MODEL",
                        help="the drafter's target (default: the one its config names); its embedding and LM head "
                        "are copied in")
    parser.add_argument("--dtype", default="fp32", metavar="DTYPE",
                        help=f"the written weights' type: one of {', '.join(DTYPES)} (default fp32)")
    parser.set_defaults(func=_run)


def _run(args) -> int:
    written = export(args.drafter, args.format, args.out, args.target, args.dtype)
    print(f"wrote {args.out}: {written['tensors']} tensors ({written['bytes'] / 2**20:.1f} MiB, {args.dtype}) in the "
          f"{args.format} layout; the target's layers read: {written['layer_ids']}")
    return 0


def refusal(config, fmt: str) -> str | None:
    """Why a feature drafter of ``config`` cannot be written as ``fmt`` (one line), or None."""
    if fmt not in FORMATS:
        return f"unknown --format {fmt!r}: specdec export writes {', '.join(FORMATS)}"
    if config.layout != "eagle3":
        return (f"this feature drafter has the {config.layout} layout (a 2H -> H projection feeding the target's "
                "layer, whose residual starts from the projection), which EAGLE-3's layer cannot compute (its q/k/v "
                "read the 2H pair and its residual starts from the fused feature): train one with "
                "`specdec train feature-drafter --layout eagle3`")
    target = config.target_config or {}
    kind = target.get("model_type")
    if kind != "llama":
        return (f"{fmt} drafters are Llama layers in vLLM and SGLang; this drafter's layer is {kind}'s, which those "
                "loaders would build differently (bias, norms): export Llama-target drafters only")
    extras = [k for k in ("attention_bias", "mlp_bias") if target.get(k)]
    if extras or target.get("hidden_act", "silu") != "silu":
        what = ", ".join(extras) or f"hidden_act {target.get('hidden_act')}"
        return f"the target's layer has {what}; SGLang's EAGLE-3 layer has none (no bias, SiLU): it cannot be exported"
    last = target.get("num_hidden_layers", 0) - 1
    if last in config.feature_layers:
        return (f"the drafter reads the target's last layer ({last}), whose output transformers gives after the final "
                "norm and the engines do not capture: train one with --feature-layers below it")
    return None


def layer_ids(config) -> dict[str, list[int]]:
    """The feature layers in each engine's numbering: vLLM/speculators count the residual stream entering a layer
    (specdec's layer i is their i + 1); SGLang's ``eagle_config`` counts layer outputs (specdec's i)."""
    return {"vllm": [i + 1 for i in config.feature_layers], "sglang": list(config.feature_layers)}


def layer_config(config) -> dict:
    """The decoder layer's config as the loaders read it: the target's (one layer), for transformers 4 and 5 alike."""
    layer = {k: v for k, v in config.layer_config().to_dict().items() if k not in _NOISE}
    layer["num_hidden_layers"] = 1
    layer["tie_word_embeddings"] = False  # SGLang ties lm_head to embed_tokens when true: the head is written
    rope = dict(layer.get("rope_parameters") or {})
    if rope:  # transformers < 5 reads rope_theta and rope_scaling, not rope_parameters
        layer["rope_theta"] = rope.get("rope_theta", 10000.0)
        scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
        layer["rope_scaling"] = None if scaling.get("rope_type", "default") == "default" else scaling
    return layer


def configs(config, fmt: str, target: str, dtype: str, architectures: list[str] | None = None) -> dict:
    """The ``config.json`` of ``fmt`` for a feature drafter of ``config`` (checked by ``refusal``); ``target`` and
    its ``architectures``: the verifier the speculators layout names."""
    layer = layer_config(config)
    ids = layer_ids(config)
    torch_dtype = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[dtype]
    vocab = layer["vocab_size"]
    if fmt == "eagle3":
        return {**layer, "architectures": [ARCHITECTURE], "torch_dtype": torch_dtype, "draft_vocab_size": vocab,
                "norm_before_residual": False, "eagle_aux_hidden_state_layer_ids": ids["vllm"],
                "eagle_config": {"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": ids["sglang"]}}
    layer["torch_dtype"] = torch_dtype
    steps = config.ttt_steps or 3
    return {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "draft_vocab_size": vocab,
            "norm_before_residual": False, "norm_before_fc": False, "fc_norm": False, "norm_output": False,
            "embed_requires_grad": False, "target_hidden_size": None, "eagle_aux_hidden_state_layer_ids": ids["vllm"],
            "transformer_layer_config": layer,
            "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                   "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": steps,
                                                         "accept_tolerance": 0.0, "verifier_accept_k": 1}],
                                   "verifier": {"name_or_path": target,
                                                "architectures": architectures or ["LlamaForCausalLM"]}}}


def weights(drafter, fmt: str) -> dict:
    """The drafter's tensors under ``fmt``'s names, with the bound target's embedding and LM head; every tensor of
    the drafter is placed (a name with no place is refused: nothing is dropped silently)."""
    prefix = PREFIX[fmt]
    fixed = {"fuse.weight": "fc.weight", "embed_norm.weight": f"{prefix}input_layernorm.weight",
             "hidden_norm.weight": f"{prefix}hidden_norm.weight", "norm.weight": "norm.weight"}
    out = {}
    for key, tensor in drafter.state_dict().items():
        if key.startswith("rotary_emb."):
            continue  # buffers the loaders recompute from the config's rope settings
        name = fixed.get(key) or (prefix + key[len("layer."):] if key.startswith("layer.") else None)
        if name is None:
            raise ValueError(f"the drafter's tensor {key} has no place in the {fmt} layout: nothing written")
        out[name] = tensor
    embed, head = drafter.shared()
    if getattr(head, "bias", None) is not None:
        raise ValueError("the target's LM head has a bias, which EAGLE-3's lm_head has not: nothing written")
    out["embed_tokens.weight"] = embed.weight
    out["lm_head.weight"] = head.weight
    return out


def export(drafter_path: str, fmt: str, out: str, target: str | None = None, dtype: str = "fp32") -> dict:
    """Write the feature drafter at ``drafter_path`` to ``out`` as ``fmt`` (``config.json``, ``model.safetensors``);
    returns {tensors, bytes, layer_ids}. Bad input (an unknown format or dtype, a folder that is not a feature
    drafter, a layout or target the format cannot represent, a non-empty ``out``) is refused before writing."""
    import json
    from pathlib import Path

    import torch
    from safetensors.torch import save_file

    from specdec.drafters.feature_model import MODEL_TYPE, FeatureDrafterConfig, load_feature_drafter
    from specdec.loading import load_model, load_tokenizer

    if fmt not in FORMATS:
        raise ValueError(refusal(None, fmt))
    if dtype not in DTYPES:
        raise ValueError(f"unknown --dtype {dtype!r}: give one of {', '.join(DTYPES)}")
    folder, out_dir = Path(drafter_path), Path(out)
    saved = folder / "config.json"
    kind = json.loads(saved.read_text()).get("model_type") if saved.is_file() else None
    if kind != MODEL_TYPE:
        raise ValueError(f"{drafter_path} is not a feature drafter folder ({MODEL_TYPE}): give the folder "
                         "`specdec train feature-drafter` wrote (its OUT/final)")
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ValueError(f"{out} exists and is not an empty folder: nothing written")
    config = FeatureDrafterConfig.from_pretrained(folder)
    why = refusal(config, fmt)
    if why:
        raise ValueError(why)
    target = target or config.target_name
    if not target:
        raise ValueError(f"{drafter_path} does not name its target: give --target MODEL")
    model = load_model(target, device="cpu", dtype=torch.float32)
    try:
        from specdec.fingerprint import fingerprint

        print_ = fingerprint(model.config, load_tokenizer(target))
    except (OSError, ValueError):
        print_ = None  # no tokenizer beside the target: its shape is still checked
    drafter = load_feature_drafter(str(folder), model, print_, name=target)
    tensors = {k: v.detach().to({"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype])
               .contiguous().clone() for k, v in weights(drafter, fmt).items()}
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    written = configs(config, fmt, str(target), dtype, list(model.config.architectures or []) or None)
    (out_dir / "config.json").write_text(json.dumps(written, indent=2) + "\n")
    return {"tensors": len(tensors), "bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
            "layer_ids": layer_ids(config)}
