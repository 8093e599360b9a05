"""A GGUF file as a target or drafter, through transformers' own GGUF loading.

``gguf_folder(file)`` gives the transformers folder of a ``.gguf`` file (llama.cpp's format): the model transformers'
``from_pretrained(..., gguf_file=...)`` builds from it (its weights dequantised to float32, the function that file's
quantized values define) and the tokenizer it reads from the file's metadata, saved once as safetensors under
specdec's cache (``~/.cache/specdec/gguf/``, keyed by the file's path, size and time) and reused after. Every later
step then sees an ordinary folder: speculation is exact with respect to that dequantised model, whose own ``generate``
is the reference. transformers keeps no GGUF weight quantized (it has no GGUF kernel), so the model reads float32
weights: for speed, quantize the float source with ``specdec quantize`` instead. An architecture transformers cannot
read from GGUF, or the ``gguf`` package missing, is one line naming it and the fix.
"""

from __future__ import annotations

import hashlib
import shutil
import sys
import tempfile
from pathlib import Path

from specdec.compat import progress_bars


def _key(file: Path) -> str:
    stat = file.stat()
    return hashlib.sha256(f"{file.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]


def gguf_folder(file: str | Path, cache: Path) -> Path:
    """The transformers folder of the GGUF ``file`` under ``cache`` (``specdec.folders``: specdec's cache + "gguf"),
    written at the first call (said once on stderr)."""
    file = Path(file).expanduser()
    folder = cache / f"{file.stem}-{_key(file)}"
    if (folder / "config.json").is_file() and (folder / "model.safetensors").is_file():
        return folder
    try:
        import gguf
    except ImportError:
        raise ValueError(f"reading {file} needs the gguf package: pip install gguf") from None
    try:
        field = gguf.GGUFReader(str(file)).fields["general.architecture"]
        architecture = bytes(field.parts[field.data[0]]).decode()
    except Exception as err:  # noqa: BLE001 - any unreadable file is one line
        raise ValueError(f"{file} is not a GGUF file that names its architecture ({type(err).__name__})") from None
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES as readable
    except ImportError:  # a release that keeps the list elsewhere: from_pretrained's own error decides
        readable = [architecture]
    if architecture not in readable:
        raise ValueError(f"{file}: transformers cannot read a {architecture!r} model from GGUF (it reads "
                         f"{', '.join(sorted(readable))}): convert its original checkpoint")
    print(f"specdec: {file.name}: reading it through transformers' GGUF loader (weights dequantised to float32), "
          f"saved once as a model folder at {folder}", file=sys.stderr)
    with progress_bars(False):
        model = AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)
        # transformers marks the model "quantized with gguf" (its quantizer only dequantised at load) and will not
        # save it: the weights are float32 now, saved as the float model they are
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        folder.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=folder.parent, prefix=".writing-") as tmp:
            model.save_pretrained(tmp, safe_serialization=True)
            tokenizer.save_pretrained(tmp)
            shutil.rmtree(folder, ignore_errors=True)  # a half-written folder of an interrupted run
            Path(tmp).rename(folder)
            Path(tmp).mkdir()  # for the context manager's cleanup
    return folder
