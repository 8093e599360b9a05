"""``specdec export`` (specdec/export.py): a feature drafter written in the EAGLE-3 layouts vLLM, SGLang and vLLM's
``speculators`` load.

The reference here is the loaders' code, transcribed (vLLM and SGLang do not install on this CPU machine;
``speculators`` pins transformers <= 5.19 and pulls its training stack, so it is no test dependency: run
``tests/speculators_check.py`` in a throwaway venv to read the export back with its own model):

- SGLang ``python/sglang/srt/models/llama_eagle3.py`` @ 03d5a7771f6082e7737a5f19cae7d1e863087013: ``LlamaModel``
  (``fc`` 3H -> H when the hidden input is not H wide; ``midlayer``: ``input_layernorm`` on the embedding,
  ``hidden_norm`` on h, ``cat([embeds, hidden])``, ``qkv_proj`` 2H wide, no bias; residual = h;
  ``post_attention_layernorm``, ``LlamaMLP``; ``norm``), ``LlamaForCausalLMEagle3`` (``lm_head`` of
  ``draft_vocab_size``; ``tie_word_embeddings`` ties it to ``embed_tokens``), ``load_weights`` (``model.`` prefixed
  where missing, q/k/v and gate/up stacked, ``d2t`` hot tokens);
- vLLM ``vllm/model_executor/models/llama_eagle3.py`` @ 00bd1493b3e82d6c13c68ee8a0e1c5a96707e190 (the same layer,
  ``norm_before_residual`` false by default, ``midlayer.`` renamed ``layers.0.``, ``embed_tokens`` optional, ``d2t``
  optional: identity when absent; ``hidden_prenorm`` fed back), ``vllm/transformers_utils/configs/speculators/``
  ``algos.py`` @ cfb173ab8e1b8e44dd35f8b5188255b6a03e13ec (``norm_before_residual`` defaults to TRUE when absent:
  the export writes it), ``base.py`` @ 94699746757f9d68e2f4bd89ad2c4b10ed962457 (the fields it requires);
- speculators ``src/speculators/models/eagle3/{config,core,model_definitions}.py`` @
  c05b95b303f7d4f21e8d7624e0ffa1c2d9b4d73b (``Eagle3SpeculatorConfig``'s fields, ``layers.0.*`` names).

The numerical check is independent of specdec's modules: ``_reference`` recomputes the drafter's logits from the
written ``config.json`` and tensors alone (RMSNorm, rotary, grouped-query attention, SiLU MLP written out here), with
the target's features read at the ids the config gives in vLLM's numbering, and must equal specdec's drafter over a
context and two further drafting steps fed back their own pre-norm hidden state."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from specdec import cli
from specdec.drafters.feature_model import features_of, load_feature_drafter, new_feature_drafter
from specdec.export import FORMATS

HIDDEN, VOCAB, LAYERS, HEADS, KV_HEADS, INTER = 64, 96, 6, 4, 2, 96


def _llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=LAYERS,
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, vocab_size=VOCAB,
                         max_position_embeddings=256, tie_word_embeddings=False, initializer_range=0.2,
                         rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 500.0},
                         pad_token_id=0, bos_token_id=0, eos_token_id=0)
    return LlamaForCausalLM(config).eval()


def _random(drafter):
    """Weights whose every part matters: larger matrices than the init's, norms far from 1 and unlike each other."""
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            p.copy_(torch.randn_like(p) * 0.2 if p.dim() == 2 else 0.5 + torch.rand_like(p) * 1.5)
    return drafter.eval()


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    target = _llama()
    target.save_pretrained(root / "target")
    drafters = {}
    for layout in ("eagle3", "proj"):
        drafter = _random(new_feature_drafter(target, name=str(root / "target"), seed=1, layout=layout))
        drafter.save_pretrained(root / f"drafter-{layout}")
        drafters[layout] = root / f"drafter-{layout}"
    last = _random(new_feature_drafter(target, [1, 3, LAYERS - 1], name=str(root / "target"), layout="eagle3"))
    last.save_pretrained(root / "last")
    torch.manual_seed(0)
    qwen = Qwen2ForCausalLM(Qwen2Config(hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=LAYERS,
                                        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, vocab_size=VOCAB))
    qwen.save_pretrained(root / "qwen")
    new_feature_drafter(qwen, name=str(root / "qwen"), layout="eagle3").save_pretrained(root / "qwen-drafter")
    written = {}
    for fmt in FORMATS:
        assert cli.main(["export", str(drafters["eagle3"]), "--format", fmt, "--out", str(root / f"as-{fmt}")]) == 0
        written[fmt] = root / f"as-{fmt}"
    return {"root": root, "target": target, "drafters": drafters, "written": written}


