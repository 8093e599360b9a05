"""Model folders, without torch: the shipped names, where they live, and what a folder must hold.

``resolve_model_path`` turns a shipped name ("code-target", "translate-drafter", ...), None (the
default target) or a path into an existing folder with a ``config.json``, else a ``ValueError``
that names it; ``is_encoder_decoder`` reads a folder's kind from its ``config.json``;
``require_weights`` refuses, in one line naming the folder and the fix, a folder without safetensors
weights (transformers' own error names neither the fix nor, under a training run, the folder meant). The command
line checks its inputs with these before it imports torch; ``specdec.loading`` loads from them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from specdec.config import SHIPPED_DRAFTERS, SHIPPED_TARGETS

SHIPPED_MODELS = (*SHIPPED_TARGETS, *SHIPPED_DRAFTERS)  # names resolved to models/<name> at the repo root
DEFAULT_TARGET = "code-target"  # what load_model(None) loads
# A tokenizer folder holds one of these: a fast tokenizer, its config, or a slow one's vocabulary
# (BPE, WordPiece, SentencePiece, Marian's source/target models).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "vocab.txt", "merges.txt",
                   "tokenizer.model", "spiece.model", "sentencepiece.bpe.model", "source.spm", "target.spm")


def cache_root() -> Path:
    """specdec's folder under the user's cache (``$XDG_CACHE_HOME/specdec``, else ``~/.cache/specdec``): compiled
    graphs, inductor's builds, the blocked linear kernel."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "specdec"


def models_dir() -> Path:
    """The shipped models' folder: ``models/`` next to the package (editable install)."""
    return Path(__file__).resolve().parent.parent / "models"


def default_model_path(name: str) -> Path:
    """The folder of a shipped model name ("code-target" / "code-drafter")."""
    if name not in SHIPPED_MODELS:
        raise ValueError(f"unknown shipped model {name!r}; the shipped models are {', '.join(SHIPPED_MODELS)}")
    return models_dir() / name


def resolve_model_path(path_or_name: str | Path | None) -> Path:
    """A shipped name, None (the default target), a folder or a ``.gguf`` file (``specdec.gguf``: its folder) -> an
    existing folder, else ValueError."""
    if path_or_name is None:
        path_or_name = DEFAULT_TARGET
    if isinstance(path_or_name, str) and path_or_name in SHIPPED_MODELS:
        path = default_model_path(path_or_name)
        if not (path / "config.json").is_file():
            raise ValueError(
                f"the shipped model {path_or_name!r} is not at {path}: train or download it into that folder "
                "(see README), or pass the path of a model folder with config.json and safetensors weights"
            )
        return path
    path = Path(path_or_name).expanduser()
    if path.suffix.lower() == ".gguf" and path.is_file():  # llama.cpp's format: through transformers' GGUF loading
        from specdec.gguf import gguf_folder

        return gguf_folder(path)
    if not path.exists():
        raise ValueError(
            f"model path {str(path)!r} does not exist: pass a folder with config.json and safetensors weights "
            f"or one of the shipped names {', '.join(SHIPPED_MODELS)} (the model hub is not used)"
        )
    if not (path / "config.json").is_file():
        raise ValueError(f"model path {str(path)!r} has no config.json: it is not a transformers model folder")
    return path


WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")  # what from_pretrained(use_safetensors=True) reads
UNSAFE_WEIGHT_FILES = ("pytorch_model.bin", "pytorch_model.bin.index.json")  # pickles: never loaded (they run code)


def require_weights(path: str | Path) -> Path:
    """``path`` when the model folder holds safetensors weights (one file or an index of shards), else a one-line
    ``ValueError`` naming the folder and the fix (a training run's weights are in its ``final/``)."""
    path = Path(path)
    if any((path / name).is_file() for name in WEIGHT_FILES):
        return path
    if any((path / "final" / name).is_file() for name in WEIGHT_FILES):
        fix = f"give {str(path / 'final')!r}, where the training run wrote its model"
    elif any((path / name).is_file() for name in UNSAFE_WEIGHT_FILES):
        fix = ("it holds pickled weights (pytorch_model.bin), which are never loaded: convert them with "
               "model.save_pretrained(folder, safe_serialization=True)")
    else:
        fix = "save the model into it with model.save_pretrained(folder), or give the folder that holds its weights"
    raise ValueError(f"model folder {str(path)!r} has no weights ({' or '.join(WEIGHT_FILES)}): {fix}")


def is_encoder_decoder(path_or_name: str | Path | None) -> bool:
    """Whether a model folder (or shipped name) holds an encoder-decoder model, as its config.json says
    (transformers writes ``is_encoder_decoder`` for every encoder-decoder configuration)."""
    config = resolve_model_path(path_or_name) / "config.json"
    try:
        return bool(json.loads(config.read_text(encoding="utf-8")).get("is_encoder_decoder", False))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{str(config)!r} is not a JSON model configuration ({err})") from err
