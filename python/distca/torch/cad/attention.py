"""cad_attention: core attention of this rank's rows, computed by the plan's attention servers.

One autograd.Function whose forward and backward are the CAD data path (docs/design.md §4), per
nano-batch:
  forward   owner: gather Q rows and K/V rows (K/V once per (document, server))  -> all-to-all
            server: lay the rows out per task, run the server kernel (O, LSE)      -> all-to-all back
            owner: copy rows computed whole, merge key-split rows by the LSE rule (over both
            nano-batches: a row's key splits may be in either)
  backward  owner: dO with the merged O and LSE (stateless: Q and K/V again)      -> all-to-all
            server: kernel backward with the merged O/LSE (exact for key-split rows); dK/dV summed
            over the tasks sharing a row (fp32), sent in the layout's grad_return
            dtype (fp32, or bf16: half the bytes, the paper's choice)            -> all-to-all back
            owner: dQ and dK/dV summed over the entries of each row (fp32; the rows it served
            itself unrounded)
With two nano-batches (ping-pong) every all-to-all is posted asynchronously and waited for only
when its result is needed: the second nano-batch's dispatch runs while the first computes, the
first one's return while the second computes. The one that moves more goes second in the forward
and first in the backward (forward_order). (Posting the second dispatch only once the first has
arrived, so that the two never share the link, measured 5-10 % slower over a shaped link between
two network-namespace hosts: reports/cpu/2026-11-27-bench-link-torch.)

Rows travel as bytes: O and LSE (or dO, O and LSE) of a row are packed into one uint8 row, so each
phase is one all_to_all_single per nano-batch and tensor kind.
"""
from __future__ import annotations

import math
from typing import Optional, Union

import numpy as np
import torch
import torch.distributed as dist

from ..kernels.backends import get_backend
from ..kernels.ops import scale_problem
from ..kernels.server import ServerKernel, default_scale
from ..trace import interval, now, span
from .agreement import CALL_CAD_ATTENTION, InputError, call_header, error_message
from .buffers import ExchangeBuffers
from .layout import PartLayout, StepLayout
from .planner import latest_planner

# The dtypes cad_attention takes: every CPU and CUDA backend's forward and backward run them
# (float64's backward does not run on the CPU kernels).
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# The dtypes dK/dV partial sums may travel in on the backward return (StepPlanner's grad_return).
GRAD_RETURN_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _pack(*tensors: torch.Tensor) -> torch.Tensor:
    """Row-wise byte concatenation of tensors with the same first dimension -> [N, bytes] uint8."""
    n = tensors[0].shape[0]
    return torch.cat([t.contiguous().view(n, math.prod(t.shape[1:])).view(torch.uint8) for t in tensors], dim=1)


def _unpack(packed: torch.Tensor, specs: list) -> list:
    """Inverse of _pack: specs are (trailing shape, dtype) per tensor."""
    n, out, at = packed.shape[0], [], 0
    for shape, dtype in specs:
        width = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        out.append(packed[:, at:at + width].contiguous().view(dtype).view(n, *shape))
        at += width
    return out


class _Exchange:
    """all_to_all_single of dim 0, posted asynchronously; wait() returns the received tensor
    (a view of `buffers`' slot when given, else a new tensor). With `stage` (a layout's
    host_staging: CUDA tensors over gloo, for testing) it moves host copies and copies the result
    back to the device in wait()."""

    def __init__(self, x: torch.Tensor, send_splits: list, recv_splits: list, group,
                 buffers: Optional[ExchangeBuffers] = None, slot: tuple = (), stage: bool = False):
        self.slot, self.posted = slot, now()
        rows, row_shape = sum(recv_splits), tuple(x.shape[1:])
        self.out = buffers.get(slot, rows, row_shape, x.dtype) if buffers is not None else x.new_empty((rows,) + row_shape)
        self.host = torch.empty((rows,) + row_shape, dtype=x.dtype) if stage else None
        work = dist.all_to_all_single(self.host if stage else self.out, x.contiguous().cpu() if stage else x.contiguous(),
                                      recv_splits, send_splits, group=group, async_op=True)
        assert work is not None
        self.work = work

    def wait(self) -> torch.Tensor:
        self.work.wait()
        if self.host is not None:
            self.out.copy_(self.host)
        if self.slot:   # from posted to completed (seen here), on the rank's exchange track
            interval(f"exchange {'/'.join(str(x) for x in self.slot)}", self.posted, now(), "exchange",
                     nano=self.slot[1], rows=int(self.out.shape[0]))
        return self.out


