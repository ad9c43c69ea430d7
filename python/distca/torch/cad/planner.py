"""Planning per step over a process group, and the step layout every attention layer reuses.

    planner = StepPlanner(group, model={"heads": 32, "kv_heads": 8, "head_dim": 128})
    layout = planner.plan(cu_seqlens)          # collective: every rank of the group calls it
    o = cad_attention(q, k, v, layout)         # in every layer, forward and backward

`plan` gathers every rank's documents over the group, plans once in C++ (the same plan on every
rank: the hash is checked), and builds this rank's exchange layout as device tensors: gather and
scatter indices, split sizes, the server's task groups, merge maps, and each row's absolute
position in its document (for RoPE). With ping-pong the plan's tasks are split into two
nano-batches, each with its own layout (the plan is not remade: both halves run the plan's tasks,
a few of them cut in two at a query row; distca.torch.cad.nanobatch).

Identity and agreement. A layout is named by (planner_id, serial): planner_id is the same on
every rank (a hash of the planner's settings, its group's ranks and its ordinal among this
process's planners over those ranks), serial counts that planner's plan/plan_async calls, given
in call order in the caller's thread. Every public collective call (plan, plan_async,
cad_attention with check_inputs) checks its arguments locally and then starts with one call
header on the planner's gloo control group: an all_gather of [call, planner_id, serial, error]
(int64). Every call's first collective has that one shape, so ranks in different calls, or with
bad input on one rank, all see every header and raise the same InputError instead of waiting in
mismatched collectives.

Process groups. A planner holds its groups (and its layouts theirs) until close(), and a planner
or layout still alive at exit lets go of them then (release_groups, registered with atexit): a
gloo group that something still references after dist.destroy_process_group() keeps its worker
threads running into the interpreter's teardown, where one that takes the GIL to free a finished
all-to-all's tensor is ended by Python inside C++, and the process aborts ("terminate called
without an active exception", SIGABRT: a script that finished reports failure). Let go, the group
is freed there, joining its threads while the interpreter is whole.

This module holds StepPlanner and its planning; the layout itself (StepLayout, rank_layout) is in
layout, the nano-batch split (split_tasks) in nanobatch, and the call header (call_header,
InputError, agree) in agreement.
"""
from __future__ import annotations

import atexit
import concurrent.futures
import hashlib
import json
import os
import time
import weakref
from collections.abc import Sequence as SequenceABC
from typing import Any, Mapping, Optional, Sequence, Union

import numpy as np
import torch
import torch.distributed as dist

import distca

from ..kernels.backends import describe_auto, get_backend
from .agreement import CALL_FINISH, CALL_NAMES, CALL_PLAN, CALL_PLAN_ASYNC, InputError, call_header, describe, error_message
from .buffers import ExchangeBuffers
from .layout import ModelShape, StepLayout, rank_layout

# Planners constructed in this process per tuple of their group's (global) ranks: a planner's
# ordinal among those over the same ranks, the same on every rank when every rank constructs its
# planners in the same order (as valid use requires), goes into its planner_id.
_PLANNER_COUNTS: dict = {}
# Weak references to this process's planners, oldest first: a rank whose cad_attention gets no
# planner's layout agrees over the newest live planner's control group.
_PLANNERS: list = []
# Every live planner and planned layout, by id(): what release_groups lets go of at exit (a
# layout, a dataclass, is not hashable, so not a WeakSet).
_GROUP_HOLDERS: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()


GRAD_RETURNS = ("fp32", "bf16")   # StepPlanner's grad_return (attention.GRAD_RETURN_DTYPES)
_MODEL_SHAPE_KEYS = {"heads": "num_q_heads", "kv_heads": "num_kv_heads", "head_dim": "head_dim"}


