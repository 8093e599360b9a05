"""A tiny target/drafter pair saved to disk, for tests that drive the command line.

`save_tiny_pair(root)` writes `root/target` and `root/drafter`: two Llama causal LMs with random
weights, saved with `save_pretrained` (safetensors), each with the same byte-level BPE tokenizer
(a `PreTrainedTokenizerFast` with `<|endoftext|>` as eos) trained in memory on a few lines of
Python. Both models are then trained for a few seconds on that text (without end-of-text tokens,
so they keep writing), the drafter smaller and for fewer steps: the output reads as Python and the
drafter agrees with the target often but not always, so rounds see accepted, recovered and bonus
tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from specdec.data.tokenizer import train_tokenizer

_CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "def parse_args(argv):\n    parser = argparse.ArgumentParser()\n    return parser.parse_args(argv)\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "for i in range(10):\n    print(i, i * i)\n",
    "import os\nimport sys\n\nif __name__ == '__main__':\n    sys.exit(main())\n",
]


@dataclass(frozen=True)
class TinyPair:
    """Paths of a saved tiny pair."""

    target: Path
    drafter: Path


def build_tokenizer(vocab_size: int = 320) -> PreTrainedTokenizerFast:
    """A byte-level BPE over the tiny corpus, by the same trainer as the shipped tokenizer."""
    return train_tokenizer(_CORPUS, vocab_size=vocab_size)


def _llama(vocab_size: int, eos_id: int, hidden: int, layers: int) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=8192,  # long enough for the Ctrl-C test to interrupt a long generation
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = eos_id
    return model


def _fit(model: LlamaForCausalLM, ids: torch.Tensor, steps: int, lr: float) -> LlamaForCausalLM:
    """A few Adam steps of next-token loss on random windows of `ids` (memorising the corpus)."""
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    for _ in range(steps):
        starts = torch.randint(0, len(ids) - 64, (8,))
        batch = torch.stack([ids[s : s + 64] for s in starts.tolist()])  # [8, 64]
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()


def save_tiny_pair(root: Path) -> TinyPair:
    """Build and save the pair under `root` (on one torch thread, the caller's count restored); return its paths."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _save_tiny_pair(root)
    finally:
        torch.set_num_threads(threads)


def _save_tiny_pair(root: Path) -> TinyPair:
    tokenizer = build_tokenizer()
    vocab_size = len(tokenizer)
    eos_id = tokenizer.eos_token_id
    torch.manual_seed(0)
    ids = torch.tensor(tokenizer("".join(_CORPUS) * 2).input_ids)  # [T]
    target = _fit(_llama(vocab_size, eos_id, hidden=64, layers=3), ids, steps=80, lr=5e-3)
    drafter = _fit(_llama(vocab_size, eos_id, hidden=32, layers=1), ids, steps=40, lr=1e-2)
    pair = TinyPair(target=root / "target", drafter=root / "drafter")
    for path, model in ((pair.target, target), (pair.drafter, drafter)):
        model.save_pretrained(path, safe_serialization=True)
        tokenizer.save_pretrained(path)
    return pair


def toy_corpus(words: dict[str, str], sizes: dict[str, int], max_words: int, root: Path) -> Path:
    """A word-for-word English -> German corpus written where ``specdec data gettext`` writes one:
    ``sizes[split]`` pairs per split (train, validation, test), each split its own catalogue, each
    pair 1..``max_words`` words of ``words`` drawn with a seed per split. Returns the data folder."""
    import random

    from specdec.data.gettext import Corpus, Pair, write_corpus

    splits, catalogues = {}, {}
    for seed, (split, n) in enumerate(sizes.items()):
        rng, catalogue = random.Random(seed), "abc"[seed]
        chosen = [rng.choices(list(words), k=rng.randint(1, max_words)) for _ in range(n)]
        splits[split] = [Pair(" ".join(w), " ".join(words[x] for x in w), catalogue) for w in chosen]
        catalogues[split] = [catalogue]
    return write_corpus(Corpus(splits, catalogues, {c[0]: sizes[s] for s, c in catalogues.items()}), root)


def train_texts(data: Path) -> list[str]:
    """Both sides of every train pair of a corpus folder (what a shared tokenizer is trained on)."""
    from specdec.data.gettext import load_pairs

    return [t for p in load_pairs(data, "train") for t in (p.src, p.tgt)]


def save_tiny_pair_with_head(root: Path, threshold: float) -> tuple[TinyPair, Path]:
    """``save_tiny_pair`` with a random acceptance head saved beside the drafter (where ada finds it)
    and a two-prompt JSONL file for the benchmark; returns the pair and the file."""
    import json

    from specdec.heads import AcceptanceHead, HeadConfig

    pair = save_tiny_pair(root)
    hidden = json.loads((pair.drafter / "config.json").read_text())["hidden_size"]
    AcceptanceHead(HeadConfig(hidden_size=hidden,
                              threshold=threshold)).save_pretrained(pair.drafter / "acceptance_head")
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": p}) + "\n"
                               for i, p in enumerate(["def add(a, b):", "for i in range(10):"])))
    return pair, prompts