def forward_order(layout: StepLayout, hq: int, hkv: int) -> list:
    """The order the forward runs the nano-batches in; the backward runs the reverse. A
    nano-batch's exchanges can run only during the other's compute: the second one's dispatch
    during the first's compute, the first one's return during the second's. So the nano-batch
    that moves more (the forward dispatches Q and K/V, larger than the O it returns) goes second
    in the forward, and first in the backward, where its larger return (dQ, dK/dV) is the one
    hidden. On two ranks the travelling rows are often all one nano-batch's (nanobatch.py keeps
    the tasks sharing K/V rows together). By the split's rows, the same on every rank."""
    split = layout.split
    if len(layout.parts) < 2 or split is None or len(split.travel_rows) != len(layout.parts):
        return list(range(len(layout.parts)))
    dispatched = [q_rows * hq + kv_rows * 2 * hkv for q_rows, kv_rows in split.travel_rows]
    return sorted(range(len(layout.parts)), key=lambda i: (dispatched[i], i))


def _owner_dkv(received: torch.Tensor, sent: torch.Tensor, part: PartLayout, rank: int) -> torch.Tensor:
    """The dK/dV partial sums an owner adds up, in fp32: as received, except the rows this rank
    served itself, which never crossed a link and are taken unrounded from what it sent (as the
    C++ runtime does: only the partial sums that travel are rounded by a bf16 return)."""
    if received.dtype == torch.float32:
        return received
    out = received.float()
    mine = part.kv_send_splits[rank]
    if mine:
        at_owner, at_server = sum(part.kv_send_splits[:rank]), sum(part.kv_recv_splits[:rank])
        out[at_owner:at_owner + mine] = sent[at_server:at_server + mine]
    return out


def _check(q, k, v, layout: StepLayout, scale, backend, return_lse) -> Optional[str]:
    """This rank's arguments against its layout: None when fine, else what is wrong (one line)."""
    if not isinstance(layout, StepLayout):
        return f"layout must be a StepLayout (StepPlanner.plan), got {type(layout).__name__}"
    m = layout.model
    if m is None:
        return "the layout has no model shape (rank_layout makes such layouts; pass the one StepPlanner.plan returns)"
    if layout.group is None or layout.control_group is None:
        return "the layout has no process group (rank_layout makes such layouts; pass the one StepPlanner.plan returns)"
    for name, x, heads in (("q", q, m.num_q_heads), ("k", k, m.num_kv_heads), ("v", v, m.num_kv_heads)):
        if not isinstance(x, torch.Tensor):
            return f"{name} must be a tensor, got {type(x).__name__}"
        want = (layout.num_local_rows, heads, m.head_dim)
        if tuple(x.shape) != want:
            return (f"{name} has shape {tuple(x.shape)}, the layout expects {list(want)} "
                    f"([this rank's rows, {'Hq' if name == 'q' else 'Hkv'}, D])")
        if not x.is_floating_point():
            return f"{name} must be floating point, got {x.dtype}"
        if x.dtype != q.dtype:
            return f"q, k and v must share a dtype: q is {q.dtype}, {name} is {x.dtype}"
        if x.device != layout.device:
            return f"{name} is on {x.device}, the layout on {layout.device}"
        if not x.is_contiguous():
            return f"{name} is not contiguous (call .contiguous(); a strided view would be copied on every exchange)"
    if q.dtype not in SUPPORTED_DTYPES:
        return (f"q, k and v are {q.dtype}: cad_attention supports {', '.join(map(str, SUPPORTED_DTYPES))} "
                f"(cast them, e.g. q.float())")
    scale_error = scale_problem(scale)   # finite and positive in float32, the kernels' precision
    if scale_error is not None:
        return scale_error
    if backend is not None and not isinstance(backend, (str, ServerKernel)):
        return f"backend must be a backend's name or a ServerKernel instance, got {type(backend).__name__}"
    if not isinstance(return_lse, (bool, np.bool_)):
        return f"return_lse must be a bool, got {return_lse!r}"
    if dist.get_world_size(layout.group) != layout.world_size:
        return (f"the layout was planned for {layout.world_size} ranks, its group has "
                f"{dist.get_world_size(layout.group)}")
    if dist.get_rank(layout.group) != layout.rank:
        return f"the layout was made for rank {layout.rank} of its group, this is rank {dist.get_rank(layout.group)}"
    return None