# ------------------------------------------------------------------------- the loaders' expectations, transcribed


def _expected(config: dict, fmt: str) -> dict[str, tuple[int, ...]]:
    """Every checkpoint tensor the loader consumes, with its shape, from the config as the loader reads it."""
    layer = config if fmt == "eagle3" else config["transformer_layer_config"]
    h, heads, kv = layer["hidden_size"], layer["num_attention_heads"], layer["num_key_value_heads"]
    hd = layer.get("head_dim") or h // heads
    vocab, draft_vocab = layer["vocab_size"], config["draft_vocab_size"] or layer["vocab_size"]
    target_h = config.get("target_hidden_size") or h
    prefix = "midlayer." if fmt == "eagle3" else "layers.0."
    return {"embed_tokens.weight": (vocab, h), "fc.weight": (h, 3 * target_h), "norm.weight": (h,),
            "lm_head.weight": (draft_vocab, h),
            prefix + "self_attn.q_proj.weight": (heads * hd, 2 * h),
            prefix + "self_attn.k_proj.weight": (kv * hd, 2 * h),
            prefix + "self_attn.v_proj.weight": (kv * hd, 2 * h), prefix + "self_attn.o_proj.weight": (h, heads * hd),
            prefix + "mlp.gate_proj.weight": (layer["intermediate_size"], h),
            prefix + "mlp.up_proj.weight": (layer["intermediate_size"], h),
            prefix + "mlp.down_proj.weight": (h, layer["intermediate_size"]),
            prefix + "input_layernorm.weight": (h,), prefix + "hidden_norm.weight": (h,),
            prefix + "post_attention_layernorm.weight": (h,)}