def _model_shape(model: Union[str, Mapping[str, Any]]) -> ModelShape:
    if isinstance(model, str):
        presets = {"llama-8b": (32, 8, 128), "llama-34b": (64, 8, 128)}
        if model not in presets:
            raise ValueError(f"model: a preset ({', '.join(presets)}) or a dict with heads, kv_heads, head_dim; "
                             f"got {model!r}")
        return ModelShape(*presets[model])
    if not isinstance(model, Mapping):
        raise TypeError(f"model must be a preset name or a dict, got {type(model).__name__}")
    missing = [k for k in _MODEL_SHAPE_KEYS if k not in model]
    if missing and "preset" not in model:
        raise ValueError(f"model: missing {', '.join(missing)} (the attention shape cad_attention checks)")
    base = _model_shape(model["preset"]) if "preset" in model else None
    values = {}
    for key, attr in _MODEL_SHAPE_KEYS.items():
        value = model.get(key, getattr(base, attr) if base else None)
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
            raise ValueError(f"model: {key} must be a positive integer, got {value!r}")
        values[attr] = int(value)
    if values["num_q_heads"] % values["num_kv_heads"]:
        raise ValueError(f"model: heads ({values['num_q_heads']}) must be a multiple of kv_heads "
                         f"({values['num_kv_heads']})")
    return ModelShape(**values)


def _planner_model(model: Union[str, Mapping[str, Any]]) -> Union[str, dict]:
    """The model argument for distca.plan: shape keys filled in so a dict plans without a preset."""
    if isinstance(model, str):
        return model
    d = dict(model)
    if "preset" not in d:
        shape = _model_shape(d)
        hidden = shape.num_q_heads * shape.head_dim
        d.setdefault("layers", 1)
        d.setdefault("hidden", hidden)
        d.setdefault("ffn_hidden", 4 * hidden)
    return d


def _as_int_list(x: Any, what: str) -> list:
    """A sequence (list, tuple, range), 1-d tensor or 1-d array of integers -> list of ints; a
    mapping, a string, a set or another iterable is refused (TypeError)."""
    if isinstance(x, torch.Tensor):
        if x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
            raise TypeError(f"{what} must hold integers, got a {x.dtype} tensor")
        if x.dim() != 1:
            raise ValueError(f"{what} must be one-dimensional, got a tensor of shape {tuple(x.shape)}")
        x = x.detach().cpu().tolist()
    elif isinstance(x, np.ndarray):
        if x.dtype.kind not in "iu":
            raise TypeError(f"{what} must hold integers, got a {x.dtype} array")
        if x.ndim != 1:
            raise ValueError(f"{what} must be one-dimensional, got an array of shape {x.shape}")
        x = x.tolist()
    elif isinstance(x, (str, bytes)) or not isinstance(x, SequenceABC):
        raise TypeError(f"{what} must be a sequence (list, tuple), tensor or array of integers, got {describe(x)}")
    out = []
    for v in x:
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise TypeError(f"{what} must hold integers, got {describe(v)}")
        out.append(int(v))
    return out