def _server_forward(part: PartLayout, q_recv, kv_recv, kernel, scale, nano: int = 0):
    """Received rows -> this server's O and LSE per received Q row (the return's send buffer)."""
    q_var = q_recv.index_select(0, part.q_gather)
    kv_var = kv_recv.index_select(0, part.kv_gather)
    k_var, v_var = kv_var[:, 0].contiguous(), kv_var[:, 1].contiguous()
    with span("server kernel forward", nano=nano, rows=int(q_var.shape[0])):
        o_var, lse_var = kernel.forward(q_var, k_var, v_var, part.tasks, scale)
    o_send = o_var.new_empty((part.num_q_recv,) + tuple(o_var.shape[1:])).index_copy_(0, part.q_gather, o_var)
    lse_send = lse_var.new_empty((part.num_q_recv, lse_var.shape[1])).index_copy_(0, part.q_gather, lse_var)
    return o_send, lse_send, (q_var, k_var, v_var)


def _copy(part: PartLayout, o_ret, lse_ret, out, lse_out) -> None:
    """Owner: rows computed whole by one task are copied from a nano-batch's return."""
    out.index_copy_(0, part.copy_rows, o_ret.index_select(0, part.copy_entries))
    lse_out.index_copy_(0, part.copy_rows, lse_ret.index_select(0, part.copy_entries))


def _merge(layout: StepLayout, part_o: list, part_lse: list, out, lse_out) -> None:
    """Owner: the partial results of key-split rows, from every nano-batch (a row's key splits may
    be in both), merged by the LSE rule in fp32: lse = log sum_m exp(lse_m), o = sum_m
    exp(lse_m - lse) o_m. part_o / part_lse: each part's merge entries, in part order."""
    rows = layout.merged_rows
    if rows.numel() == 0:
        return
    slot = torch.cat([p.merge_slot for p in layout.parts]) if len(layout.parts) > 1 else layout.parts[0].merge_slot
    # part_o / part_lse are in part order, as the slots
    plse = torch.cat(part_lse) if len(part_lse) > 1 else part_lse[0]                 # [E, Hq]
    po = (torch.cat(part_o) if len(part_o) > 1 else part_o[0]).float()              # [E, Hq, D]
    shift = plse.new_full((rows.numel(), plse.shape[1]), float("-inf"))
    shift.scatter_reduce_(0, slot[:, None].expand_as(plse), plse, "amax", include_self=True)
    shift = torch.where(torch.isfinite(shift), shift, torch.zeros_like(shift))
    weight = torch.exp(plse - shift.index_select(0, slot))
    total = torch.zeros_like(shift).index_add_(0, slot, weight)
    merged_lse = shift + torch.log(total)
    weight = weight / total.index_select(0, slot)
    merged_o = po.new_zeros((rows.numel(),) + tuple(po.shape[1:])).index_add_(0, slot, weight[..., None] * po)
    out.index_copy_(0, rows, merged_o.to(out.dtype))
    lse_out.index_copy_(0, rows, merged_lse)


