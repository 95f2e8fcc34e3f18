"""Device meshes of worker groups: how a group's ranks split into data, context, tensor and pipeline parallel groups.

A group of N = DP x PP x CP x TP workers (Megatron's rank order: tensor parallel fastest, then context, then data,
then pipeline) receives data by data-parallel rank only: the ranks of one model replica (its TP x CP x PP ranks)
all get the same rows (context-parallel ranks then take their own part of each sequence). Results come back from
the ranks that hold them: the first tensor- and context-parallel rank of the last pipeline stage of each replica,
concatenated in data-parallel order. A plain data-parallel group is the mesh (DP=N, TP=PP=CP=1).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mesh:
    """Sizes of the parallel dimensions; `world_size = dp * pp * cp * tp`."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1

    def __post_init__(self) -> None:
        if min(self.dp, self.tp, self.pp, self.cp) < 1:
            raise ValueError(f"mesh sizes must be >= 1, got dp={self.dp} tp={self.tp} pp={self.pp} cp={self.cp}")

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @classmethod
    def for_world(cls, world_size: int, tp: int = 1, pp: int = 1, cp: int = 1) -> Mesh:
        """The mesh of `world_size` ranks with the given TP, PP and CP sizes (DP is what remains)."""
        if world_size % (tp * pp * cp):
            raise ValueError(
                f"world_size={world_size} is not a multiple of tensor_parallel_size x pipeline_parallel_size x "
                f"context_parallel_size = {tp} x {pp} x {cp}: choose sizes whose product divides the number of workers"
            )
        return cls(dp=world_size // (tp * pp * cp), tp=tp, pp=pp, cp=cp)

    def coords(self, rank: int) -> tuple[int, int, int, int]:
        """(dp, pp, cp, tp) indices of `rank`."""
        if not 0 <= rank < self.world_size:
            raise IndexError(f"rank {rank} outside a mesh of {self.world_size}")
        tp = rank % self.tp
        cp = (rank // self.tp) % self.cp
        dp = (rank // (self.tp * self.cp)) % self.dp
        pp = rank // (self.tp * self.cp * self.dp)
        return dp, pp, cp, tp

    def dp_rank(self, rank: int) -> int:
        return self.coords(rank)[0]

    def is_output(self, rank: int) -> bool:
        """Whether `rank` returns its replica's results (first TP and CP rank of the last pipeline stage)."""
        _, pp, cp, tp = self.coords(rank)
        return tp == 0 and cp == 0 and pp == self.pp - 1

    def output_ranks(self) -> list[int]:
        """The output rank of each replica, in data-parallel order."""
        out = {self.dp_rank(r): r for r in range(self.world_size) if self.is_output(r)}
        return [out[d] for d in range(self.dp)]
