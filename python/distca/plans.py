"""Plans: distca.plan (one step's CA tasks, made by the C++ planners), the Plan it returns and the
LoadedPlan that load_plan reads back from a plan file, their tasks (TASK_DTYPE), and each rank's
exchange layout (RankLayout, VarlenGroup).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Union

import numpy as np

from . import _distca
from .arguments import excerpt, integer_arg, number_arg, path_arg, python_names, string_arg
from .batches import Batch, BatchLike, as_batch

# One row per CA task: attention of query rows [q0, q1) of document `doc` against keys [k0, k1)
# on `server`; causal when k1 == q1 (bottom-right aligned), else the keys lie wholly before the
# queries.
TASK_DTYPE = np.dtype([(name, np.int64) for name in ("doc", "q0", "q1", "k0", "k1", "server")])


def _tasks(matrix: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(matrix).view(TASK_DTYPE).reshape(-1)


@dataclass(frozen=True)
class VarlenGroup:
    """One flash_attn_varlen_func call: cu_seqlens from 0 over the group's rows."""
    cu_seqlens_q: np.ndarray
    cu_seqlens_k: np.ndarray
    max_seqlen_q: int
    max_seqlen_k: int

    @property
    def num_tasks(self) -> int:
        return len(self.cu_seqlens_q) - 1


@dataclass(frozen=True)
class RankLayout:
    """What rank `rank` needs to run CAD attention with all_to_all_single and varlen kernels.

    Forward, on every rank (R ranks, every index array int64):
      owner    q_send = q[q_send_index]; kv_send = kv[kv_send_index] (K and V alike)
      a2a      q_recv:  input splits q_send_splits,  output splits q_recv_splits
               kv_recv: input splits kv_send_splits, output splits kv_recv_splits
      server   q_var = q_recv[q_gather]; k_var = k_recv[kv_gather] (and v)
               causal call:     q_var[:causal_q_rows],  k_var[:causal_kv_rows], causal=True
                                (bottom-right aligned), with causal.cu_seqlens_q/k, max_seqlen_q/k
               non-causal call: q_var[causal_q_rows:], k_var[causal_kv_rows:], causal=False,
                                with noncausal.*
      return   out_send[q_gather] = o_var (and lse); a2a with the Q splits swapped
               (return_splits()), giving out_ret whose entry m answers q_send_index[m]
      owner    o[copy_rows] = out_ret[copy_entries]; the entries merge_entries are partial results
               of key-split rows merge_rows, merged per row by the LSE rule:
               lse = logsumexp(lse_m), o = sum_m exp(lse_m - lse) * o_m
    Backward: dO, and the merged O and LSE (a split row's softmax needs them), go out like Q;
    dq_send[q_gather] = dq_var returns like O and the owner sums: dq.index_add_(0, q_send_index,
    dq_ret); dk_recv.index_add_(0, kv_gather, dk_var) (fp32), back with the K/V splits swapped,
    and dk.index_add_(0, kv_send_index, dk_ret); dV the same.
    Rows a rank sends itself go through the all-to-all too (its own split).
    """
    rank: int
    num_ranks: int
    num_local_rows: int
    q_send_index: np.ndarray
    q_send_splits: np.ndarray
    kv_send_index: np.ndarray
    kv_send_splits: np.ndarray
    q_recv_splits: np.ndarray
    kv_recv_splits: np.ndarray
    q_gather: np.ndarray
    kv_gather: np.ndarray
    causal_q_rows: int
    causal_kv_rows: int
    causal: VarlenGroup
    noncausal: VarlenGroup
    copy_entries: np.ndarray
    copy_rows: np.ndarray
    merge_entries: np.ndarray
    merge_rows: np.ndarray

    def splits(self, phase: str) -> dict[str, tuple[list[int], list[int]]]:
        """(input_split_sizes, output_split_sizes) for all_to_all_single, per tensor of a phase:
        fwd_dispatch {q, kv}, fwd_return {out}, bwd_dispatch {q, kv} (kv only for a server that
        kept nothing from the forward), bwd_return {dq, dkv}."""
        q = (self.q_send_splits.tolist(), self.q_recv_splits.tolist())
        kv = (self.kv_send_splits.tolist(), self.kv_recv_splits.tolist())
        back = lambda s: (s[1], s[0])  # noqa: E731 (the reverse all-to-all)
        table = {
            "fwd_dispatch": {"q": q, "kv": kv},
            "fwd_return": {"out": back(q)},
            "bwd_dispatch": {"q": q, "kv": kv},
            "bwd_return": {"dq": back(q), "dkv": back(kv)},
        }
        if phase not in table:
            raise ValueError(f"phase must be one of {', '.join(table)}, got {phase!r}")
        return table[phase]

    def return_splits(self) -> tuple[list[int], list[int]]:
        return self.splits("fwd_return")["out"]

    @property
    def has_split_rows(self) -> bool:
        return len(self.merge_entries) > 0


