"""llama.cpp's own converter (convert_hf_to_gguf.py) run on a transformers folder, our tokenizer let through.

Run as a script by path, in its own process (``python gguf_driver.py SOURCE MODEL OUT OUTTYPE``), so the
converter's modules (``conversion``, its ``gguf-py``) never enter the bench's process. SOURCE is a
llama.cpp source folder (``convert_hf_to_gguf.py`` at its root; the one vendored in llama-cpp-python's
source distribution is used by the bench), OUTTYPE one of the converter's ``--outtype`` values (f32, q8_0).

The converter recognises a BPE tokenizer's pre-tokenizer only by the hash of its tokens for a fixed
text, from a list of published models; a tokenizer trained here (byte-level BPE with GPT-2's
pre-tokenizer, see ``specdec.data.tokenizer``) is in no list, so the converter refuses it. Where the
hash is unknown and ``tokenizer.json`` declares exactly GPT-2's pre-tokenization (a ByteLevel
pre-tokenizer with its regex, no normalizer), it is registered as ``gpt-2``, as GPT-2's is; any other tokenizer is
still refused with the converter's own message.
"""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path


def gpt2_pre_tokenizer(model: Path) -> bool:
    """Whether ``model``'s tokenizer.json pre-tokenizes as GPT-2 does (byte-level BPE, its regex, no normalizer)."""
    path = model / "tokenizer.json"
    if not path.is_file():
        return False
    spec = json.loads(path.read_text(encoding="utf-8"))
    pre = spec.get("pre_tokenizer") or {}
    if pre.get("type") == "Sequence" and len(pre.get("pretokenizers", [])) == 1:
        pre = pre["pretokenizers"][0]
    return (spec.get("normalizer") is None and (spec.get("model") or {}).get("type") == "BPE"
            and pre.get("type") == "ByteLevel" and pre.get("use_regex", True) and not pre.get("add_prefix_space"))


def main(argv: list[str]) -> None:
    source, model, out, outtype = (Path(argv[0]), Path(argv[1]), argv[2], argv[3])
    script = source / "convert_hf_to_gguf.py"
    sys.path.insert(0, str(source))
    if (source / "gguf-py").is_dir():  # the converter's own gguf, as it puts it first itself
        sys.path.insert(1, str(source / "gguf-py"))
    from conversion import base  # the converter's package, beside the script

    recognised = base.TextModel.get_vocab_base_pre

    def get_vocab_base_pre(self, tokenizer) -> str:
        try:
            return recognised(self, tokenizer)
        except NotImplementedError:
            if not gpt2_pre_tokenizer(Path(self.dir_model)):
                raise
            print("specdec: pre-tokenizer not in the converter's list; tokenizer.json declares GPT-2's: "
                  "registered as gpt-2", file=sys.stderr)
            return "gpt-2"  # the name the converter gives GPT-2's own tokenizer (openai-community/gpt2)

    base.TextModel.get_vocab_base_pre = get_vocab_base_pre
    sys.argv = [str(script), str(model), "--outfile", out, "--outtype", outtype]
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
