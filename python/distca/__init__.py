"""distca: core attention disaggregation (CAD) planning for PyTorch training loops.

A thin layer over distca's C++ planners, verifier, exchange layouts and cluster simulator (the
same code as the ``distca`` command line, so the same plans, figures and error messages):

    import distca
    plan = distca.plan([[8192, 512, 512], [1024] * 9], policy="minbytes", model="llama-8b")
    plan.load["imbalance"], plan.tasks["server"]      # NumPy arrays and plain numbers
    meta = plan.for_rank(rank)                        # what rank `rank` gathers, sends, computes
    report = distca.simulate(gpus=64, tp=8, context="128K")

Bad input raises ValueError with the command line's message, and an argument of the wrong type
TypeError naming it (an integer argument takes a Python or NumPy integer: never a bool, a float,
even 128.0, or a string); see docs/python.md.
"""
from __future__ import annotations

from . import _distca
from . import knobs  # noqa: F401  (its import warns once of DISTCA_* variables the table does not know)
from . import profile
# The package's modules: argument checks (arguments), batches (batches), plans and their layouts
# (plans), pipeline tick tables (schedules), the simulator (simulation); their public names are distca's.
from .arguments import python_names  # noqa: F401
from .batches import Batch, BatchLike, batch_from_pieces, pack  # noqa: F401
from .plans import (TASK_DTYPE, LoadedPlan, Plan, RankLayout, VarlenGroup, cpu_throughput_profile,  # noqa: F401
                    load_plan, plan)
from .schedules import PipelineSchedule, pipeline_schedule  # noqa: F401
from .simulation import simulate  # noqa: F401

__all__ = [
    "Batch", "Plan", "RankLayout", "VarlenGroup", "plan", "load_plan", "pack", "batch_from_pieces",
    "simulate", "pipeline_schedule", "PipelineSchedule", "profile", "planner_names", "cpu_throughput_profile", "model_preset_names", "system_names", "TASK_DTYPE",
]

__version__ = "0.1.0"


def planner_names() -> list[str]:
    """The policies: none, distca, minmax, minbytes, minlink."""
    return list(_distca.planner_names())


def model_preset_names() -> list[str]:
    return list(_distca.model_preset_names())


def system_names() -> list[str]:
    return list(_distca.system_names())
