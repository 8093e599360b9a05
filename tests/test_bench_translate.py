"""The translation benchmark (issue 19) on a tiny Marian pair written by the test.

Every method's greedy output must equal plain decoding's and transformers' own ``generate``; plain
decoding runs one round per token; the sample of the split is seeded and uniform; a folder that is
not a model is refused with exit 2.
"""

from __future__ import annotations

import copy
import importlib
import importlib.util
import json
import logging

import pytest
import torch
from tiny_models import save_tiny_pair, toy_corpus, train_texts
from transformers import AutoTokenizer, MarianConfig, MarianMTModel

from specdec.bench.translate import (
    TranslateBenchConfig,
    check_translate_peers,
    main,
    run_bench,
    sample_pairs,
    table,
)
from specdec.cli import main as cli_main
from specdec.data.seq2seq_tokenizer import train_seq2seq_tokenizer

WORDS = {"open": "öffnen", "file": "Datei", "the": "die", "cannot": "kann nicht", "save": "speichern",
         "%s": "%s", "42": "42", "error": "Fehler"}

EOS_BIAS = 4.8


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench-translate")
    data = toy_corpus(WORDS, {"train": 40, "validation": 8, "test": 30}, 6, root / "data")
    tokenizer = train_seq2seq_tokenizer(train_texts(data), vocab_size=300)
    torch.manual_seed(0)
    config = MarianConfig(vocab_size=len(tokenizer), d_model=32, encoder_layers=2, decoder_layers=2,
                          encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                          decoder_ffn_dim=64, max_position_embeddings=64, pad_token_id=0, eos_token_id=1,
                          decoder_start_token_id=0, forced_eos_token_id=None, init_std=0.3)
    target = MarianMTModel(config).eval()
    with torch.no_grad():  # a weak last decoder layer: the target without it agrees with it often, not always
        for name, param in target.model.decoder.layers[-1].named_parameters():
            if name.endswith(("out_proj.weight", "fc2.weight")):
                param.mul_(0.2)
        target.final_logits_bias[0, 1] = EOS_BIAS  # some sources end before max_new_tokens, some do not
    drafter = copy.deepcopy(target)
    drafter.model.decoder.layers = drafter.model.decoder.layers[:1]
    drafter.config.decoder_layers = 1
    block = copy.deepcopy(drafter)
    block.config.block_drafter = {"mask_token_id": 2, "max_block_size": 8}
    for name, model in (("target", target), ("drafter", drafter), ("block", block)):
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    return root, data


def test_every_method_equals_plain_greedy_and_generate(pair):
    root, data = pair
    config = TranslateBenchConfig(target=str(root / "target"), data=str(data), drafter=str(root / "drafter"),
                                  block_drafter=str(root / "block"), limit=12, max_new_tokens=10, repeats=2,
                                  memory_batches=(1, 4), memory_sources=4)
    report = run_bench(config, log=lambda s: None)
    methods = {m["name"]: m for m in report["methods"]}
    assert set(methods) == {"plain", "ngram", "model", "lookup+model", "block", "block β5τ3", "lookup+block", "hf",
                            "hf beam5", "hf assisted"}
    assert report["sources"] == 12
    tokens = methods["plain"]["tokens"]
    assert tokens > 12
    inexact = {"hf beam5", "block β5τ3"}
    assert {name for name, m in methods.items() if not m["exact"]} == inexact
    for m in methods.values():
        assert 0 <= m["bleu"] <= 100 and 0 <= m["chrf"] <= 100
        if m["name"] in inexact:
            continue
        assert m["differ"] == 0, m["name"]
        assert m["tokens"] == tokens and len(m["seconds"]) == 2
        assert m["bleu"] == report["bleu"]
    assert methods["block"]["drafted"] <= 4 * methods["block"]["rounds"]  # one block of at most gamma per round
    assert methods["block β5τ3"]["rounds"] <= methods["block"]["rounds"]  # the relaxed rule keeps at least as much
    assert [(r["batch"], r["method"]) for r in report["memory"]] == [(1, "model"), (1, "block"), (4, "model"),
                                                                       (4, "block")]
    for r in report["memory"]:
        assert r["drafter_weights_mib"] > 0
        assert r["extra_mib"] == pytest.approx(r["growth_mib"] + r["drafter_weights_mib"] - r["plain_growth_mib"],
                                               abs=0.11)
    assert methods["plain"]["rounds"] == tokens  # one target forward per token
    assert 0 < methods["model"]["accepted"] < methods["model"]["drafted"]  # the drafter was heard, not always right
    assert methods["model"]["rounds"] < tokens
    assert 0 <= report["bleu"] <= 100 and 0 <= report["chrf"] <= 100
    assert table(report).count("\n") == 2 + len(methods) - 1 + 3 + len(report["memory"])
    assert 0 < report["uncapped_sources"] == report["sources"] - methods["plain"]["at_cap"] < report["sources"]
    uncapped = [m["uncapped"] for m in methods.values()]
    assert len({u["tokens"] for u in uncapped}) == 1 and uncapped[0]["tokens"] < tokens
    for m in methods.values():  # the sources' own times add up to the call's
        if m["name"] in inexact:
            continue
        for total, rows in zip(m["seconds"], m["row_seconds"]):
            assert all(t > 0 for t in rows) and 0.8 * total < sum(rows) <= total