def test_the_eagle3_config_is_what_vllm_and_sglang_read(folders):
    config = json.loads((folders["written"]["eagle3"] / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]  # vLLM's registry and SGLang's EntryClass
    parsed = LlamaConfig(**config)  # how both read it (a llama config with extra fields)
    assert (parsed.num_hidden_layers, parsed.hidden_size, parsed.vocab_size) == (1, HIDDEN, VOCAB)
    assert parsed.tie_word_embeddings is False  # else SGLang would make lm_head the embedding
    assert parsed.rope_parameters["rope_theta"] == 500.0 and config["rope_theta"] == 500.0  # transformers 5 and 4
    assert parsed.rms_norm_eps == 1e-5 and config["rope_scaling"] is None
    assert config["draft_vocab_size"] == VOCAB and config["norm_before_residual"] is False
    assert not config.get("attention_bias") and not config.get("mlp_bias") and config["hidden_act"] == "silu"
    # feature layers [1, 3, 4] (0-based outputs): vLLM counts the residual stream entering a layer, SGLang adds 1
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert config["eagle_config"] == {"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": [1, 3, 4]}


def test_the_speculators_config_has_every_field_vllm_requires(folders):
    config = json.loads((folders["written"]["speculators"] / "config.json").read_text())
    # vLLM SpeculatorsConfig.validate_speculators_config: these must exist
    spec = config["speculators_config"]
    assert spec["proposal_methods"][0]["speculative_tokens"] >= 1 and spec["verifier"]["name_or_path"]
    assert spec["verifier"]["architectures"] == ["LlamaForCausalLM"]  # the target's own
    assert config["speculators_model_type"] == "eagle3" and spec["algorithm"] == "eagle3"
    assert spec["default_proposal_method"] == spec["proposal_methods"][0]["proposal_type"] == "greedy"
    assert isinstance(config["transformer_layer_config"], dict)
    assert config["norm_before_residual"] is False  # vLLM's update_eagle3 would default it to True
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5] and config["draft_vocab_size"] == VOCAB
    assert not (config["norm_before_fc"] or config["fc_norm"] or config["norm_output"])  # none of those norms here
    layer = LlamaConfig(**config["transformer_layer_config"])  # Eagle3SpeculatorConfig's validator does this
    assert layer.model_type == "llama" and layer.num_hidden_layers == 1 and layer.vocab_size == VOCAB


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_tensor_is_one_the_loader_consumes_with_its_shape(folders, fmt):
    config = json.loads((folders["written"][fmt] / "config.json").read_text())
    tensors = load_file(str(folders["written"][fmt] / "model.safetensors"))
    expected = _expected(config, fmt)
    assert sorted(tensors) == sorted(expected)  # none missing, none left over (no d2t/t2d: the full vocabulary)
    assert {k: tuple(v.shape) for k, v in tensors.items()} == expected
    target = folders["target"]
    assert torch.equal(tensors["embed_tokens.weight"], target.get_input_embeddings().weight)
    assert torch.equal(tensors["lm_head.weight"], target.get_output_embeddings().weight)


def test_the_two_formats_hold_the_same_tensors_and_dtype_converts(folders, tmp_path):
    a = load_file(str(folders["written"]["eagle3"] / "model.safetensors"))
    b = load_file(str(folders["written"]["speculators"] / "model.safetensors"))
    assert sorted(k.replace("midlayer.", "layers.0.") for k in a) == sorted(b)
    assert all(torch.equal(v, b[k.replace("midlayer.", "layers.0.")]) for k, v in a.items())
    assert cli.main(["export", str(folders["drafters"]["eagle3"]), "--format", "eagle3", "--out", str(tmp_path / "b"),
                     "--dtype", "bf16", "--target", str(folders["root"] / "target")]) == 0
    half = load_file(str(tmp_path / "b" / "model.safetensors"))
    assert all(v.dtype == torch.bfloat16 and torch.equal(v, a[k].bfloat16()) for k, v in half.items())
    assert json.loads((tmp_path / "b" / "config.json").read_text())["torch_dtype"] == "bfloat16"


# ------------------------------------------------------------------ the numbers: a reference from the written files


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rotate(x, positions, theta):
    """Rotary embedding (Llama's, vLLM's neox style): pairs (i, i + d/2) rotated by position * theta^(-2i/d)."""
    d = x.shape[-1]
    angle = positions[:, None].double() * theta ** (-torch.arange(0, d, 2).double() / d)[None, :]  # [n, d/2]
    cos, sin = torch.cat([angle.cos()] * 2, -1).float()[:, None], torch.cat([angle.sin()] * 2, -1).float()[:, None]
    half = torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1)
    return x * cos + half * sin


