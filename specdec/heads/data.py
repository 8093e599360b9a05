"""Training data of the acceptance head, built as SpecDec++ builds it (Huang, Guo, Wang 2024, sec. 4).

Contract: ``build_head_data(cfg)`` reads a ``specdec train outputs`` file (the target's own
continuations ``x`` of prompts), and for each record and each label kind in ``cfg.labels`` writes
labelled hidden states of the frozen drafter to a folder of safetensors shards; ``load_head_data``
reads them back as one ``HeadData``. Building resumes: finished shards are kept.

Per record (prompt ``P``, the target's response ``x_1..x_n``):

1. Teacher forcing on ``P + x``: the target's ``p_j`` and the drafter's ``q_j`` at each response
   position ``j`` (the distributions of ``x_j`` given ``P + x_<j``), temperature 1.
2. A draft token per position: ``d_j = argmax q_j`` for greedy verification, ``d_j ~ q_j`` for
   sampling; its label is its acceptance probability under that verification: greedy
   ``1[d_j == argmax p_j]``, sampling ``min(1, p_j(d_j) / q_j(d_j))`` (Leviathan et al. 2023).
3. Mixing (SpecDec++'s ``mixing_ratio`` r = 0.15): each position's input keeps the target's token,
   ``z_j = x_j``, with probability r, else takes the draft, ``z_j = d_j``. The drafter reads
   ``P + z``, so its context holds drafted tokens, as when it drafts several in a row.
4. Examples: at each position whose input is a draft (``z_j = d_j``), the drafter's last-layer
   hidden state there, labelled with ``d_j``'s acceptance probability. Positions that kept
   ``x_j`` give no example (SpecDec++: loss only on draft tokens).

That is ``inputs="mixed"``, SpecDec++'s recipe: the state at ``z_j``'s position is the one whose
logits produce the NEXT draft, so in the round loop (``Proposal.hidden[b, i]``, the state behind
draft ``i``) the head's value at ``i`` estimates the acceptance of draft ``i - 1``.

``inputs="response"`` (the shipped head's recipe and the default): no mixing; the drafter reads the target's
response ``P + x`` and every position is an example: the state whose logits give ``q_j`` (behind
``d_j``), labelled with ``d_j``'s acceptance. In the round loop the head's value at ``i`` then
estimates the acceptance of draft ``i`` itself, read before it is drafted. Conditioned on the
drafts so far being accepted (the only case in which the rule's product matters), a greedy round's
context IS the target's text, so these states are the ones the head meets. On validation rounds
this head stops better than the mixed one (the card's figures; on a user's 12M GPT-2 pair the
mixed head predicted no better than the mean acceptance (greedy Brier 0.097 against 0.093), the response
head better (0.032 against 0.038): docs/training.md). Both fit the one stop rule of
``specdec.schedules.Ada`` (product of the values behind drafts 2..i, the first draft always made).

An encoder-decoder pair (Marian, BART, T5, ...) is handled the same way: the record's prompt is the source
both encoders read, the decoders read the start token (as ``generate`` starts) and then the response or
``z``, and the drafter's states are its decoder's last layer (what ``Proposal.hidden`` carries for it).

Shard tensors: ``hidden`` [N, H] float16, ``label`` [N] float32, ``kind`` [N] uint8 (index into
``LABEL_KINDS``), ``record`` [N] int32 (line of the outputs file), ``position`` [N] int16 (j - 1).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from specdec.heads.config import LABEL_KINDS, HeadDataConfig

META_NAME = "meta.json"


@dataclass(frozen=True)
class Record:
    """One line of a ``specdec train outputs`` file."""

    index: int  # line number in the file (0-based)
    prompt: list[int]  # prompt token ids
    response: list[int]  # the target's continuation
    temperature: float = 0.0  # how the target wrote it (0 greedy, 1 sampled)


@dataclass
class HeadData:
    """Labelled hidden states (see the module docstring); all tensors share their first dim N."""

    hidden: torch.Tensor  # [N, H] float16 (or float32)
    label: torch.Tensor  # [N] float32 acceptance probability of the draft fed there
    kind: torch.Tensor  # [N] uint8 index into LABEL_KINDS
    record: torch.Tensor  # [N] int32 record (line) of the outputs file
    position: torch.Tensor  # [N] int16 response position (0-based)
    meta: dict = field(default_factory=dict)  # the build's HeadDataConfig and drafter facts

    def __len__(self) -> int:
        return self.label.shape[0]

    def subset(self, keep: torch.Tensor) -> HeadData:
        """The examples where ``keep`` [N] bool is True (or at the indices ``keep`` [M] long)."""
        return HeadData(self.hidden[keep], self.label[keep], self.kind[keep], self.record[keep],
                        self.position[keep], self.meta)

    def of_kind(self, kind: str) -> HeadData:
        """Only the examples labelled for one verification (``greedy`` or ``sampling``)."""
        return self.subset(self.kind == LABEL_KINDS.index(kind))


def read_records(path: str | Path, records: int | None = None) -> list[Record]:
    """The first ``records`` lines (or all) of an outputs file; clear errors for a missing or short file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no generated outputs at {str(path)!r}: write them with `specdec train outputs`")
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    if records is not None and records > len(lines):
        raise ValueError(f"{path} holds {len(lines)} records, fewer than the {records} asked for: generate "
                         "more with `specdec train outputs --num-prompts N` or ask for fewer")
    out = []
    for i, line in enumerate(lines[:records]):
        r = json.loads(line)
        out.append(Record(i, list(r["prompt_ids"]), list(r["ids"]), float(r.get("temperature", 0.0))))
    return out


