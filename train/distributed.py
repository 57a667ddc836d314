"""Data-parallel LoRA training over `mx.distributed` (what mlx-lm's trainer does).

Launch the same command on every rank (``mlx.launch -n N [--backend ring|mpi|nccl]
engine-train ...``). Every rank holds the whole model and walks the same batch
order; each takes every N-th example of each batch (rank r: rows r, r+N, ...
of the length-sorted batch, so ``batch_size`` must divide by N). Gradients are
summed over the ranks and divided by N (MLX's ``average_gradients``) at each
optimiser update, before the gradient-accumulation division, so all ranks apply
the same update and stay identical. Validation splits its batches the same way
and sums loss and token counts over the ranks; the reported train loss is the
mean over ranks. Only rank 0 logs and writes files.

Outside a launch the group has one rank and every method here is the identity,
so single-process training is unchanged bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
from mlx.nn.utils import average_gradients


@dataclass(frozen=True)
class DataParallel:
    group: mx.distributed.Group

    @property
    def size(self) -> int:
        return self.group.size()

    @property
    def rank(self) -> int:
        return self.group.rank()

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def check_batch_size(self, batch_size: int):
        if batch_size % self.size:
            raise ValueError(f"batch size {batch_size} does not divide over {self.size} ranks "
                             f"(each rank takes batch_size / ranks examples)")

    def shard_batches(self, iterator):
        """Keep this rank's rows of every batch of a `train.data.BatchIterator`."""
        if self.size == 1:
            return iterator
        self.check_batch_size(iterator.bs)
        iterator.batches = [b[self.rank::self.size] for b in iterator.batches]
        return iterator

    def average(self, grads):
        """Gradients averaged over the ranks (inside the compiled step, as mlx-lm does)."""
        return grads if self.size == 1 else average_gradients(grads, group=self.group)

    def sum(self, x):
        """`x` summed over the ranks (counters and losses for reports)."""
        if self.size == 1:
            return x
        return mx.distributed.all_sum(x, group=self.group, stream=mx.cpu)


def data_parallel(group: Optional[mx.distributed.Group] = None) -> DataParallel:
    """The data-parallel view of `group` (default: the launched world, or one rank)."""
    return DataParallel(group if group is not None else mx.distributed.init())


def silent(*_args, **_kwargs):
    """The logger of ranks other than 0."""
