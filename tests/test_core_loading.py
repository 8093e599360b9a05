"""load_model / load_tokenizer: the real from_pretrained path, shipped names, devices, dtypes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import build_tiny, char_tokenizer

import specdec
from specdec.loading import default_model_path, models_dir, resolve_device, resolve_dtype


def test_round_trip_through_save_pretrained(tmp_path):
    model = build_tiny("gpt2", seed=0)
    model.save_pretrained(tmp_path / "m", safe_serialization=True)
    char_tokenizer().save_pretrained(tmp_path / "m")
    loaded = specdec.load_model(tmp_path / "m", device="cpu")
    assert not loaded.training and loaded.dtype == torch.float32
    ids = [3, 4, 5]
    assert (specdec.autoregressive_generate(loaded, ids, max_new_tokens=8, stop_token_ids=[]).tokens
            == specdec.autoregressive_generate(model, ids, max_new_tokens=8, stop_token_ids=[]).tokens)
    assert specdec.load_model(str(tmp_path / "m"), device="cpu", dtype="bf16").dtype == torch.bfloat16
    assert specdec.load_tokenizer(tmp_path / "m").decode([5, 6]) == "cd"


def test_missing_path_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match=r"model path '.*nowhere' does not exist: pass a folder"):
        specdec.load_model(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="has no config.json"):
        specdec.load_model(tmp_path / "empty")


def test_a_folder_without_weights_is_one_line_naming_it_and_the_fix(tmp_path, capsys):
    """A config without weights (a run folder given for its final/, pickled weights only, nothing): one line,
    the folder and what to give instead, from the library and from the command line."""
    model = build_tiny("gpt2", seed=0)
    for name in ("empty", "run", "pickled"):
        model.config.save_pretrained(tmp_path / name)
        char_tokenizer().save_pretrained(tmp_path / name)
    model.save_pretrained(tmp_path / "run" / "final")
    torch.save(model.state_dict(), tmp_path / "pickled" / "pytorch_model.bin")
    fixes = {"empty": "save the model into it with model.save_pretrained", "run": "final', where the training run",
             "pickled": "pickled weights (pytorch_model.bin), which are never loaded"}
    for name, fix in fixes.items():
        with pytest.raises(ValueError) as err:
            specdec.load_model(tmp_path / name)
        message = str(err.value)
        assert "\n" not in message and str(tmp_path / name) in message and "has no weights" in message, message
        assert fix in message, message
    from specdec.cli import main

    capsys.readouterr()  # save_pretrained's progress bar
    assert main(["generate", "--target", str(tmp_path / "empty"), "--max-new-tokens", "2", "ab"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "has no weights" in err and "Error no file named" not in err, err


def test_shipped_names_resolve_next_to_the_package():
    assert models_dir() == Path(specdec.__file__).resolve().parent.parent / "models"
    assert default_model_path("code-target") == models_dir() / "code-target"
    assert default_model_path("code-drafter") == models_dir() / "code-drafter"
    with pytest.raises(ValueError, match="unknown shipped model"):
        default_model_path("gpt-5")
    if not (models_dir() / "code-target" / "config.json").is_file():
        with pytest.raises(ValueError, match="shipped model 'code-target' is not at"):
            specdec.load_model(None)


def test_devices_and_dtypes():
    assert resolve_device("cpu") == "cpu" and resolve_device("auto") == "auto"
    assert resolve_device(None) == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError, match="unknown device"):
        resolve_device("tpu9")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            resolve_device("cuda:0")
    assert resolve_dtype(None, "cpu") == torch.float32
    assert resolve_dtype(None, "cuda") == torch.bfloat16
    assert resolve_dtype("fp16", "cpu") == torch.float16
    assert resolve_dtype(torch.float64, "cpu") == torch.float64
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_dtype("int3", "cpu")
