"""distca.torch in three dimensions: data, pipeline and tensor parallelism around CAD.

    ranks       RankMap and RankGroups: the tp, dp, pp and CAD groups of a rank from one rank map
                (the C++ trainer's order: world rank w = (stage * dp + replica) * tp + tp_index)
    tensor      tensor parallelism by head group: shard_model, plan_tp (the plan's hash checked over
                the TP group), full_state_dict
    schedule    ScheduleCADLockstep: a torch.distributed.pipelining schedule that walks distca's
                lockstep tick table, plans every tick over the CAD group and lets idle stages serve
"""
from .ranks import RankGroups, RankMap
from .schedule import ScheduleCADLockstep, TickRecord
from .tensor import check_tp_plan, full_state_dict, plan_tp, shard_model

__all__ = ["RankMap", "RankGroups", "ScheduleCADLockstep", "TickRecord", "shard_model", "plan_tp", "check_tp_plan",
           "full_state_dict"]