class _Reference:
    """EAGLE-3's drafter as SGLang's and vLLM's ``llama_eagle3.py`` compute it, from the written folder alone."""

    def __init__(self, folder):
        self.c = json.loads((folder / "config.json").read_text())
        self.w = load_file(str(folder / "model.safetensors"))
        self.keys, self.values = [], []  # per slot: [KV, hd] each, with the rotary applied

    def fc(self, aux):  # the target's three features [n, 3H] -> h [n, H]
        return aux @ self.w["fc.weight"].T

    def step(self, ids, h, positions):
        """New slots (token ids [n], hidden h [n, H], positions [n]) attending to every earlier slot and causally
        among themselves: (logits [n, V], pre-norm hidden [n, H])."""
        c, w, p = self.c, self.w, "midlayer."
        eps, heads, kv = c["rms_norm_eps"], c["num_attention_heads"], c["num_key_value_heads"]
        hd = c.get("head_dim") or c["hidden_size"] // heads
        embeds = _rms(w["embed_tokens.weight"][ids], w[p + "input_layernorm.weight"], eps)
        x = torch.cat([embeds, _rms(h, w[p + "hidden_norm.weight"], eps)], -1)  # the embedding first
        q = _rotate((x @ w[p + "self_attn.q_proj.weight"].T).view(-1, heads, hd), positions, c["rope_theta"])
        k = _rotate((x @ w[p + "self_attn.k_proj.weight"].T).view(-1, kv, hd), positions, c["rope_theta"])
        v = (x @ w[p + "self_attn.v_proj.weight"].T).view(-1, kv, hd)
        past = len(self.keys)
        self.keys += list(k)
        self.values += list(v)
        keys, values = torch.stack(self.keys), torch.stack(self.values)  # [S, KV, hd]
        out = torch.empty(len(ids), heads, hd)
        for i in range(len(ids)):
            for head in range(heads):
                g = head // (heads // kv)
                seen = past + i + 1  # earlier slots and the new ones up to itself
                scores = keys[:seen, g] @ q[i, head] / math.sqrt(hd)
                out[i, head] = torch.softmax(scores, 0) @ values[:seen, g]
        a = h + out.reshape(len(ids), -1) @ w[p + "self_attn.o_proj.weight"].T  # residual: h itself
        m = _rms(a, w[p + "post_attention_layernorm.weight"], eps)
        pre = a + (torch.nn.functional.silu(m @ w[p + "mlp.gate_proj.weight"].T) * (m @ w[p + "mlp.up_proj.weight"].T)
                   ) @ w[p + "mlp.down_proj.weight"].T
        return _rms(pre, w["norm.weight"], eps) @ w["lm_head.weight"].T, pre


def test_the_written_files_compute_the_drafters_logits(folders):
    target = folders["target"]
    ref = _Reference(folders["written"]["eagle3"])
    drafter = load_feature_drafter(str(folders["drafters"]["eagle3"]), target).eval()
    torch.manual_seed(5)
    ids = torch.randint(1, VOCAB, (1, 10))
    n = 8  # context slots 0..7: slot t reads the target's state at t and the embedding of x_{t+1}
    with torch.no_grad():
        states = target(input_ids=ids, output_hidden_states=True).hidden_states
        aux = torch.cat([states[i][0] for i in ref.c["eagle_aux_hidden_state_layer_ids"]], -1)  # vLLM's numbering
        want, pre = ref.step(ids[0, 1: n + 1], ref.fc(aux[:n]), torch.arange(n))
        cache = DynamicCache()
        own = features_of(states, drafter.config.feature_layers)[:, :n]  # specdec's own reading of the target
        got = drafter(ids[:, 1: n + 1], drafter.fuse_features(own), past_key_values=cache, use_cache=True)
        assert torch.allclose(got.logits[0], want, atol=1e-4), (got.logits[0] - want).abs().max()
        assert want.std() > 1.0  # logits that could tell a wrong tensor from the right one
        hidden, ref_hidden = got.hidden[:, -1:], pre[-1:]
        for k, token in enumerate((int(want[-1].argmax()), 7)):  # two more drafting steps, own hidden fed back
            want, ref_hidden = ref.step(torch.tensor([token]), ref_hidden, torch.tensor([n + k]))
            got = drafter(torch.tensor([[token]]), hidden, past_key_values=cache, use_cache=True,
                          position_ids=torch.tensor([[n + k]]))
            assert torch.allclose(got.logits[0], want, atol=1e-4), (k, (got.logits[0] - want).abs().max())
            hidden = got.hidden