def test_the_sample_is_seeded_uniform_and_keeps_file_order(pair):
    _root, data = pair
    rows = [json.loads(line) for line in (data / "test.jsonl").read_text().splitlines()]
    a, b = sample_pairs(data, "test", 10, 3), sample_pairs(data, "test", 10, 3)
    assert a == b and len(a) == 10
    positions = [rows.index(r) for r in a]
    assert positions == sorted(positions)
    assert sample_pairs(data, "test", 0, 3) == rows
    assert sample_pairs(data, "test", 10, 4) != a


def test_bad_folders_exit_2(pair, tmp_path, capsys):
    root, data = pair
    assert main(["--target", str(tmp_path), "--data", str(data)]) == 2
    assert "is not a model folder" in capsys.readouterr().err
    assert main(["--target", str(root / "target"), "--data", str(tmp_path), "--repeats", "1", "--no-hf"]) == 2
    assert "specdec data gettext" in capsys.readouterr().err


# ----------------------------------------------------------------- specdec translate, bench --task translate


def test_specdec_translate_equals_the_targets_generate(pair, tmp_path, capsys):
    root, _data = pair
    target = MarianMTModel.from_pretrained(root / "target").eval()
    tokenizer = AutoTokenizer.from_pretrained(root / "target")
    sources = ["open the file", "cannot save %s 42 error", "the file"]
    expected = []
    for source in sources:
        ids = tokenizer(source, return_tensors="pt").input_ids
        with torch.no_grad():
            out = target.generate(ids, attention_mask=torch.ones_like(ids), num_beams=1, do_sample=False,
                                  max_new_tokens=12)
        expected.append(out[0, 1:].tolist())  # without the decoder start token
    for drafter in ("ngram", str(root / "drafter")):
        for source, tokens in zip(sources, expected):
            args = ["translate", "--target", str(root / "target"), "--drafter", drafter, "--max-new-tokens", "12"]
            assert cli_main([*args, "--json", source]) == 0
            assert json.loads(capsys.readouterr().out)["tokens"] == tokens, (drafter, source)
    many = tmp_path / "sources.txt"
    many.write_text("\n".join(sources) + "\n")
    assert cli_main(["translate", "--target", str(root / "target"), "--max-new-tokens", "12", "--json",
                     "--prompts-file", str(many)]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["index"] for line in lines] == [0, 1, 2] and [line["tokens"] for line in lines] == expected


def test_specdec_translate_refuses_what_it_cannot_translate_with(tmp_path, monkeypatch, capsys):
    decoder_only = save_tiny_pair(tmp_path / "pair").target
    assert cli_main(["translate", "--target", str(decoder_only), "x"]) == 2
    assert "needs an encoder-decoder target" in capsys.readouterr().err
    monkeypatch.setattr("specdec.folders.models_dir", lambda: tmp_path / "no-models")  # a checkout without models
    assert cli_main(["translate", "x"]) == 2
    assert "the shipped model 'translate-target' is not at" in capsys.readouterr().err
    assert cli_main(["bench", "--task", "translate", "--data", str(tmp_path)]) == 2
    assert "the shipped model 'translate-target' is not at" in capsys.readouterr().err
    assert cli_main(["bench", "--task", "translate"]) == 2
    assert "--task translate needs --data" in capsys.readouterr().err


