"""llama-cpp-python's model parameters set where its ``Llama`` takes no argument for them, and the check that a GGUF
file decodes (``specdec.bench.peers.extra_buffers``).

Run as a script by path, in its own process (``python llama_params.py FILE EXTRA``, EXTRA 1 or 0): it loads FILE
with llama.cpp's extra buffer types on or off and decodes a few tokens, so that a crash of llama.cpp (a signal, not
an exception) ends that process, not the bench's. ``python llama_params.py quantize SOURCE OUT FORM`` writes a
quantized GGUF file (``FTYPES``) the same way. Imports nothing of specdec, nor torch.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def model_params(extra_buffers: bool) -> Iterator[None]:
    """Within the block, llama-cpp-python's ``Llama`` loads models with ``use_extra_bufts`` = ``extra_buffers`` (its
    constructor takes no such argument: it starts from ``llama_model_default_params``)."""
    import llama_cpp.llama

    bindings = llama_cpp.llama.llama_cpp
    defaults = bindings.llama_model_default_params

    def params():  # llama.cpp's ctypes struct
        chosen = defaults()
        chosen.use_extra_bufts = extra_buffers
        return chosen

    bindings.llama_model_default_params = params
    try:
        yield
    finally:
        bindings.llama_model_default_params = defaults


FTYPES = {"q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0", "q4_k_m": "LLAMA_FTYPE_MOSTLY_Q4_K_M"}  # a form -> llama.cpp's ftype


def quantize(source: str, out: str, form: str) -> None:
    """llama.cpp's quantizer (``llama_model_quantize``, as its ``llama-quantize`` tool runs it) from a GGUF file."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, FTYPES[form])
    params.nthread = 1
    failed = llama_cpp.llama_model_quantize(source.encode(), out.encode(), params)
    if failed:
        sys.exit(f"llama_model_quantize returned {failed}")


if __name__ == "__main__" and sys.argv[1] == "quantize":  # llama_params.py quantize SOURCE OUT FORM
    quantize(*sys.argv[2:5])
elif __name__ == "__main__":
    from llama_cpp import Llama

    with model_params(sys.argv[2] == "1"):
        llm = Llama(model_path=sys.argv[1], n_ctx=64, n_threads=1, n_threads_batch=1, verbose=False)
    llm.eval(list(range(1, 9)))
    llm.eval([9])