class CADAttention(torch.autograd.Function):
    """See the module docstring. Inputs q [T, Hq, D], k/v [T, Hkv, D] (this rank's rows)."""

    @staticmethod
    def forward(ctx, q, k, v, layout: StepLayout, kernel, scale: float):
        with span("cad_attention forward", rows=int(q.shape[0])):
            return CADAttention._forward(ctx, q, k, v, layout, kernel, scale)

    @staticmethod
    def _forward(ctx, q, k, v, layout: StepLayout, kernel, scale: float):
        group = layout.group
        hq, d = q.shape[1], q.shape[2]
        kv = torch.stack((k, v), dim=1)                                       # [T, 2, Hkv, D]
        # 1. Dispatch every nano-batch's Q and K/V (posted, not waited for).
        pool, stage = layout.buffers, layout.host_staging
        order = forward_order(layout, hq, k.shape[1])
        dispatch = {i: (_Exchange(q.index_select(0, layout.parts[i].q_send_index), layout.parts[i].q_send_splits,
                                  layout.parts[i].q_recv_splits, group, pool, ("fwd", i, "q"), stage),
                        _Exchange(kv.index_select(0, layout.parts[i].kv_send_index), layout.parts[i].kv_send_splits,
                                  layout.parts[i].kv_recv_splits, group, pool, ("fwd", i, "kv"), stage))
                    for i in order}
        # 2. Serve each nano-batch as its rows arrive; post its results back at once.
        returns: dict = {}
        saved: list = [None] * len(layout.parts)
        stateful = layout.keeps_state(q.dtype)
        for i in order:
            p, (xq, xkv) = layout.parts[i], dispatch[i]
            o_send, lse_send, state = _server_forward(p, xq.wait(), xkv.wait(), kernel, scale, i)
            returns[i] = _Exchange(_pack(o_send, lse_send), p.q_recv_splits, p.q_send_splits, group,
                                   pool, ("fwd_return", i), stage)
            saved[i] = state if stateful else None
        # 3. Owner: copy each nano-batch's whole rows as they come back, then merge the key-split
        #    rows' partial results of both (in part order, as the layout's merge slots).
        out = q.new_zeros(q.shape)
        lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float32, device=q.device)
        part_o, part_lse = [None] * len(layout.parts), [None] * len(layout.parts)
        for i in order:
            p = layout.parts[i]
            o_ret, lse_ret = _unpack(returns[i].wait(), [((hq, d), q.dtype), ((hq,), torch.float32)])
            _copy(p, o_ret, lse_ret, out, lse)
            part_o[i] = o_ret.index_select(0, p.merge_entries)
            part_lse[i] = lse_ret.index_select(0, p.merge_entries)
        _merge(layout, part_o, part_lse, out, lse)
        ctx.order = order
        ctx.layout, ctx.kernel, ctx.scale, ctx.num_kv_heads = layout, kernel, scale, k.shape[1]
        # Saved through autograd, the stateful server Q/K/V too: the engine frees them after the
        # backward unless the graph is retained (retain_graph=True), so a second backward finds
        # them, as it finds any op's saved tensors (saved-tensor hooks apply to them as well).
        ctx.stateless = not stateful
        if not stateful:
            ctx.save_for_backward(out, lse, q, k, v)
        else:
            ctx.save_for_backward(out, lse, *(x for state in saved for x in state))
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        if torch.is_grad_enabled():  # the engine runs a backward with grad mode on only for create_graph=True
            raise RuntimeError("cad_attention does not support double backward (create_graph=True): its backward "
                               "is not differentiable; call backward() / autograd.grad() without create_graph")
        out, lse, *inputs = ctx.saved_tensors
        layout, order = ctx.layout, ctx.order[::-1]   # the reverse of the forward's (forward_order)
        if layout.backward_layout is not None:
            # Planned apart (a pipeline's backward tick, stateless): the same rows of this rank,
            # served where that tick's plan puts them.
            layout = layout.backward_layout
            order = forward_order(layout, out.shape[1], ctx.num_kv_heads)[::-1]
        with span("cad_attention backward", rows=int(out.shape[0]), stateless=ctx.stateless):
            dq, dk, dv = backward_exchange(layout, ctx.kernel, ctx.scale, order, ctx.num_kv_heads, out, lse, dout,
                                           inputs, stateless=ctx.stateless)
        return dq, dk, dv, None, None, None