def _local_pieces(rank: int, cu_seqlens: Any, pieces: Any) -> list:
    """This rank's pieces as (doc_key, begin, end, doc_length) rows, checked."""
    if (cu_seqlens is None) == (pieces is None):
        raise ValueError("pass cu_seqlens (this rank's whole documents) or pieces (documents that span ranks), "
                         "exactly one")
    if cu_seqlens is not None:
        cu = _as_int_list(cu_seqlens, "cu_seqlens")
        if not cu or cu[0] != 0:
            raise ValueError(f"cu_seqlens must start at 0 ([0] for a rank with no rows this step), got {cu[:8]}")
        lengths = [b - a for a, b in zip(cu, cu[1:])]
        bad = next((i for i, n in enumerate(lengths) if n <= 0), None)
        if bad is not None:
            raise ValueError(f"cu_seqlens must increase strictly: document {bad} (cu_seqlens[{bad}] = {cu[bad]} to "
                             f"cu_seqlens[{bad + 1}] = {cu[bad + 1]}) has length {lengths[bad]}")
        return [((rank, i), 0, n, n) for i, n in enumerate(lengths)]
    if isinstance(pieces, torch.Tensor):
        pieces = pieces.detach().cpu().tolist()
    elif isinstance(pieces, np.ndarray):
        pieces = list(pieces)
    elif isinstance(pieces, (str, bytes)) or not isinstance(pieces, SequenceABC):
        raise TypeError(f"pieces must be a sequence of (doc_key, begin, end, doc_length) rows, got {describe(pieces)}")
    rows = []
    for i, p in enumerate(pieces):
        if isinstance(p, (str, bytes, Mapping)) or not isinstance(p, (SequenceABC, np.ndarray)):
            raise TypeError(f"pieces[{i}] must be a row (doc_key, begin, end, doc_length), got {describe(p)}")
        p = tuple(p)
        if len(p) != 4:
            raise ValueError(f"pieces[{i}] must be (doc_key, begin, end, doc_length), got {p!r}")
        key, begin, end, length = p
        begin, end, length = _as_int_list([begin, end, length], f"pieces[{i}] begin, end, doc_length")
        if not 0 <= begin < end <= length:
            raise ValueError(f"pieces[{i}]: need 0 <= begin < end <= doc_length, got {begin}, {end}, {length}")
        if isinstance(key, torch.Tensor):
            key = key.item()
        try:
            hash(key)
        except TypeError:
            raise TypeError(f"pieces[{i}]: the document key must be hashable (an int or str), got {type(key).__name__}")
        rows.append((("key", key), begin, end, length))
    return rows


def _global_batch(gathered: list) -> tuple:
    """Every rank's pieces -> (Batch, per-rank pieces with global doc ids)."""
    doc_ids: dict = {}
    lengths: list = []
    rows = []
    for rank, pieces in enumerate(gathered):
        for key, begin, end, length in pieces:
            if key not in doc_ids:
                doc_ids[key] = len(lengths)
                lengths.append(length)
            doc = doc_ids[key]
            if lengths[doc] != length:
                raise ValueError(f"document {key[1]!r}: rank {rank} says its length is {length}, another rank "
                                 f"{lengths[doc]}")
            rows.append((doc, begin, end, rank))
    if not rows:
        raise ValueError("no rank holds a token this step: at least one rank needs rows to plan "
                         "(a rank with none serves the others)")
    batch = distca.batch_from_pieces(lengths, np.asarray(rows, dtype=np.int64).reshape(-1, 4),
                                     num_ranks=len(gathered))
    return batch, rows


def latest_planner() -> Optional["StepPlanner"]:
    """This process's most recently constructed planner that is still alive and open, or None."""
    while _PLANNERS:
        planner = _PLANNERS[-1]()
        if planner is not None and not planner.closed:
            return planner
        _PLANNERS.pop()
    return None


def release_groups() -> None:
    """Every planner of this process is closed and every layout it made lets go of its process
    groups (see "Process groups" in the module docstring). Registered with atexit, so a script
    whose planner outlives dist.destroy_process_group() (one at module level) still exits cleanly;
    calling it earlier ends every planner and layout of the process."""
    for holder in list(_GROUP_HOLDERS.values()):
        if isinstance(holder, StepPlanner):
            holder.close()
        else:
            holder.group = holder.control_group = None
    _GROUP_HOLDERS.clear()


atexit.register(release_groups)


