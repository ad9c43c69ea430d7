"""cad_serve: one attention layer's exchange on a rank that holds no rows this step.

A pipeline stage in a bubble tick has no micro-batch of its own, yet the tick's plan may make it
an attention server of the other stages' rows; every rank of the group enters every exchange. Such
a rank plans with cu_seqlens [0] and calls cad_serve once per attention layer where the busy ranks
call cad_attention (forward) or run that layer's backward:

    layout = planner.plan([0])                 # this rank: no rows, this tick
    for _ in range(layers):
        cad_serve(layout, torch.float32)        # forward tick: serves the layer's forward
    ...
    for _ in range(layers):
        cad_serve(layout, torch.float32, backward=True)   # backward tick (stateless planner)

The forward goes through cad_attention on empty [0, H, D] tensors (its checks and call header
included); the backward runs cad_attention's backward data path (attention.backward_exchange)
with nothing of this rank's own (stateless). With a stateful planner the forward's empty output
carries the served Q/K/V, and its backward serves (see cad_serve).
"""
from __future__ import annotations

from typing import Optional, Union

import torch

from ..kernels.backends import get_backend
from ..kernels.server import ServerKernel, default_scale
from ..trace import span
from .agreement import describe
from .attention import backward_exchange, cad_attention, forward_order
from .layout import StepLayout


def cad_serve(layout: StepLayout, dtype: torch.dtype, *, backward: bool = False, scale: Optional[float] = None,
              backend: Union[str, ServerKernel, None] = None) -> Optional[torch.Tensor]:
    """Serves one layer's attention forward (or, with backward=True, its backward) of the other
    ranks' rows on this rank, which holds none in `layout` (planned from cu_seqlens [0]).
    Collective over the layout's group, in the place of the busy ranks' cad_attention call (or its
    backward). dtype: the busy ranks' q/k/v dtype; scale and backend: as theirs (defaults alike).

    The forward returns the layer's (empty) output [0, Hq, D]. With a stateless planner the
    backward is served by cad_serve(layout, dtype, backward=True), which returns None; with a
    stateful one the output carries the graph holding the served Q/K/V, and
    `out.backward(torch.zeros_like(out))` serves the backward (where the busy ranks run theirs)."""
    if not isinstance(layout, StepLayout):
        raise TypeError(f"cad_serve: layout must be a StepLayout (StepPlanner.plan), got {describe(layout)}")
    if layout.num_local_rows:
        raise ValueError(f"cad_serve: this rank holds {layout.num_local_rows} rows in the layout; cad_serve is for "
                         f"a rank with none (plan with cu_seqlens [0]); call cad_attention with its rows")
    if layout.model is None:
        raise ValueError("cad_serve: the layout has no model shape (pass the one StepPlanner.plan returns)")
    m = layout.model
    empty = {name: torch.empty((0, heads, m.head_dim), dtype=dtype, device=layout.device)
             for name, heads in (("q", m.num_q_heads), ("k", m.num_kv_heads), ("v", m.num_kv_heads))}
    if not backward:
        if layout.backward == "stateful":
            # The servers keep this layer's Q/K/V in its autograd graph: its backward serves
            # through the returned (empty) output.
            for x in empty.values():
                x.requires_grad_()
            return cad_attention(empty["q"], empty["k"], empty["v"], layout, scale=scale, backend=backend)
        with torch.no_grad():
            return cad_attention(empty["q"], empty["k"], empty["v"], layout, scale=scale, backend=backend)
    if layout.backward != "stateless":
        raise ValueError("cad_serve(backward=True) needs a stateless planner (StepPlanner(backward='stateless')): "
                         "a stateful server's saved Q/K/V live in the busy ranks' autograd graphs")
    if layout.group is None:
        raise ValueError("cad_serve: the layout has no process group (its planner is closed)")
    kernel = get_backend(layout.backend if backend is None else backend, layout.device, dtype, head_dim=m.head_dim)
    scale = default_scale(m.head_dim) if scale is None else float(scale)
    out = empty["q"]
    lse = torch.empty((0, m.num_q_heads), dtype=torch.float32, device=layout.device)
    order = forward_order(layout, m.num_q_heads, m.num_kv_heads)[::-1]
    with torch.no_grad(), span("cad_attention backward (serving only)"):
        backward_exchange(layout, kernel, scale, order, m.num_kv_heads, out, lse, out,
                          [empty["q"], empty["k"], empty["v"]])
    return None