def _right_padded(seqs: list[list[int]], pad: int = 0) -> torch.Tensor:
    """Sequences right-padded to one width. [B, T] long. (Causal models: padding after a sequence
    never reaches its positions, so no attention mask is needed.)"""
    width = max(len(s) for s in seqs)
    return torch.tensor([s + [pad] * (width - len(s)) for s in seqs], dtype=torch.long)


def _encoder_decoder(model) -> bool:
    return bool(getattr(model.config, "is_encoder_decoder", False))


def _seq2seq_forward(model, sources: list[list[int]], decoder: list[list[int]], hidden: bool):
    """An encoder-decoder model on right-padded ``sources`` (masked) and ``decoder`` inputs, each starting with
    the decoder start token (``generate``'s); the decoder is causal, so its padding needs no mask."""
    from specdec.seq2seq import decoder_start_id

    pad = model.config.pad_token_id or 0
    source = _right_padded(sources, pad).to(model.device)  # [B, S]
    mask = _right_padded([[1] * len(x) for x in sources], 0).to(model.device)  # [B, S]
    start = decoder_start_id(model)
    ids = _right_padded([[start, *d] for d in decoder], pad).to(model.device)  # [B, 1 + T]
    return model(input_ids=source, attention_mask=mask, decoder_input_ids=ids, use_cache=False,
                 output_hidden_states=hidden)


@torch.no_grad()
def teacher_forced_logits(model, records: list[Record]) -> list[torch.Tensor]:
    """Per record, the model's next-token logits at its response positions on ``prompt + response`` (an
    encoder-decoder model: the prompt is its source, the decoder reads the start token + response):
    element j of record r is the distribution of ``response[j]``. A list of [n_r, V] float32."""
    if _encoder_decoder(model):
        logits = _seq2seq_forward(model, [r.prompt for r in records], [r.response for r in records],
                                  hidden=False).logits.float()  # [B, 1 + T, V]
        return [logits[b, : len(r.response)].cpu() for b, r in enumerate(records)]
    ids = _right_padded([r.prompt + r.response for r in records]).to(model.device)  # [B, T]
    logits = model(input_ids=ids, use_cache=False).logits.float()  # [B, T, V]
    return [logits[b, len(r.prompt) - 1 : len(r.prompt) + len(r.response) - 1].cpu()
            for b, r in enumerate(records)]