def _memory_limit(device: torch.device) -> tuple:
    """(bytes, what they are) that no buffer on `device` can exceed: the GPU's memory, this
    machine's memory on CPU, or 1 TiB where neither is known."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory, f"the memory of {device}"
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        if total > 0:
            return total, "this machine's memory"
    except (AttributeError, OSError, ValueError):
        pass
    return 1 << 40, "1 TiB"


class StepPlanner:
    """Plans CAD for every step of a process group (see the module docstring).

    group: the process group whose ranks exchange attention (default: the world). With NCCL, a
      gloo group over the same ranks carries the planning metadata and the input checks
      (constructing the planner is then collective over the default group, as new_group is).
    model: a preset name (llama-8b, llama-34b) or a dict with heads, kv_heads, head_dim (and any
      of distca.plan's shape keys): the attention shape of this rank's q/k/v, which cad_attention
      checks its inputs against, and by default what the planner prices.
    cost_model: what the planner prices, when it differs from `model` (a preset or distca.plan's
      model dict): e.g. the whole model with a `tp` key while each rank's layer holds heads / tp.
    policy, tolerance, granularity, max_rank_bytes, profile: as distca.plan.
    throughput: the rates the planner prices attention tasks at, as distca.plan; "auto" (default):
      "cpu" on a CPU device (PyTorch's CPU kernels, where a short document costs what its rows
      cost), the GPU default on CUDA.
    pingpong: "auto" (on for CUDA, where the exchanges overlap compute on NCCL's stream; off on
      CPU), True or False: split each step's tasks into two nano-batches.
    backward: "stateful" (servers keep Q/K/V from the forward) or "stateless" (the backward sends
      them again: less memory on servers, more bytes).
    state_budget: with the stateful backward, the bytes a rank's servers may keep over a step
      beyond what the stateless backward keeps there (the owner's own Q/K/V): the servers keep
      their Q/K/V in as many of the step's cad_attention calls (layers) as that holds on the
      fullest rank, and the rest go stateless (StepLayout.keeps_state). 0 (the default): stateful
      only where no rank's servers hold more rows than it owns, so no rank keeps more than
      colocated attention would; None: every call stateful, whatever it holds.
    grad_return: the dtype the servers' dK/dV partial sums travel in on the backward return:
      "fp32" (default, for every input dtype) or "bf16" (each travelling partial sum rounded to
      bf16, half that phase's dK/dV bytes, summed in fp32 at the owner as the paper does; the rows
      a rank serves itself are not rounded).
    backend: the server kernel cad_attention uses by default ("auto", "reference", "sdpa",
      "varlen", "flash_attn").
    check_inputs: cad_attention checks its arguments (shapes, dtypes, devices, scale, backend)
      and the layout's step, and starts with the call header (one all_gather of 4 int64 per rank
      over the gloo control group), so bad input on one rank, or ranks in different calls, raise
      the same InputError on all; False skips the header (local checks only: then a rank's bad
      input, or a rank in another call, leaves the others waiting in the exchange).
    prefetch: plan_async() plans a later step on a background thread (its collectives run on a
      gloo group of their own); plan() then goes through that thread too (plan() is
      plan_async().result()), so the planning collectives run in call order.
    static_buffers: receive the exchanges into buffers allocated once (at `buffer_capacity` bytes
      per slot, or grown to the largest step seen) and reused by every layer and step, so the
      exchanges allocate nothing in steady state (planner.buffers counts the allocations).
    host_staging: for testing only: CUDA tensors over a gloo group, each exchange copied to host
      memory, moved by gloo and copied back (slow, synchronous copies). Several processes can then
      share one GPU, which NCCL refuses; the kernels still run on the GPU.

    Every rank constructs its planners in the same order and makes the same calls (plan,
    plan_async, cad_attention) in the same order; planner_id, the same on every rank, names the
    planner in its layouts (see the module docstring). Calls come from one thread.
    """

    def __init__(self, group: Any = None, *, model: Union[str, Mapping[str, Any]],
                 cost_model: Union[str, Mapping[str, Any], None] = None, policy: str = "minlink",
                 tolerance: Union[float, str] = "auto", granularity: Optional[int] = None,
                 max_rank_bytes: Union[int, str, None] = None, pingpong: Union[str, bool] = "auto",
                 backward: str = "stateful", state_budget: Optional[int] = 0, grad_return: str = "fp32",
                 backend: str = "auto",
                 device: Union[str, torch.device, None] = None,
                 check_inputs: bool = True, prefetch: bool = False, profile: Optional[str] = None,
                 static_buffers: bool = False, buffer_capacity: int = 0,
                 throughput: Union[str, Mapping[str, Any], None] = "auto", host_staging: bool = False):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("StepPlanner needs torch.distributed initialised (dist.init_process_group)")
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        if self.rank < 0:
            raise ValueError(f"this process (rank {dist.get_rank()}) is not in the planner's group")
        self.world_size = dist.get_world_size(self.group)
        self.model = _model_shape(model)
        self._plan_model = _planner_model(model if cost_model is None else cost_model)
        if policy not in distca.planner_names():
            raise ValueError(f"policy must be one of {', '.join(distca.planner_names())}, got {policy!r}")
        if pingpong not in ("auto", True, False):
            raise ValueError(f"pingpong must be 'auto', True or False, got {pingpong!r}")
        if backward not in ("stateful", "stateless"):
            raise ValueError(f"backward must be 'stateful' or 'stateless', got {backward!r}")
        if state_budget is not None and (isinstance(state_budget, bool) or not isinstance(state_budget, (int, np.integer))
                                         or state_budget < 0):
            raise ValueError(f"state_budget must be a non-negative integer of bytes or None (no limit), "
                             f"got {state_budget!r}")
        if not isinstance(grad_return, str) or grad_return not in GRAD_RETURNS:
            raise ValueError(f"grad_return must be 'fp32' or 'bf16' (the dtype dK/dV partial sums travel in), "
                             f"got {grad_return!r}")
        if not isinstance(check_inputs, bool) or not isinstance(prefetch, bool):
            raise TypeError("check_inputs and prefetch must be bools")
        backend_name = dist.get_backend(self.group)
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if backend_name == "nccl" else torch.device("cpu")
        self.device = torch.device(device)
        if backend_name == "nccl" and self.device.type != "cuda":
            raise ValueError(f"the group uses NCCL, which moves CUDA tensors; device {self.device} is not one")
        if not isinstance(host_staging, bool):
            raise TypeError(f"host_staging must be a bool, got {type(host_staging).__name__}")
        if host_staging and not (backend_name == "gloo" and self.device.type == "cuda"):
            raise ValueError(f"host_staging is for CUDA tensors over a gloo group; this is {backend_name} with "
                             f"{self.device.type} tensors")
        if backend_name == "gloo" and self.device.type == "cuda" and not host_staging:
            raise ValueError("the group uses gloo; use an NCCL group for CUDA tensors (or, for testing, "
                             "host_staging=True: the exchanges through host memory)")
        self.host_staging = host_staging
        if throughput == "auto":
            throughput = "cpu" if self.device.type == "cpu" else None
        self.options: dict[str, Any] = dict(policy=policy, tolerance=tolerance, granularity=granularity,
                            max_rank_bytes=max_rank_bytes, profile=profile, throughput=throughput)
        # distca.plan's own checks, once here (a bad tolerance fails at construction, on every rank),
        # its messages naming this constructor's arguments rather than the command line's flags.
        try:
            distca.plan([[16]], model=self._plan_model, **self.options)
        except ValueError as e:
            raise ValueError(distca.python_names(str(e))) from None
        if (isinstance(buffer_capacity, bool) or not isinstance(buffer_capacity, (int, np.integer))
                or buffer_capacity < 0):
            raise ValueError(f"buffer_capacity must be a non-negative integer of bytes, got {buffer_capacity!r}")
        limit, limit_what = _memory_limit(self.device)
        if buffer_capacity > limit:
            raise ValueError(f"buffer_capacity {int(buffer_capacity)} bytes is more than {limit_what} ({limit} bytes): "
                             f"give the bytes of one exchange slot, or 0 to grow each slot to the largest step")
        self.pingpong = (self.device.type == "cuda") if pingpong == "auto" else bool(pingpong)
        self.backward = backward
        self.state_budget = None if state_budget is None else int(state_budget)
        self.grad_return = grad_return
        self.backend = backend
        default_dtype = torch.float32 if self.device.type == "cpu" else torch.bfloat16
        get_backend(backend, self.device, default_dtype, head_dim=self.model.head_dim)
        # What `auto` runs (the measured table's choice per kind of task list, or the default order's).
        self.backend_note = (describe_auto(self.device, default_dtype, self.model.head_dim)
                             if backend == "auto" else "")
        self.check_inputs = check_inputs
        ranks = dist.get_process_group_ranks(self.group)
        self.control_group = self.group if backend_name == "gloo" else dist.new_group(ranks, backend="gloo")
        self._plan_group = dist.new_group(ranks, backend="gloo") if prefetch else self.control_group
        self._executor = concurrent.futures.ThreadPoolExecutor(1, "distca-plan") if prefetch else None
        self._config_digest = hashlib.sha256(json.dumps(
            [self.options, self._plan_model, self.model.__dict__, self.pingpong, backward, self.state_budget, grad_return,
             backend if isinstance(backend, str) else type(backend).__name__, check_inputs, prefetch, host_staging],
            sort_keys=True, default=str).encode()).hexdigest()[:16]
        self.buffers = ExchangeBuffers(self.device, int(buffer_capacity)) if static_buffers else None
        self.current: Optional[StepLayout] = None
        # The planner's identity: its settings, its group's ranks and its place among this process's
        # planners over those ranks (the same on every rank when all construct them alike).
        key = tuple(int(r) for r in ranks)
        self._ordinal = _PLANNER_COUNTS[key] = _PLANNER_COUNTS.get(key, 0) + 1
        digest = hashlib.sha256(json.dumps([self._config_digest, list(key), self._ordinal]).encode()).digest()
        self.planner_id = (int.from_bytes(digest[:8], "little") >> 1) or 1
        self._serial = 0              # plan/plan_async calls that passed their header
        self._layouts: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()  # live layouts it made, by id()
        _PLANNERS.append(weakref.ref(self))
        _GROUP_HOLDERS[id(self)] = self

    def __enter__(self) -> "StepPlanner":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def plan(self, cu_seqlens: Any = None, *, pieces: Optional[Sequence] = None,
             input_error: Optional[str] = None) -> StepLayout:
        """Collective over the group: this rank's documents -> the step's layout.

        cu_seqlens: this rank's rows are whole documents end to end, with these boundaries (a
          sequence, 1-d tensor or 1-d array of integers from 0); [0] for a rank with no rows this
          step (an idle pipeline stage), which only serves others' attention (cad_serve).
        pieces: rows (doc_key, begin, end, doc_length) for documents that span ranks: this rank holds
          tokens [begin, end) of the document every rank names `doc_key`, its pieces in row order
          (none: no rows). At least one rank of the group holds a token.
        input_error: what the caller found wrong with this rank's input (an adapter's own checks), agreed
          on with the planner's: the step is not planned and every rank raises InputError with it.
        Bad input on any rank, or a rank in another call, raises the same InputError on every rank.
        """
        local, serial = self._begin(CALL_PLAN, cu_seqlens, pieces, input_error)
        if self._executor is not None:
            # Behind any plan_async before it, on the planning thread and group: the planning
            # collectives run in call order on every rank.
            layout = self._executor.submit(self._plan, local, serial, self._plan_group).result()
        else:
            layout = self._plan(local, serial, self.control_group)
        self.current = layout
        return layout

    def plan_async(self, cu_seqlens: Any = None, *, pieces: Optional[Sequence] = None) -> "PlannedStep":
        """Starts planning a later step on the planner's thread (needs prefetch=True); every rank
        calls it in the same order. Its arguments are checked, and its step numbered, here in the
        caller's thread (the call header), the planning itself runs behind any plan before it.
        PlannedStep.result() waits for it and makes it current."""
        local, serial = self._begin(CALL_PLAN_ASYNC, cu_seqlens, pieces)
        assert self._executor is not None  # _begin refused plan_async without one, on every rank
        return PlannedStep(self, self._executor.submit(self._plan, local, serial, self._plan_group))

    def finish(self) -> None:
        """Collective: this rank has made its last plan. Every rank calls it once it is done; a
        rank still planning (or in cad_attention) meanwhile, or ranks that made different numbers
        of plans, raise the same InputError on every rank, naming each rank's count, where
        otherwise the ranks that finished would go on and the others wait in their next plan.
        One all_gather of 4 int64 per rank. Then closes the planner (close())."""
        if self.closed:
            raise RuntimeError("StepPlanner.finish: the planner is closed (close(), finish(), or the process is exiting)")
        try:
            call_header(self.control_group, CALL_FINISH, self.planner_id, self._serial, None)
        finally:
            self.close()

    def _begin(self, call: int, cu_seqlens: Any, pieces: Any, input_error: Optional[str] = None) -> tuple:
        """The local checks and the call header, in the caller's thread -> (this rank's pieces, the
        step's serial). The serial is taken only when the header passes, on every rank alike."""
        if self.closed:
            raise RuntimeError(f"{CALL_NAMES[call]}: the planner is closed (close(), or the process is exiting), "
                               f"and so are its layouts: make a new StepPlanner")
        local, message = None, None
        if call == CALL_PLAN_ASYNC and self._executor is None:
            message = "plan_async needs StepPlanner(..., prefetch=True) (and a planner not closed)"
        elif input_error is not None:
            message = str(input_error)
        else:
            try:
                local = _local_pieces(self.rank, cu_seqlens, pieces)
            except Exception as e:  # noqa: BLE001 (any rank's fault is agreed on, then raised everywhere)
                message = error_message(e)
        serial = self._serial + 1
        call_header(self.control_group, call, self.planner_id, serial, message, (self._config_digest, self._ordinal))
        self._serial = serial
        return local, serial

    def _plan(self, local: list, serial: int, group: Any) -> StepLayout:
        start = time.perf_counter()
        gathered: list = [None] * self.world_size
        dist.all_gather_object(gathered, local, group=group)
        try:
            batch, rows = _global_batch(gathered)
        except ValueError as e:
            raise InputError(f"StepPlanner.plan: {e}") from e
        plan = distca.plan(batch, model=self._plan_model, **self.options)
        digest = torch.tensor([plan.hash & 0x7FFFFFFFFFFFFFFF, -(plan.hash & 0x7FFFFFFFFFFFFFFF)], dtype=torch.int64)
        dist.all_reduce(digest, op=dist.ReduceOp.MAX, group=group)
        if digest[0].item() != -digest[1].item():
            raise RuntimeError("StepPlanner.plan: the ranks made different plans from the same documents "
                               "(different distca builds?)")
        plan_ms = (time.perf_counter() - start) * 1e3
        layout = rank_layout(plan, batch, rows, self.rank, self.device, pingpong=self.pingpong)
        layout.serial, layout.planner_id = serial, self.planner_id
        layout.group, layout.control_group, layout.model = self.group, self.control_group, self.model
        layout.backward, layout.backend, layout.check_inputs = self.backward, self.backend, self.check_inputs
        layout.grad_return, layout.state_budget = self.grad_return, self.state_budget
        layout.plan_ms, layout.buffers = plan_ms, self.buffers
        layout.backend_note, layout.host_staging = self.backend_note, self.host_staging
        self._layouts[id(layout)] = layout
        _GROUP_HOLDERS[id(layout)] = layout
        return layout

    @property
    def prefetch(self) -> bool:
        """plan_async is available (StepPlanner(..., prefetch=True), not closed)."""
        return self._executor is not None

    @property
    def closed(self) -> bool:
        return self.control_group is None

    def close(self) -> None:
        """Ends the planner: its planning thread (prefetch) is joined, and the planner and every
        layout it made let go of their process groups, so dist.destroy_process_group() frees them
        (see "Process groups" in the module docstring). Neither can be used after; closing twice
        is harmless. `with StepPlanner(...) as planner:` closes it at the block's end."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        for layout in list(self._layouts.values()):
            layout.group = layout.control_group = None
        self._layouts.clear()
        self.group = self.control_group = self._plan_group = None
        _GROUP_HOLDERS.pop(id(self), None)


class PlannedStep:
    """A step being planned on the planner's thread."""

    def __init__(self, planner: StepPlanner, future: concurrent.futures.Future):
        self._planner, self._future = planner, future

    def done(self) -> bool:
        return self._future.done()

    def result(self) -> StepLayout:
        layout = self._future.result()
        self._planner.current = layout
        return layout