def _layout(d: dict) -> RankLayout:
    causal, noncausal = VarlenGroup(**d.pop("causal")), VarlenGroup(**d.pop("noncausal"))
    return RankLayout(causal=causal, noncausal=noncausal, **d)


def _rank_layout(native: Any, num_ranks: int, rank: Any) -> RankLayout:
    r = integer_arg(rank, "rank")
    if not 0 <= r < num_ranks:
        raise ValueError(f"rank {r} outside the plan's {num_ranks} ranks")
    return _layout(native.layout(r))


class Plan:
    """One step's CA tasks on a batch, as `distca plan` makes them (immutable)."""

    def __init__(self, native: Any):
        self._native = native
        self._report: Optional[dict] = None

    # The plan itself.
    @property
    def policy(self) -> str:
        return self._native.policy

    @property
    def tolerance(self) -> float:
        """The eps the plan was made at (with tolerance="auto": the one picked)."""
        return self._native.tolerance

    @property
    def hash(self) -> int:
        """64-bit hash of the batch layout and the sorted task list (the same on every rank)."""
        return self._native.hash

    @property
    def batch(self) -> Batch:
        return self._native.batch

    @property
    def num_ranks(self) -> int:
        return self._native.batch.num_ranks

    @property
    def tasks(self) -> np.ndarray:
        """Structured array (TASK_DTYPE: doc, q0, q1, k0, k1, server), sorted by (server, doc, q0, k0)."""
        return _tasks(self._native.tasks())

    @property
    def server_seconds(self) -> np.ndarray:
        """(R) estimated core-attention seconds per step of each server (all layers, fwd + bwd)."""
        return self._native.server_seconds()

    @property
    def server_pairs(self) -> np.ndarray:
        """(R) causal (query, key) pairs each server computes."""
        return self._native.server_pairs()

    @property
    def load(self) -> dict:
        """max, mean, imbalance (max / mean seconds), pairs_imbalance."""
        return self._native.load()

    @property
    def traffic(self) -> dict:
        """Per phase (fwd_dispatch, fwd_return, bwd_dispatch, bwd_return): flows ((n, 3): src,
        dst, bytes), total_bytes, send_bytes (R), recv_bytes (R), for one layer (self rows not
        counted: they never leave the rank)."""
        return self._native.traffic()

    @property
    def is_balanced(self) -> bool:
        return self._native.is_balanced

    @property
    def note(self) -> str:
        return self._native.note

    @property
    def plan_ms(self) -> float:
        """The planner's own time, measured in C++."""
        return self._native.plan_ms

    @property
    def native_ms(self) -> float:
        """All of the call's C++ work, measured in C++: the checks, cost model, link and budget,
        and the planner. The report's extras (the colocated baseline, verification, per-layer
        times) are computed when report() is first called, not here."""
        return self._native.native_ms

    def report(self) -> dict:
        """The object `distca plan --batch FILE --json` prints for this policy (less the workload
        and seed it adds)."""
        if self._report is None:
            self._report = json.loads(self._native.report_json())
        return json.loads(json.dumps(self._report))

    def verify(self) -> bool:
        """Proves every causal (query, key) pair of every document is computed exactly once;
        raises ValueError naming the first violation."""
        self._native.verify()
        return True

    def to_json(self) -> str:
        """The plan file (format distca-plan, version 1) that `distca plan --out` writes."""
        return self._native.plan_json()

    @staticmethod
    def from_json(text: str) -> "LoadedPlan":
        return load_plan(text)

    def for_rank(self, rank: int) -> RankLayout:
        """Rank `rank`'s exchange layout (see RankLayout)."""
        return _rank_layout(self._native, self.num_ranks, rank)

    def __repr__(self) -> str:
        load = self.load
        return (f"<distca.Plan {self.policy}: {self.num_ranks} ranks, {len(self.tasks)} tasks, "
                f"imbalance {load['imbalance']:.4f}, hash {self.hash:016x}>")


