"""``specdec export --format speculators`` read back by vLLM's ``speculators`` library itself (not collected by pytest:
speculators pins transformers <= 5.19 and pulls its training stack, so it is not a test dependency).

Run it with a Python where speculators is importable beside specdec, e.g. a throwaway venv over the system packages:

    python -m venv --system-site-packages /tmp/specvenv
    /tmp/specvenv/bin/pip install --no-deps speculators && /tmp/specvenv/bin/pip install datasets loguru httpx \
        aiohttp hs-connectors          # speculators' import-time needs; torch and transformers stay as installed
    PYTHONPATH=$PWD:$PWD/tests OMP_NUM_THREADS=1 /tmp/specvenv/bin/python tests/speculators_check.py

It exports a tiny random eagle3-layout feature drafter of a tiny Llama (``tests/test_export.py``'s), loads the folder
with ``Eagle3DraftModel.from_pretrained`` (the target's embedding through its ``load_verifier_weights``), runs
speculators' own first layer (``LlamaDecoderEagle3FirstLayer``), rotary, ``fc``, ``norm`` and ``lm_head`` over a context
and one further drafting step, and prints the largest logit difference from specdec's drafter and the tensors each
side has that the other has not. Exit status 1 when they differ by more than 1e-4 or a written tensor is unused."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file
from speculators.models.eagle3 import Eagle3DraftModel
from test_export import VOCAB, _llama, _random
from transformers import DynamicCache

from specdec.drafters.feature_model import features_of, load_feature_drafter, new_feature_drafter
from specdec.export import export


def main() -> int:
    root = Path(tempfile.mkdtemp())
    target = _llama()
    target.save_pretrained(root / "target")
    _random(new_feature_drafter(target, name=str(root / "target"), seed=1, layout="eagle3")).save_pretrained(
        root / "drafter")
    export(str(root / "drafter"), "speculators", str(root / "out"))
    ours = load_feature_drafter(str(root / "drafter"), target).eval()
    theirs = Eagle3DraftModel.from_pretrained(str(root / "out")).float().eval()
    theirs.load_verifier_weights()
    for layer in theirs.layers:
        layer.self_attn.config._attn_implementation = "eager"  # theirs defaults to flex attention with block masks
    ids, n = torch.randint(1, VOCAB, (1, 10), generator=torch.Generator().manual_seed(5)), 8
    with torch.no_grad():
        states = target(input_ids=ids, output_hidden_states=True).hidden_states
        cache = DynamicCache()
        want = ours(ids[:, 1: n + 1], ours.fuse_features(features_of(states, ours.config.feature_layers)[:, :n]),
                    past_key_values=cache, use_cache=True)
        token = int(want.logits[0, -1].argmax())
        want2 = ours(torch.tensor([[token]]), want.hidden[:, -1:], past_key_values=cache, use_cache=True,
                     position_ids=torch.tensor([[n]]))
        # theirs: the features at the ids its config gives (vLLM's numbering), its own modules and their order
        aux = torch.cat([states[i] for i in theirs.config.eagle_aux_hidden_state_layer_ids], -1)[:, :n]
        cache = DynamicCache()
        x = torch.cat([theirs.embed_tokens(ids[:, 1: n + 1]), theirs.fc(aux)], -1)
        pos = torch.arange(n)[None]
        out = theirs.layers[0](x, attention_mask=torch.full((n, n), float("-inf")).triu(1)[None, None],
                               position_ids=pos, past_key_values=cache, position_embeddings=theirs.rotary_emb(x, pos),
                               use_cache=True)
        got = theirs.lm_head(theirs.norm(out))
        x = torch.cat([theirs.embed_tokens(torch.tensor([[token]])), out[:, -1:]], -1)
        pos = torch.tensor([[n]])
        out = theirs.layers[0](x, attention_mask=torch.zeros(1, 1, 1, n + 1), position_ids=pos,
                               past_key_values=cache, position_embeddings=theirs.rotary_emb(x, pos), use_cache=True)
        got2 = theirs.lm_head(theirs.norm(out))
    gaps = [float((got - want.logits).abs().max()), float((got2 - want2.logits).abs().max())]
    written, held = set(load_file(str(root / "out" / "model.safetensors"))), set(theirs.state_dict())
    print(f"speculators read layers {theirs.config.eagle_aux_hidden_state_layer_ids}, norm_before_residual "
          f"{theirs.config.norm_before_residual}; largest logit difference: context {gaps[0]:.2e}, next step "
          f"{gaps[1]:.2e} (logits' std {float(got.std()):.2f})")
    print(f"written, unused by speculators: {sorted(written - held)}; speculators', not written: "
          f"{sorted(held - written)} (it ignores missing {sorted(theirs._keys_to_ignore_on_load_missing)})")
    return 0 if max(gaps) < 1e-4 and not written - held else 1


if __name__ == "__main__":
    sys.exit(main())