def _context_gap(folder, drafter, target) -> float:
    """Largest difference between the reference's logits from ``folder`` and the drafter's over a context."""
    ref = _Reference(folder)
    ids = torch.randint(1, VOCAB, (1, 9), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        states = target(input_ids=ids, output_hidden_states=True).hidden_states
        aux = torch.cat([states[i][0] for i in ref.c["eagle_aux_hidden_state_layer_ids"]], -1)
        want, _ = ref.step(ids[0, 1:], ref.fc(aux[:8]), torch.arange(8))
        own = features_of(states, drafter.config.feature_layers)[:, :8]  # specdec's own reading of the target
        return float((drafter(ids[:, 1:], drafter.fuse_features(own)).logits[0] - want).abs().max())


@pytest.mark.parametrize("wrong", ["hidden first", "norms swapped", "ids of layer outputs"])
def test_the_check_tells_a_wrong_export_apart(folders, tmp_path, wrong):
    """The reference has teeth: the pair concatenated the other way, the two input norms swapped, or the feature
    layers numbered as outputs (SGLang's numbering in vLLM's field) give other logits."""
    from safetensors.torch import save_file

    target, written = folders["target"], folders["written"]["eagle3"]
    drafter = load_feature_drafter(str(folders["drafters"]["eagle3"]), target).eval()
    assert _context_gap(written, drafter, target) < 1e-4
    tensors, config = load_file(str(written / "model.safetensors")), json.loads((written / "config.json").read_text())
    if wrong == "hidden first":
        for name in ("q_proj", "k_proj", "v_proj"):
            w = tensors[f"midlayer.self_attn.{name}.weight"]
            tensors[f"midlayer.self_attn.{name}.weight"] = torch.cat([w[:, HIDDEN:], w[:, :HIDDEN]], 1)
    elif wrong == "norms swapped":
        a, b = "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight"
        tensors[a], tensors[b] = tensors[b], tensors[a]
    else:
        config["eagle_aux_hidden_state_layer_ids"] = config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    (tmp_path / "w").mkdir()
    save_file(tensors, str(tmp_path / "w" / "model.safetensors"))
    (tmp_path / "w" / "config.json").write_text(json.dumps(config))
    assert _context_gap(tmp_path / "w", drafter, target) > 0.1


def test_the_proj_layouts_extra_tensor_is_refused_not_dropped(folders):
    from specdec.export import weights

    drafter = load_feature_drafter(str(folders["drafters"]["proj"]), folders["target"])
    with pytest.raises(ValueError, match="proj.weight has no place"):
        weights(drafter, "eagle3")


# ----------------------------------------------------------------------------------------------- bad input


def _refused(argv, capsys, needle, out):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and "\n" not in err, err
    assert not out.exists()  # nothing written


def test_bad_input_is_one_line_and_writes_nothing(folders, capsys, tmp_path):
    root, out = folders["root"], tmp_path / "out"
    drafter = str(folders["drafters"]["eagle3"])
    _refused(["export", drafter, "--format", "medusa", "--out", str(out)], capsys, "eagle3, speculators", out)
    _refused(["export", str(folders["drafters"]["proj"]), "--format", "eagle3", "--out", str(out)], capsys,
             "--layout eagle3", out)
    _refused(["export", str(root / "last"), "--format", "eagle3", "--out", str(out)], capsys, "last layer", out)
    _refused(["export", str(root / "qwen-drafter"), "--format", "eagle3", "--out", str(out)], capsys, "qwen2", out)
    _refused(["export", str(root / "target"), "--format", "eagle3", "--out", str(out)], capsys,
             "not a feature drafter", out)
    _refused(["export", drafter, "--format", "eagle3", "--out", str(out), "--dtype", "int8"], capsys, "bf16", out)
    _refused(["export", drafter, "--format", "eagle3", "--out", str(out), "--target", str(root / "qwen")], capsys,
             "not for", out)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    assert cli.main(["export", drafter, "--format", "eagle3", "--out", str(tmp_path / "full")]) == 2
    assert "not an empty folder" in capsys.readouterr().err