@torch.no_grad()
def response_states(drafter, prompts: list[list[int]], inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The drafter's last-layer hidden states on ``prompt + inputs``, from the prompt's last position
    on: a list of [n_r + 1, H]; row 0 is the state at the prompt's last token, row j >= 1 the state
    at ``inputs[j - 1]`` (each state's logits give the token after it). An encoder-decoder drafter reads
    the prompt as its source and its decoder's states are taken: row 0 at the start token."""
    if _encoder_decoder(drafter):
        out = _seq2seq_forward(drafter, prompts, [z.tolist() for z in inputs], hidden=True)
        last = out.decoder_hidden_states[-1].float()  # [B, 1 + T, H]
        return [last[b, : len(z) + 1].cpu() for b, z in enumerate(inputs)]
    seqs = [p + z.tolist() for p, z in zip(prompts, inputs)]
    ids = _right_padded(seqs).to(drafter.device)  # [B, T]
    out = drafter(input_ids=ids, use_cache=False, output_hidden_states=True, logits_to_keep=1)
    last = out.hidden_states[-1].float()  # [B, T, H]
    return [last[b, len(p) - 1 : len(p) + len(z)].cpu() for b, (p, z) in enumerate(zip(prompts, inputs))]


def draft_and_label(p_logits: torch.Tensor, q_logits: torch.Tensor, kind: str,
                    generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """p_logits, q_logits [n, V] (target, drafter) -> (draft [n] long, label [n] float32): the drafter's
    token at each position and its acceptance probability under ``kind`` verification."""
    if kind == "greedy":
        draft = q_logits.argmax(dim=-1)  # [n]
        label = (draft == p_logits.argmax(dim=-1)).float()  # [n]
        return draft, label
    if kind == "sampling":
        q = q_logits.softmax(dim=-1)  # [n, V]
        p = p_logits.softmax(dim=-1)  # [n, V]
        draft = torch.multinomial(q, 1, generator=generator)[:, 0]  # [n]
        pd, qd = p.gather(-1, draft[:, None])[:, 0], q.gather(-1, draft[:, None])[:, 0]  # [n], [n]
        label = (pd / qd).clamp(max=1.0)  # min(1, p/q); qd > 0 since d was drawn from q
        return draft, label
    raise ValueError(f"unknown label kind {kind!r}; choose from {', '.join(LABEL_KINDS)}")


def mix(response: torch.Tensor, draft: torch.Tensor, mixing: float,
        generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """response, draft [n] -> (inputs [n], kept [n] bool): each position keeps the target's token with
    probability ``mixing`` (``kept``), else takes the draft."""
    kept = torch.rand(response.shape, generator=generator) < mixing  # [n]
    return torch.where(kept, response, draft), kept


def record_generator(seed: int, index: int, kind: str) -> torch.Generator:
    """The RNG of one record's drafts and mixing for one label kind (independent of batching)."""
    return torch.Generator().manual_seed(seed * 1_000_003 + index * 2 + LABEL_KINDS.index(kind))


def examples_of_batch(target, drafter, records: list[Record], kinds: tuple[str, ...], mixing: float,
                      seed: int, inputs: str = "mixed") -> dict[str, torch.Tensor]:
    """The examples of a few records (the module docstring's steps 1-4, or its ``inputs="response"``),
    as shard tensors."""
    p_all = teacher_forced_logits(target, records)  # [n_r, V] each
    q_all = teacher_forced_logits(drafter, records)
    if p_all[0].shape[-1] != q_all[0].shape[-1]:
        raise ValueError(f"the target has {p_all[0].shape[-1]} logits, the drafter {q_all[0].shape[-1]}: "
                         "the head's data needs a pair with one vocabulary")
    parts: dict[str, list[torch.Tensor]] = {k: [] for k in ("hidden", "label", "kind", "record", "position")}
    if inputs == "response":
        states = response_states(drafter, [r.prompt for r in records],
                                 [torch.tensor(r.response, dtype=torch.long) for r in records])  # [n_r + 1, H] each
        for kind in kinds:
            for r, p, q, s in zip(records, p_all, q_all, states):
                _, label = draft_and_label(p, q, kind, record_generator(seed, r.index, kind))  # [n]
                n = label.shape[0]
                parts["hidden"].append(s[:-1].half())  # [n, H] the state behind d_j (its logits give q_j)
                parts["label"].append(label)
                parts["kind"].append(torch.full((n,), LABEL_KINDS.index(kind), dtype=torch.uint8))
                parts["record"].append(torch.full((n,), r.index, dtype=torch.int32))
                parts["position"].append(torch.arange(n, dtype=torch.int16))
        return {k: torch.cat(v) for k, v in parts.items()}
    for kind in kinds:
        inputs, labels, kept = [], [], []
        for r, p, q in zip(records, p_all, q_all):
            g = record_generator(seed, r.index, kind)
            draft, label = draft_and_label(p, q, kind, g)
            z, k = mix(torch.tensor(r.response, dtype=torch.long), draft, mixing, g)
            inputs.append(z)
            labels.append(label)
            kept.append(k)
        states = response_states(drafter, [r.prompt for r in records], inputs)  # [n_r + 1, H] each
        for r, s, label, k in zip(records, states, labels, kept):
            h = s[1:]  # [n, H] the state at each z_j: it reads d_j where z_j = d_j
            use = ~k  # [n] positions fed a draft
            parts["hidden"].append(h[use].half())
            parts["label"].append(label[use])
            parts["kind"].append(torch.full((int(use.sum()),), LABEL_KINDS.index(kind), dtype=torch.uint8))
            parts["record"].append(torch.full((int(use.sum()),), r.index, dtype=torch.int32))
            parts["position"].append(torch.nonzero(use)[:, 0].to(torch.int16))
    return {k: torch.cat(v) for k, v in parts.items()}


def _batches(records: list[Record], size: int) -> Iterator[list[Record]]:
    for i in range(0, len(records), size):
        yield records[i : i + size]


def _config_json(cfg: HeadDataConfig) -> dict:
    return {**asdict(cfg), "labels": list(cfg.labels)}


def build_head_data(cfg: HeadDataConfig, out_dir: str | Path, device: str | None = "cpu",
                    progress: Callable[[int, int], None] | None = None, log: Callable[[str], None] = print,
                    rank: int = 0, world: int = 1) -> Path:
    """Write the examples of ``cfg`` into ``out_dir`` (shards + meta.json); resume what is there.

    ``progress(done_records, total_records)`` is called after each batch. Under data parallelism,
    process ``rank`` of ``world`` builds the shards ``i`` with ``i % world == rank``."""
    from specdec.heads.model import drafter_hidden_size
    from specdec.loading import context_limit, load_model

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta_path = out / META_NAME
    records = read_records(cfg.outputs, cfg.records)
    wanted = _config_json(cfg)
    if meta_path.exists():
        old = json.loads(meta_path.read_text())["config"]
        if {k: v for k, v in old.items() if k != "records"} != {k: v for k, v in wanted.items() if k != "records"}:
            raise ValueError(f"{out} holds head data of another build ({old}); use a new folder or the same settings")
    target = load_model(cfg.target, device=device, dtype="fp32")
    drafter = load_model(cfg.drafter, device=device, dtype="fp32")
    limit = min(x for x in (context_limit(target), context_limit(drafter), 1 << 30) if x is not None)
    seq2seq = _encoder_decoder(target)  # its source and its decoder's text (start + response) each within the limit
    long = [r.index for r in records
            if (max(len(r.prompt), len(r.response) + 1) if seq2seq else len(r.prompt) + len(r.response)) > limit]
    if long:
        raise ValueError(f"{len(long)} records are longer than the models' context ({limit}), e.g. line {long[0]}")
    if rank == 0:
        write_meta(out, wanted, drafter_hidden_size(drafter))
    shards = [records[i : i + cfg.shard_records] for i in range(0, len(records), cfg.shard_records)]
    todo = [(i, s) for i, s in enumerate(shards) if i % world == rank and not _shard_path(out, i, len(s)).exists()]
    log(f"{len(records)} records from {cfg.outputs} in {len(shards)} shards, {len(shards) - len(todo)} done; "
        f"labels {', '.join(cfg.labels)}, inputs {cfg.inputs}"
        + (f", mixing {cfg.mixing}" if cfg.inputs == "mixed" else ""))
    done = len(records) - sum(len(s) for _, s in todo)
    for i, shard in todo:
        parts: dict[str, list[torch.Tensor]] = {}
        for batch in _batches(shard, cfg.batch_records):
            for k, v in examples_of_batch(target, drafter, batch, cfg.labels, cfg.mixing, cfg.seed,
                                          cfg.inputs).items():
                parts.setdefault(k, []).append(v)
            done += len(batch)
            if progress is not None:
                progress(done, len(records))
        write_shard(out, i, len(shard), {k: torch.cat(v) for k, v in parts.items()})
    return out


def _shard_path(out: Path, index: int, records: int) -> Path:
    return out / f"shard-{index:05d}-{records}.safetensors"


def write_meta(out: str | Path, config: dict, hidden_size: int) -> None:
    """The data folder's meta.json: the build's config and the drafter's hidden size (written beside and renamed
    in: a kill leaves the old one or the new one, never a cut one the next build could not read)."""
    meta = {"config": config, "hidden_size": hidden_size, "label_kinds": list(LABEL_KINDS)}
    path = Path(out) / META_NAME
    tmp = path.with_name(f"{META_NAME}.{os.getpid()}.tmp")
    with _writing(path, tmp):
        tmp.write_text(json.dumps(meta, indent=1) + "\n")
        os.replace(tmp, path)


def write_shard(out: str | Path, index: int, records: int, tensors: dict[str, torch.Tensor]) -> Path:
    """Write shard ``index`` (holding ``records`` records' examples: the module docstring's tensors)
    atomically, replacing a shard of the same index from a smaller build."""
    out = Path(out)
    path = _shard_path(out, index, records)
    for stale in out.glob(f"shard-{index:05d}-*.safetensors"):  # a shorter last shard of a smaller build
        stale.unlink()
    tmp = path.with_suffix(".tmp")
    with _writing(path, tmp):
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp))
        os.replace(tmp, path)
    return path


@contextmanager
def _writing(path: Path, tmp: Path) -> Iterator[None]:
    """A failed write (a full disk) as one line naming the file and the fix; the partial ``tmp`` removed."""
    try:
        yield
    except (OSError, SafetensorError) as err:
        tmp.unlink(missing_ok=True)
        reason = " ".join(str(err).split()) or type(err).__name__
        raise OSError(f"could not write {path} ({reason}); the finished shards are kept: free space on that disk "
                      "and run the same command again to resume") from err


def load_head_data(data_dir: str | Path, kinds: tuple[str, ...] | None = None) -> HeadData:
    """All shards of a data folder as one ``HeadData`` (only the label ``kinds`` asked for)."""
    folder = Path(data_dir)
    if not (folder / META_NAME).is_file():
        raise FileNotFoundError(f"no head data at {str(folder)!r}: build it with `specdec train head` "
                                "(or `specdec train head-data`)")
    meta = json.loads((folder / META_NAME).read_text())
    shards = sorted(folder.glob("shard-*.safetensors"))
    indices = [s.name.split("-")[1] for s in shards]
    if len(set(indices)) != len(indices):
        raise ValueError(f"{folder} holds two shards with one index: an interrupted rebuild; run the build again")
    if not shards:
        raise ValueError(f"{folder} holds no finished shard yet: run the build again to resume it")
    tensors = [load_file(str(s)) for s in shards]
    data = HeadData(*(torch.cat([t[k] for t in tensors]) for k in ("hidden", "label", "kind", "record", "position")),
                    meta=meta)
    if kinds is not None:
        data = data.subset(torch.isin(data.kind, torch.tensor([LABEL_KINDS.index(k) for k in kinds],
                                                               dtype=torch.uint8)))
    return data
