"""Other engines beside ours (`specdec bench --peers ctranslate2`): the same model, prompts and machine.

A peer is an engine a user could pick instead of specdec to decode the target: it runs as one more
method of the comparison (a ``Runner``), greedy only, timed in the same interleaved order with the
same clock and thread count, and its outputs are checked token for token against the target's own
``generate`` like every method's. Peers are optional extras (``pip install 'specdec[peers]'``): a
peer asked for but not installed is refused before anything loads, naming the package to install.

Registered (``PEERS``, ``register_peer``):

- ``ctranslate2``: CTranslate2's ``Generator`` in float32, on the target converted by its
  transformers converter into a temporary folder at the first run (untimed, in the warm-up); its
  ``intra_threads`` is torch's thread count. Its converters read the model as transformers loads it;
  a model it cannot convert fails that method alone, with the converter's message.
"""

from __future__ import annotations

import importlib.util
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from transformers import PreTrainedModel

from specdec.bench.runners import BenchModels, DrafterCost, Meters, RunOutput, Setting
from specdec.loading import load_tokenizer


class PeerEngine(Protocol):
    """A loaded peer: greedy decoding of one prompt."""

    def generate(self, ids: list[int], max_new_tokens: int, stop: Sequence[int]) -> list[int]:
        """Greedy new tokens after ``ids``: at most ``max_new_tokens``, ending at (and with) a token of ``stop``."""
        ...


@dataclass(frozen=True)
class Peer:
    """How to find and build one peer engine."""

    name: str  # the name --peers takes
    module: str  # the module it imports (installed or not)
    package: str  # what pip installs
    description: str  # one line for --list
    build: Callable[[PreTrainedModel, int], PeerEngine]  # (the target as loaded, torch threads) -> engine


class CTranslate2Engine:
    """CTranslate2's generator on the target, converted (float32) into a temporary folder."""

    def __init__(self, target: PreTrainedModel, threads: int) -> None:
        import ctranslate2
        from ctranslate2.converters import TransformersConverter

        folder = getattr(target, "name_or_path", "") or ""
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


PEERS: dict[str, Peer] = {}


def register_peer(peer: Peer) -> None:
    """Make ``--peers NAME`` run ``peer``."""
    PEERS[peer.name] = peer


register_peer(Peer("ctranslate2", "ctranslate2", "ctranslate2", "CTranslate2's Generator, float32 (greedy)",
                   CTranslate2Engine))


def check_peers(names: Sequence[str]) -> None:
    """Refuse an unknown peer, or one whose package is not installed, saying what to do."""
    for name in names:
        if name not in PEERS:
            raise ValueError(f"unknown peer {name!r}: choose from {', '.join(sorted(PEERS))}")
        peer = PEERS[name]
        if importlib.util.find_spec(peer.module) is None:
            raise ValueError(f"peer {name!r} needs the package {peer.package}, which is not installed: "
                             f"pip install {peer.package} (or pip install 'specdec[peers]'), or leave it out of --peers")


class PeerRunner:
    """A peer engine as a bench method: greedy, no drafter, built at its first run (the warm-up)."""

    group = "peers"
    uses_gamma = speculative = needs_drafter_model = False
    greedy_only = True  # the harness runs it at temperature 0 only
    cost = DrafterCost.NONE

    def __init__(self, peer: Peer) -> None:
        self.peer = peer
        self.name = peer.name
        self.description = f"peer: {peer.description}"
        self.engine: PeerEngine | None = None

    def run(self, models: BenchModels, input_ids: torch.Tensor, setting: Setting, meters: Meters) -> RunOutput:
        if not setting.greedy:
            raise ValueError(f"peer {self.name} runs greedy only")
        if self.engine is None:
            self.engine = self.peer.build(models.target, torch.get_num_threads())
        tokens = self.engine.generate(input_ids.tolist(), setting.max_new_tokens, models.stop_token_ids)
        return RunOutput(tokens=tokens, rounds=len(tokens), target_time_s=0.0, drafter_time_s=0.0)


def peer_runners(names: Sequence[str]) -> list[PeerRunner]:
    """A runner per peer named (checked first: known and installed)."""
    check_peers(names)
    return [PeerRunner(PEERS[name]) for name in dict.fromkeys(names)]
