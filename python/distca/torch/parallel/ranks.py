"""The rank map of a (tp, pp, dp) run and the process groups each rank joins, as the C++ trainer
makes them (src/train/include/distca/train/tensor_parallel.h):

    world rank w = (stage * dp + replica) * tp + tp_index

the tensor-parallel group innermost (adjacent ranks: one node in a real cluster), then the
data-parallel replicas of a stage, then the stages. A rank joins four groups:

    tp    the same stage and replica: the model's heads and FFN columns split over it
    dp    the same stage and TP index: gradients all-reduced over it
    pp    the same replica and TP index: activations and their gradients pass along it
    cad   the same TP index: CAD's attention servers; TP index i's head slice goes only to ranks
          of TP index i (the paper's CAD with TP)

    groups = RankGroups.make(pp=2, tp=1)      # collective over the world: every rank calls it
    groups.me.stage, groups.pp, groups.cad    # this rank's coordinates and groups
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist


@dataclass(frozen=True)
class RankCoords:
    tp: int       # TP index
    stage: int    # pipeline stage
    replica: int  # data-parallel replica


@dataclass(frozen=True)
class RankMap:
    """Group sizes; world = tp * pp * dp."""
    tp: int
    pp: int
    dp: int

    @staticmethod
    def of(world: int, *, tp: int = 1, pp: int = 1) -> "RankMap":
        """The map of `world` ranks with tp x pp ranks per replica (DP = world / (pp x tp));
        ValueError naming what does not divide."""
        for name, value in (("tp", tp), ("pp", pp), ("world", world)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if world % (tp * pp):
            raise ValueError(f"the world's {world} ranks do not split into replicas of pp {pp} x tp {tp} = "
                             f"{tp * pp} ranks (DP = world / (pp x tp))")
        return RankMap(tp, pp, world // (tp * pp))

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    def coords(self, rank: int) -> RankCoords:
        return RankCoords(rank % self.tp, rank // (self.tp * self.dp), (rank // self.tp) % self.dp)

    def rank(self, c: RankCoords) -> int:
        return (c.stage * self.dp + c.replica) * self.tp + c.tp

    def tp_ranks(self, rank: int) -> list:
        c = self.coords(rank)
        return [self.rank(RankCoords(i, c.stage, c.replica)) for i in range(self.tp)]

    def dp_ranks(self, rank: int) -> list:
        c = self.coords(rank)
        return [self.rank(RankCoords(c.tp, c.stage, r)) for r in range(self.dp)]

    def pp_ranks(self, rank: int) -> list:
        c = self.coords(rank)
        return [self.rank(RankCoords(c.tp, s, c.replica)) for s in range(self.pp)]

    def cad_ranks(self, rank: int) -> list:
        """Every stage and replica of this TP index, in world-rank order."""
        c = self.coords(rank)
        return [w for w in range(self.world) if self.coords(w).tp == c.tp]

    def describe(self, rank: int) -> str:
        """"rank 3: tp 1, stage 0, replica 1; tp [2, 3], dp [1, 3], pp [3], cad [1, 3]"."""
        c = self.coords(rank)
        return (f"rank {rank}: tp {c.tp}, stage {c.stage}, replica {c.replica}; tp {self.tp_ranks(rank)}, "
                f"dp {self.dp_ranks(rank)}, pp {self.pp_ranks(rank)}, cad {self.cad_ranks(rank)}")

    def to_dict(self) -> dict:
        return {"tp": self.tp, "pp": self.pp, "dp": self.dp,
                "ranks": [dict(rank=w, **vars(self.coords(w))) for w in range(self.world)]}


@dataclass
class RankGroups:
    """This rank's place in the map and its four gloo (or the world's backend) groups."""
    map: RankMap
    rank: int
    me: RankCoords
    tp: Any
    dp: Any
    pp: Any
    cad: Any

    @staticmethod
    def make(*, tp: int = 1, pp: int = 1, backend: Any = None, timeout: Any = None) -> "RankGroups":
        """Collective over the default group (every rank calls it, as new_group needs): the map of
        the world and every group of it, this rank's kept. backend: the groups' (default the
        world's)."""
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("RankGroups.make needs torch.distributed initialised (dist.init_process_group)")
        world, rank = dist.get_world_size(), dist.get_rank()
        m = RankMap.of(world, tp=tp, pp=pp)
        mine: dict = {}
        # Every rank creates every group, in one order (new_group is collective over the world).
        for kind, ranks_of in (("tp", m.tp_ranks), ("dp", m.dp_ranks), ("pp", m.pp_ranks), ("cad", m.cad_ranks)):
            seen: list = []
            for w in range(world):
                ranks = ranks_of(w)
                if ranks in seen:
                    continue
                seen.append(ranks)
                group = dist.new_group(ranks, backend=backend, **({} if timeout is None else {"timeout": timeout}))
                if rank in ranks:
                    mine[kind] = group
        return RankGroups(m, rank, m.coords(rank), mine["tp"], mine["dp"], mine["pp"], mine["cad"])

    def destroy(self) -> None:
        """Lets go of the four groups (dist.destroy_process_group on each)."""
        for kind in ("tp", "dp", "pp", "cad"):
            group = getattr(self, kind)
            if group is not None:
                dist.destroy_process_group(group)
                setattr(self, kind, None)