@dataclass(frozen=True)
class LoadedPlan:
    """A plan file read back: its batch, policy, tolerance, model name, tasks; every field checked,
    the tasks re-verified and the hash re-checked. for_rank(rank) is what the Plan it was written
    from gives, so a plan made on one rank and broadcast as text drives the exchange on every rank."""
    batch: Batch
    policy: str
    tolerance: float
    hash: int
    tasks: np.ndarray
    model: str
    _native: Any = field(default=None, repr=False, compare=False)

    @property
    def num_ranks(self) -> int:
        return self.batch.num_ranks

    def for_rank(self, rank: int) -> RankLayout:
        """Rank `rank`'s exchange layout (see RankLayout), the same as Plan.for_rank's."""
        return _rank_layout(self._native, self.num_ranks, rank)


def load_plan(text: str) -> LoadedPlan:
    """Reads a plan file's text (Plan.to_json, distca plan --out). ValueError, one line naming the
    field, when anything is off: another format or version, a missing or unknown key, a value of
    the wrong type or out of range (policy not a planner's, tolerance outside [0, 1], a task on no
    rank of the batch), tasks that do not compute every pair once, a hash or derived figures that
    are not the tasks'."""
    native = _distca.load_plan_json(string_arg(text, "text"))
    return LoadedPlan(batch=native.batch, policy=native.policy, tolerance=native.tolerance, hash=native.hash,
                      tasks=_tasks(native.tasks()), model=native.model, _native=native)


def cpu_throughput_profile() -> dict:
    """The planner's CPU rates (flops_per_second, tile_rows, task_overhead_seconds, source): what
    `distca train` prices its CPU attention servers at, and plan(throughput="cpu")."""
    return dict(_distca.cpu_throughput_profile())


_THROUGHPUT_KEYS = ("flops_per_second", "tile_rows", "task_overhead_seconds")


def _throughput(throughput: Union[str, Mapping[str, Any]]) -> dict:
    if isinstance(throughput, str):
        if throughput != "cpu":
            raise ValueError(f"throughput must be None, 'cpu' or a dict of {', '.join(_THROUGHPUT_KEYS)}, got {throughput!r}")
        return cpu_throughput_profile()
    if not isinstance(throughput, Mapping):
        raise TypeError(f"throughput must be None, 'cpu' or a dict, got {type(throughput).__name__}")
    unknown = sorted(set(throughput) - set(_THROUGHPUT_KEYS) - {"source"})
    missing = [k for k in _THROUGHPUT_KEYS if k not in throughput]
    if unknown or missing:
        raise ValueError(f"throughput: {'unknown key ' + unknown[0] if unknown else 'missing key ' + missing[0]}; "
                         f"expected {', '.join(_THROUGHPUT_KEYS)}")
    out: dict[str, Any] = {"source": str(throughput.get("source", "given"))}
    for key in _THROUGHPUT_KEYS:
        name = f"throughput: {key}"
        out[key] = integer_arg(throughput[key], name) if key == "tile_rows" else number_arg(throughput[key], name)
    return out


_MODEL_KEYS = ("layers", "hidden", "heads", "kv_heads", "head_dim", "ffn_hidden", "dtype_bytes", "tp")