def test_bench_task_translate(pair, tmp_path):
    root, data = pair
    out = tmp_path / "out"
    assert cli_main(["bench", "--task", "translate", "--data", str(data), "--target", str(root / "target"),
                     "--drafter", str(root / "drafter"), "--num-prompts", "6", "--max-new-tokens", "8",
                     "--repeats", "1", "--output", str(out)]) == 0
    report = json.loads((out / "translate-summary.json").read_text())
    assert report["sources"] == 6 and {m["name"] for m in report["methods"]} == {
        "plain", "ngram", "model", "lookup+model", "hf", "hf beam5", "hf assisted"}
    assert all(m["differ"] == 0 for m in report["methods"] if m["exact"])
    assert [r["batch"] for r in report["memory"]] == [1, 4, 8, 16]
    assert "| lookup+model |" in (out / "translate-summary.md").read_text()

    # the shipped target's generation config sets max_length: transformers' generate then advised at every call
    emitted: list[str] = []
    keep = logging.Handler()
    keep.emit = lambda record: emitted.append(record.getMessage())
    logging.getLogger("transformers").addHandler(keep)
    try:
        assert cli_main(["bench", "--task", "translate", "--data", str(data), "--num-prompts", "2", "--max-new-tokens",
                         "8", "--repeats", "1", "--methods", "hf", "--output", str(tmp_path / "shipped")]) == 0
    finally:
        logging.getLogger("transformers").removeHandler(keep)
    assert not [m for m in emitted if "seem to have been set" in m]


def test_serve_an_encoder_decoder_target(pair, monkeypatch):
    """`specdec serve` over the Marian target: a completion's prompt is the source, its output the
    target's own `generate`; chat is refused (no chat template); an over-long source is refused."""
    import openai

    from specdec.config import ModelConfig, SamplingConfig, SpecConfig, VerifyConfig
    from specdec.serve.config import ServeConfig
    from specdec.serve.server import ServerThread, build_app

    monkeypatch.delenv("SPECDEC_API_KEY", raising=False)
    root, _data = pair
    target = MarianMTModel.from_pretrained(root / "target").eval()
    tokenizer = AutoTokenizer.from_pretrained(root / "target")
    sources = ["open the file", "cannot save %s 42 error", "the file"]
    app = build_app(ServeConfig(port=0), ModelConfig(target=str(root / "target"), drafter="ngram", device="cpu"),
                    SpecConfig(batch_size=2, max_new_tokens=12), SamplingConfig(), VerifyConfig())
    with ServerThread(app) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        for i, source in enumerate(sources):
            ids = tokenizer(source, return_tensors="pt").input_ids
            with torch.no_grad():
                expected = target.generate(ids, attention_mask=torch.ones_like(ids), num_beams=1, do_sample=False,
                                           max_new_tokens=12)[0, 1:].tolist()
            if i % 2:
                chunks = list(client.completions.create(model="target", prompt=source, max_tokens=12, temperature=0,
                                                        stream=True))
                assert [t for c in chunks if c.choices for t in c.specdec["tokens"]] == expected
            else:
                reply = client.completions.create(model="target", prompt=source, max_tokens=12, temperature=0)
                assert reply.specdec["token_ids"] == expected
                assert reply.usage.prompt_tokens == ids.shape[1]  # the source's length
        with pytest.raises(openai.BadRequestError, match="encoder-decoder model without a chat template"):
            client.chat.completions.create(model="target", messages=[{"role": "user", "content": "open"}])
        with pytest.raises(openai.BadRequestError, match="encoder holds 64 tokens, but the source has"):
            client.completions.create(model="target", prompt=[5] * 70, max_tokens=4)


def test_bench_flags_pick_the_shipped_drafters_for_the_shipped_target_only(pair):
    from specdec.bench.config import BenchConfig
    from specdec.bench.translate import config_from_bench
    from specdec.loading import default_model_path

    root, data = pair
    shipped = config_from_bench(BenchConfig(task="translate", data=str(data)))
    assert shipped.target == str(default_model_path("translate-target"))
    assert shipped.drafter == str(default_model_path("translate-drafter"))
    assert shipped.block_drafter == str(default_model_path("translate-block-drafter"))
    own = config_from_bench(BenchConfig(task="translate", data=str(data), target=str(root / "target")))
    assert own.target == str(root / "target") and own.drafter is None and own.block_drafter is None


# ----------------------------------------------------------------- CTranslate2 as a peer (an optional extra)


def _greedy(model, ids, max_new_tokens):
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             num_beams=1, do_sample=False, max_new_tokens=max_new_tokens)
    return out[0, 1:].tolist()


