"""Data parallel training under a distributed launcher (``torchrun``, ``accelerate launch``), shared by
every trainer's optimizer loop: drafters, block drafters, the acceptance head, the language models and
the encoder-decoders.

Contract: ``DataParallel.start(device)`` is this process's place in the run: ``rank``, ``world`` (the
number of processes), ``main`` (rank 0) and ``device`` (under a launcher a CUDA device is the process's
own GPU, ``cuda:LOCAL_RANK``). Without a launcher (``WORLD_SIZE`` unset or 1) the run is one process:
nothing is started or communicated and every method below is the identity. Under one, accelerate's
``PartialState`` starts the process group (gloo for a CPU device, nccl for GPUs).

The recipe each loop follows, so that N processes take the optimizer steps one process takes:
- the step's global batch is drawn as one process draws it (a pure function of the seed and the step)
  and each process keeps ``shard(rows)``: rows rank, rank + N, ...;
- its loss is ``share(sum of its loss terms, their count)``: the sum divided by the count over all
  processes, so the shares add up to the global batch's mean loss;
- after ``backward``, ``sync_gradients`` sums the processes' gradients (one all-reduce per bucket):
  every process then holds the gradient of the global mean, the one process's gradient, and takes the
  same optimizer step (the same clipping, the same AdamW update);
- checkpoints, the final export, the model card and the measurement are written by the main process
  while the others wait at ``barrier`` (the drafter's measurement, minutes long, comes after they have
  left, as a collective times out after 10 to 30 minutes); nothing is wrapped, so a checkpoint holds the plain
  model and optimizer and a run resumes with any number of processes (the batch of step s does not
  depend on it).

Why not ``DistributedDataParallel``'s wrapper: it syncs only what goes through its own ``forward``,
while our losses call the models' own methods and attributes (a block drafter's draft vocabulary, the
target beside the drafter) and the held-out measurements run on the main process alone. The
all-reduce here is DDP's without its overlap of communication and backward, a small cost for drafters.
What differs between N processes and one: float sums in another order, and dropout masks (each
process draws its own), so a model trained with dropout follows the same curve only in distribution.
"""

from __future__ import annotations

import atexit
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

T = TypeVar("T")
BUCKET_BYTES = 32 * 2**20  # gradients all-reduced together (DDP's default bucket is 25 MiB)


def _close() -> None:
    """End the process group at exit (torch warns of one left open)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


@dataclass(frozen=True)
class DataParallel:
    """One process of a data parallel run (the defaults: a run of one process)."""

    rank: int = 0
    world: int = 1
    device: torch.device | str = "cpu"

    @property
    def main(self) -> bool:
        """Whether this process writes (checkpoints, exports, logs)."""
        return self.rank == 0

    @classmethod
    def start(cls, device: torch.device | str = "cpu") -> DataParallel:
        """This process's place: one process without a launcher, else joins the launcher's process group."""
        if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
            return cls(device=device)
        kind = torch.device(device).type
        if kind not in ("cpu", "cuda"):
            raise ValueError(f"data parallel training runs on cpu or cuda devices, not {device}")
        from accelerate import PartialState

        state = PartialState(cpu=kind == "cpu")
        if state.num_processes <= 1:
            return cls(device=device)
        atexit.register(_close)
        if kind == "cuda":
            device = str(state.device)  # cuda:LOCAL_RANK: one GPU per process
            torch.cuda.set_device(device)
        return cls(rank=state.process_index, world=state.num_processes, device=device)

    def rows(self, batch_size: int) -> slice:
        """This process's rows of a global batch of ``batch_size``: rank, rank + world, ...; all of them
        when the batch has fewer rows than there are processes (an epoch's last batch, say): every
        process then computes the whole batch, and as the loss terms' count is summed over the
        processes (``share``), each holds 1/world of the loss and the summed gradients are one process's."""
        return slice(self.rank, None, self.world) if batch_size >= self.world else slice(None)

    def shard(self, rows: Sequence[T]) -> list[T]:
        """This process's rows of the global batch ``rows`` (see ``rows``)."""
        return list(rows[self.rows(len(rows))])

    def sum(self, *values: float | torch.Tensor) -> list[float]:
        """Each value summed over the processes (one all-reduce for all)."""
        if self.world == 1:
            return [float(v) for v in values]
        import torch.distributed as dist

        flat = torch.tensor([float(v) for v in values], dtype=torch.float64, device=self.device)
        dist.all_reduce(flat)
        return flat.tolist()

    def share(self, total: torch.Tensor, count: float | torch.Tensor) -> torch.Tensor:
        """This process's share of the global mean: ``total`` (a sum of ``count`` loss terms) over the
        count summed over the processes. With one process: the mean, ``total / count``."""
        (count_all,) = self.sum(count)
        return total / count_all if count_all > 0 else total * 0.0  # nothing to learn from: no gradient

    def any(self, flag: bool) -> bool:
        """Whether ``flag`` holds on any process (all agree: to stop at the same step)."""
        return flag if self.world == 1 else self.sum(float(flag))[0] > 0

    def sync_gradients(self, parameters: Iterable[torch.nn.Parameter]) -> None:
        """Sum each parameter's gradient over the processes (a missing gradient counts as zero)."""
        if self.world == 1:
            return
        import torch.distributed as dist
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

        params = [p for p in parameters if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        bucket: list[torch.Tensor] = []

        def flush() -> None:
            flat = _flatten_dense_tensors(bucket)
            dist.all_reduce(flat)
            for grad, synced in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
                grad.copy_(synced)
            bucket.clear()

        for grad in sorted((p.grad for p in params), key=lambda g: str(g.dtype)):
            if bucket and (grad.dtype != bucket[0].dtype
                           or sum(g.numel() for g in bucket) * grad.element_size() >= BUCKET_BYTES):
                flush()
            bucket.append(grad)
        if bucket:
            flush()

    def broadcast(self, module: torch.nn.Module) -> None:
        """The main process's weights and buffers into every process's ``module`` (one start for all)."""
        if self.world == 1:
            return
        import torch.distributed as dist

        with torch.no_grad():
            for value in module.state_dict().values():
                dist.broadcast(value, 0)

    def barrier(self) -> None:
        """Wait until every process is here (after the main process wrote what the others need)."""
        if self.world > 1:
            from accelerate import PartialState

            PartialState().wait_for_everyone()

    def log(self, log: Callable[[str], None]) -> Callable[[str], None]:
        """``log`` on the main process, silence on the others."""
        return log if self.main else (lambda message: None)
