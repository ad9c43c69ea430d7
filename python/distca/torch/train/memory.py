"""What a training step holds in memory (distca.torch.train): each rank's peak, in parts that add
up, for both backends.

The parts, per backend (colocated and CAD each hold their own model and optimizer):
  - states: the parameters, their gradients and the optimizer's state tensors (AdamW: two moments);
  - saved: the peak over the step of the bytes the autograd graph keeps for backward, counted with
    saved-tensor hooks: every storage once however many saved tensors view it, a parameter's
    storage not at all (it is in states). CAD's stateful backward saves what its server computed
    on (the received Q/K/V, O and LSE), so a server's extra rows are in this part;
  - exchange: the exchanges' static receive buffers (StepPlanner(static_buffers=True)), 0 when
    the exchanges receive into tensors of their own (then those are counted where saved).
Not counted: transient tensors (a layer's send buffers, the kernels' workspaces) and the
interpreter itself. Each part is taken at its own peak in the step (the gradients at full size,
though they grow as the saved bytes are let go), so the sum is at or above the step's true peak
of what it counts, counted the same way for both backends. The cross-check is the process's peak
RSS (one figure for the whole run: both backends and everything else in the process), reported
beside. On CUDA the total is torch.cuda.max_memory_allocated over the step, which counts every
tensor; the parts stay as counted and the rest is `other` (not yet validated on a GPU).
"""
from __future__ import annotations

import resource
import sys
from typing import Iterable

import torch

MEMORY_PARTS = ("states", "saved", "exchange", "other")


class _Held:
    """A saved tensor in the graph's keeping; its storage's count drops when the graph lets it go."""
    __slots__ = ("tensor", "_owner", "_key")

    def __init__(self, owner: "SavedBytes", key: tuple, tensor: torch.Tensor):
        self.tensor, self._owner, self._key = tensor, owner, key

    def __del__(self):
        self._owner._release(self._key)


class SavedBytes:
    """Live bytes of the storages the autograd graph saves, and their peak since reset_peak().
    Use `with counter.hooks():` around the forward (and the pipeline schedule's step)."""

    def __init__(self, exclude: Iterable[torch.Tensor] = ()):
        self._exclude = {_key(t) for t in exclude}
        self._counts: dict = {}   # storage key -> [saved tensors holding it, bytes]
        self.live = 0
        self.peak = 0

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)

    def reset_peak(self) -> None:
        self.peak = self.live

    def _pack(self, t: torch.Tensor):
        key = _key(t)
        if key in self._exclude or key[1] == 0:
            return t
        entry = self._counts.get(key)
        if entry is None:
            nbytes = t.untyped_storage().nbytes()
            self._counts[key] = [1, nbytes]
            self.live += nbytes
            self.peak = max(self.peak, self.live)
        else:
            entry[0] += 1
        return _Held(self, key, t)

    def _release(self, key: tuple) -> None:
        entry = self._counts.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            self.live -= entry[1]
            del self._counts[key]


def _key(t: torch.Tensor) -> tuple:
    return (str(t.device), t.untyped_storage().data_ptr())


def _unpack(held):
    return held.tensor if isinstance(held, _Held) else held


def states_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Parameters, their gradients at full size (they exist from the backward to the optimizer's
    step) and the optimizer's state tensors (none before its first step)."""
    total = 0
    for p in model.parameters():
        total += p.numel() * p.element_size() * (2 if p.requires_grad else 1)
    for state in optimizer.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                total += v.numel() * v.element_size()
    return total


def buffer_bytes(planner) -> int:
    """The planner's static receive buffers (0 without static_buffers)."""
    buffers = getattr(planner, "buffers", None)
    return int(buffers.nbytes) if buffers is not None else 0


def step_memory(states: int, saved: int, exchange: int, device: torch.device) -> dict:
    """One rank's memory in a step, parts adding up to the total."""
    parts = {"states": int(states), "saved": int(saved), "exchange": int(exchange), "other": 0}
    if device.type == "cuda":
        peak = int(torch.cuda.max_memory_allocated(device))
        parts["other"] = max(peak - sum(parts.values()), 0)
    return {**{f"memory_{k}_bytes": v for k, v in parts.items()}, "memory_bytes": sum(parts.values())}


def reset_device_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_rss_bytes() -> int:
    """The process's peak resident set since it began (ru_maxrss: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def summary(records: list) -> dict:
    """Over a backend's step records: the fullest rank's peak over the run, and the largest
    max/mean over ranks in a step."""
    fullest, ratio = 0, 1.0
    for r in records:
        m = r["memory"]
        fullest = max(fullest, m["max_bytes"])
        ratio = max(ratio, m["max_over_mean"])
    return {"memory_max_bytes": fullest, "memory_max_over_mean": ratio}


def record(per_rank: dict) -> dict:
    """A step record's memory part from every rank's figures (gathered)."""
    totals = per_rank["memory_bytes"]
    mean = sum(totals) / len(totals)
    fullest = max(range(len(totals)), key=lambda r: totals[r])
    return {"max_bytes": int(totals[fullest]), "mean_bytes": mean, "fullest_rank": fullest,
            "max_over_mean": totals[fullest] / mean if mean > 0 else 1.0,
            "fullest_parts": {k: int(per_rank[f"memory_{k}_bytes"][fullest]) for k in MEMORY_PARTS}}