def _opus_layout(target):
    """The target as OPUS-MT lays a Marian model out: the decoder starts from the last row, a zero embedding."""
    model = copy.deepcopy(target)
    last = model.config.vocab_size - 1
    with torch.no_grad():
        model.get_input_embeddings().weight[last] = 0
    model.config.decoder_start_token_id = model.generation_config.decoder_start_token_id = last
    return model


def _ctranslate2_or_refused(root):
    """The peer's module, the tokenizer and the Marian target where ctranslate2 is installed. Where it is not
    (an optional extra, as on a fresh machine), the bench's refusal naming the install is what is checked, and
    None is returned."""
    if importlib.util.find_spec("ctranslate2") is None:
        with pytest.raises(ValueError, match="pip install ctranslate2"):
            check_translate_peers(("ctranslate2",))
        return None
    tokenizer = AutoTokenizer.from_pretrained(root / "target")
    target = MarianMTModel.from_pretrained(root / "target").eval()
    return importlib.import_module("specdec.bench.ctranslate2_seq2seq"), tokenizer, target


@pytest.mark.parametrize("layout", ["pad first, trained start embedding", "OPUS-MT: start last, zero embedding"])
def test_ctranslate2_conversion_gives_generates_tokens(pair, layout):
    root, data = pair
    peer = _ctranslate2_or_refused(root)
    if peer is None:
        return
    ctranslate2_seq2seq, tokenizer, target = peer
    if layout.startswith("OPUS"):
        target = _opus_layout(target)
    else:  # the start token (pad, 0) has a vector of its own, as the shipped translate-target's trained one
        assert target.config.decoder_start_token_id == target.config.pad_token_id == 0
        with torch.no_grad():
            target.get_input_embeddings().weight[0] = torch.randn(target.config.d_model,
                                                                  generator=torch.Generator().manual_seed(1))
    assert target.final_logits_bias.abs().sum() > 0  # the eos bias the fixture sets: converted too
    sources = [tokenizer(p["src"])["input_ids"] for p in sample_pairs(data, "test", 0, 0)]
    translator = ctranslate2_seq2seq.CTranslate2Translator(target, tokenizer, threads=1)
    outputs = [translator.translate(ids, 10, target.config.eos_token_id) for ids in sources]
    assert outputs == [_greedy(target, ids, 10) for ids in sources]
    assert any(len(o) < 10 for o in outputs) and any(len(o) == 10 for o in outputs)  # ended and capped both


def test_ctranslate2_vocabulary_names_every_row(pair):
    peer = _ctranslate2_or_refused(pair[0])
    if peer is None:
        return
    ctranslate2_seq2seq, tokenizer, target = peer
    names = ctranslate2_seq2seq.vocabulary(target, tokenizer)
    assert names == tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))  # pad first, kept
    target.resize_token_embeddings(len(tokenizer) + 3)  # rows the tokenizer does not name
    names = ctranslate2_seq2seq.vocabulary(target, tokenizer)
    assert len(names) == len(tokenizer) + 3 and len(set(names)) == len(names)
    assert names[-1] == ctranslate2_seq2seq.PLACEHOLDER.format(len(tokenizer) + 2)


def test_the_bench_times_ctranslate2_beside_ours(pair):
    root, data = pair
    config = TranslateBenchConfig(target=str(root / "target"), data=str(data), limit=8, max_new_tokens=10, repeats=1,
                                  hf=False, memory_batches=(), peers=("ctranslate2",))
    if importlib.util.find_spec("ctranslate2") is None:  # an optional extra: refused, naming the install
        with pytest.raises(ValueError, match="pip install ctranslate2"):
            run_bench(config, log=lambda s: None)
        return
    report = run_bench(config, log=lambda s: None)
    methods = {m["name"]: m for m in report["methods"]}
    assert set(methods) == {"plain", "ngram", "ctranslate2"}
    assert methods["ctranslate2"]["exact"] and methods["ctranslate2"]["differ"] == 0
    assert methods["ctranslate2"]["tokens"] == methods["plain"]["tokens"] > 8
    assert "| ctranslate2 |" in table(report)


def test_the_translate_bench_refuses_a_decoder_only_peer(pair, capsys):
    root, data = pair
    config = TranslateBenchConfig(target=str(root / "target"), data=str(data), peers=("llamacpp",))
    with pytest.raises(ValueError, match="--task translate runs the peers ctranslate2, not llamacpp"):
        run_bench(config, log=lambda s: None)
    with pytest.raises(SystemExit):
        main(["--target", str(root / "target"), "--data", str(data), "--peers", "llamacpp"])
    assert "invalid choice" in capsys.readouterr().err
