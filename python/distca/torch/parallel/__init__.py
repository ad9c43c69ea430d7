"""distca.torch in three dimensions: data, pipeline and tensor parallelism around CAD.

    ranks       RankMap and RankGroups: the tp, dp, pp and CAD groups of a rank from one rank map
                (the C++ trainer's order: world rank w = (stage * dp + replica) * tp + tp_index)
    schedule    ScheduleCADLockstep: a torch.distributed.pipelining schedule that walks distca's
                lockstep tick table, plans every tick over the CAD group and lets idle stages serve
"""
from .ranks import RankGroups, RankMap
from .schedule import ScheduleCADLockstep, TickRecord

__all__ = ["RankMap", "RankGroups", "ScheduleCADLockstep", "TickRecord"]