def backward_exchange(layout: StepLayout, kernel, scale: float, order: list, hkv: int, out: torch.Tensor,
                      lse: torch.Tensor, dout: torch.Tensor, inputs: list, *,
                      stateless: Optional[bool] = None) -> tuple:
    """cad_attention's backward data path over `layout`, the nano-batches in `order`: this rank's
    dO with its merged O [T, Hq, D] and LSE [T, Hq] -> (dq, dk, dv) of its rows. inputs: stateless,
    this rank's (q, k, v); stateful, the servers' saved (q, k, v) per nano-batch, flattened.
    stateless: the forward call's mode (StepLayout.keeps_state); default the layout's.
    Collective over the layout's group; a rank with no rows (T = 0) passes empty tensors and only
    serves (distca.torch.cad.serve)."""
    group = layout.group
    dout = dout.contiguous()
    hq, d = out.shape[1], out.shape[2]
    if stateless is None:
        stateless = layout.backward == "stateless"
    wire = GRAD_RETURN_DTYPES[layout.grad_return]
    if stateless:
        q, k, v = inputs
        kv = torch.stack((k, v), dim=1)
    else:
        server_state = [inputs[3 * i:3 * i + 3] for i in range(len(layout.parts))]   # (q, k, v) per part
    # 1. Dispatch dO with the merged O and LSE (stateless: Q and K/V again), every nano-batch.
    dispatch = []
    pool, stage = layout.buffers, layout.host_staging
    for i in order:
        p = layout.parts[i]
        rows = _pack(dout.index_select(0, p.q_send_index), out.index_select(0, p.q_send_index),
                     lse.index_select(0, p.q_send_index))
        xq = _Exchange(rows, p.q_send_splits, p.q_recv_splits, group, pool, ("bwd", i, "dout"), stage)
        if stateless:
            xs = (_Exchange(q.index_select(0, p.q_send_index), p.q_send_splits, p.q_recv_splits, group,
                            pool, ("bwd", i, "q"), stage),
                  _Exchange(kv.index_select(0, p.kv_send_index), p.kv_send_splits, p.kv_recv_splits, group,
                            pool, ("bwd", i, "kv"), stage))
        else:
            xs = None
        dispatch.append((xq, xs))
    # 2. Server: kernel backward per nano-batch; dQ back like O, dK/dV summed per received row.
    returns = []
    for i, (xq, xs) in zip(order, dispatch):
        p = layout.parts[i]
        do_recv, o_recv, lse_recv = _unpack(xq.wait(), [((hq, d), out.dtype), ((hq, d), out.dtype),
                                                        ((hq,), torch.float32)])
        if xs is not None:   # stateless
            q_recv, kv_recv = xs[0].wait(), xs[1].wait()
            q_var = q_recv.index_select(0, p.q_gather)
            kv_var = kv_recv.index_select(0, p.kv_gather)
            k_var, v_var = kv_var[:, 0].contiguous(), kv_var[:, 1].contiguous()
        else:
            q_var, k_var, v_var = server_state[i]
        do_var, o_var, lse_var = (x.index_select(0, p.q_gather) for x in (do_recv, o_recv, lse_recv))
        with span("server kernel backward", nano=i, rows=int(q_var.shape[0])):
            dq_var, dk_var, dv_var = kernel.backward(do_var, q_var, k_var, v_var, o_var, lse_var, p.tasks, scale)
        dq_send = dq_var.new_empty((p.num_q_recv, hq, d)).index_copy_(0, p.q_gather, dq_var)
        dkv_send = torch.zeros((p.num_kv_recv, 2, hkv, d), dtype=torch.float32, device=out.device)
        dkv_send.index_add_(0, p.kv_gather, torch.stack((dk_var.float(), dv_var.float()), dim=1))
        returns.append((_Exchange(dq_send, p.q_recv_splits, p.q_send_splits, group, pool, ("bwd_return", i, "dq"), stage),
                        _Exchange(dkv_send.to(wire), p.kv_recv_splits, p.kv_send_splits, group, pool,
                                  ("bwd_return", i, "dkv"), stage),
                        dkv_send))
    # 3. Owner: sum each row's entries (fp32).
    dq = torch.zeros(out.shape, dtype=torch.float32, device=out.device)
    dkv = torch.zeros((out.shape[0], 2, hkv, d), dtype=torch.float32, device=out.device)
    for i, (xdq, xdkv, dkv_sent) in zip(order, returns):
        p = layout.parts[i]
        dq.index_add_(0, p.q_send_index, xdq.wait().float())
        dkv.index_add_(0, p.kv_send_index, _owner_dkv(xdkv.wait(), dkv_sent, p, layout.rank))
    dtype = out.dtype
    return dq.to(dtype), dkv[:, 0].to(dtype), dkv[:, 1].to(dtype)