def plan(batch: BatchLike, policy: str = "minlink", tolerance: Union[float, str] = "auto", granularity: Optional[int] = None,
         model: Union[str, Mapping[str, Any]] = "llama-8b", max_rank_bytes: Union[int, str, None] = None,
         max_server_bytes: Union[int, str] = "auto", tokens_per_rank: int = 0, gpus_per_node: int = 8, profile: Union[str, os.PathLike, None] = None,
         throughput: Union[str, Mapping[str, Any], None] = None, grad_return: str = "fp32") -> Plan:
    """Plans core attention for one step, as `distca plan --batch ... --json` does.

    batch: per-rank document lengths ([[len, ...], ...] or {"ranks": [...]}, each rank at least one
      document), a batch file's path, or a Batch (distca.pack, distca.batch_from_pieces for
      documents that span ranks).
    policy: none, distca (the paper's planner), minmax, minbytes (the fewest bytes) or minlink (the
      default: the least busy links).
    tolerance: eps in [0, 1], or "auto" (the default): of eps = 0.2, 0.1, ..., 0.2/128, the one whose
      plan predicts the fastest step on `profile` (Plan.tolerance says which; Plan.report()'s
      "tolerance_auto" lists what was tried); granularity: a power of two 16..4096 (default 128; minmax and
      minbytes only); max_rank_bytes: bytes per rank per layer, or "auto" (default none);
      max_server_bytes: minmax, minbytes and minlink's cap on one layer's attention rows a server
      holds, bytes (0: none) or "auto" (the default: memory balanced as compute is where that is
      cheap; the report's "memory" gives the fullest server, docs/planners.md).
    model: a preset name (llama-8b, llama-34b), or a dict with any of layers, hidden, heads,
      kv_heads, head_dim, ffn_hidden, dtype_bytes, tp over the preset "preset" (default: custom,
      every shape key given).
    profile: a profile JSON file for the per-layer times in the report (default: built-in H200).
    throughput: the attention rates the planner prices tasks at: None (a GPU's: 400 TFLOP/s,
      128-row tiles, 2 us per task), "cpu" (cpu_throughput_profile(): what a CPU server costs,
      so short documents are not priced at a GPU tile's 128 rows), or a dict with
      flops_per_second, tile_rows, task_overhead_seconds.
    grad_return: "fp32" (the default, what the runtime and distca.torch send) or "bf16": the dtype
      the dK/dV partial sums return in, which the plan's bytes and link times count (`--grad-return`).
    """
    request = _distca.PlanRequest()
    request.policy = string_arg(policy, "policy")
    if isinstance(tolerance, str):
        if tolerance != "auto":
            raise TypeError(f"tolerance must be a number in [0, 1] or 'auto', got {excerpt(tolerance)}")
        request.tolerance = None
    else:
        request.tolerance = number_arg(tolerance, "tolerance")
    request.granularity = None if granularity is None else integer_arg(granularity, "granularity")
    if max_rank_bytes is None or isinstance(max_rank_bytes, str):
        request.max_rank_bytes = max_rank_bytes
    else:
        try:
            request.max_rank_bytes = str(integer_arg(max_rank_bytes, "max_rank_bytes"))
        except TypeError:
            raise TypeError(f"max_rank_bytes must be an integer (bytes), a string or None, "
                            f"got {excerpt(max_rank_bytes)}") from None
    if isinstance(max_server_bytes, str):
        if max_server_bytes != "auto":
            raise TypeError(f"max_server_bytes must be an integer (bytes, 0 = no cap) or 'auto', got {excerpt(max_server_bytes)}")
        request.max_server_bytes = None  # the default: auto
    else:
        request.max_server_bytes = str(integer_arg(max_server_bytes, "max_server_bytes"))
    request.gpus_per_node = integer_arg(gpus_per_node, "gpus_per_node", 32)
    if isinstance(model, str):
        request.model = model
    elif isinstance(model, Mapping):
        unknown = sorted(set(model) - set(_MODEL_KEYS) - {"preset"}, key=str)
        if unknown:
            raise ValueError(f"model: unknown key(s) {', '.join(map(excerpt, unknown))}; "
                             f"expected preset or {', '.join(_MODEL_KEYS)}")
        request.model = string_arg(model.get("preset", "custom"), "model['preset']")
        for key in _MODEL_KEYS:
            if key in model:
                setattr(request, key, integer_arg(model[key], f"model['{key}']", 32))
    else:
        raise ValueError(f"model must be a preset name or a dict of shape keys, got {type(model).__name__}")
    request.grad_return = string_arg(grad_return, "grad_return")   # checked with the CLI's words
    if throughput is not None:
        t = _throughput(throughput)
        request.set_throughput(t["flops_per_second"], t["tile_rows"], t["task_overhead_seconds"], t["source"])
    profile_path = "" if profile is None else path_arg(profile, "profile")
    native_batch = as_batch(batch, tokens_per_rank)
    try:
        return Plan(_distca.make_plan(native_batch, request, profile_path))
    except ValueError as e:
        raise ValueError(python_names(str(e))) from None