def cad_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: StepLayout, *,
                  scale: Optional[float] = None, backend: Union[str, ServerKernel, None] = None,
                  return_lse: bool = False):
    """Causal core attention of this rank's rows, computed by the plan's attention servers.

    q [T, Hq, D], k/v [T, Hkv, D]: this rank's rows (after RoPE at layout.positions), in the
    order of the documents given to StepPlanner.plan, float32, bfloat16 or float16; returns
    o [T, Hq, D] (and, with return_lse, the LSE [T, Hq] fp32, not differentiable). scale: a number
    finite and positive in float32, the kernels' precision (default 1/sqrt(D)). backend: a name (the
    planner's by default) or a ServerKernel instance. Collective over the layout's group: every rank
    calls it with the same step's layout. Differentiable in q, k, v to first order (no double
    backward); a graph kept with retain_graph=True can be backpropagated again, in both backward
    modes.

    Every argument is checked before the first collective; with the planner's check_inputs (the
    default) the call then starts with the call header (one all_gather of 4 int64 per rank over
    the control group, see distca.torch.cad.planner), so bad input on any rank, ranks passing layouts
    of different steps, or a rank in another call (StepPlanner.plan) raise the same InputError on
    every rank. A rank whose `layout` is not a planner's agrees over the control group of this
    process's newest live StepPlanner (or raises at once where there is none). With
    check_inputs=False only local checks run (ValueError on this rank).
    """
    message, kernel = None, None
    try:
        message = _check(q, k, v, layout, scale, backend, return_lse)
        if message is None:
            kernel = get_backend(layout.backend if backend is None else backend, layout.device, q.dtype,
                                 head_dim=int(q.shape[-1]))
    except Exception as e:  # noqa: BLE001 (any rank's fault is agreed on, then raised everywhere)
        message = error_message(e)
    if isinstance(layout, StepLayout) and layout.control_group is not None:
        check, group, planner_id, serial = layout.check_inputs, layout.control_group, layout.planner_id, layout.serial
    else:
        # No planner's layout: its planner is unknown here, so agree over the newest one's group
        # (where the other ranks, making the same calls with their layouts, are).
        planner = latest_planner()
        if planner is None:
            raise InputError(f"cad_attention: {message} (and no StepPlanner in this process)")
        check, group, planner_id, serial = planner.check_inputs, planner.control_group, 0, 0
    if check:
        call_header(group, CALL_CAD_ATTENTION, planner_id, serial, message)
    elif message is not None:
        raise ValueError(f"cad_attention: {message}")
    scale = default_scale(q.shape[2]) if scale is None else float(scale)
    out, lse = CADAttention.apply(q, k, v, layout, kernel, scale)
    return (out, lse) if return_lse else out
