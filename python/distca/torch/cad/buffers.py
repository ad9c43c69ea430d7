"""The exchanges' receive buffers, reused across layers and steps (StepPlanner(static_buffers=True)).

Its own module because both sides use it: the planner owns one (planner.py) and cad_attention
receives into it (attention.py), and neither should import the other for it.
"""
from __future__ import annotations

import math

import torch


class ExchangeBuffers:
    """Receive buffers for the exchanges, one per slot (phase, nano-batch, tensor kind), allocated
    at the largest size seen (or a fixed capacity) and reused by every layer and step, so the
    exchanges allocate nothing in steady state. Safe because each phase consumes its received rows
    (gathers or copies them) before the next layer's exchange of the same slot is posted, and on
    CUDA the next collective is ordered after that consumption on the stream."""

    def __init__(self, device: torch.device, capacity_bytes: int = 0):
        self.device = device
        self.capacity_bytes = int(capacity_bytes)
        self.allocations = 0          # buffers allocated so far (growth included)
        self._slots: dict = {}

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self._slots.values())

    def get(self, slot: tuple, rows: int, row_shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        width = math.prod(row_shape) * torch.empty((), dtype=dtype).element_size()
        need = rows * width
        buf = self._slots.get(slot)
        if buf is None or buf.numel() < need:
            size = max(need, self.capacity_bytes, int(1.25 * buf.numel()) if buf is not None else 0)
            buf = torch.empty(size, dtype=torch.uint8, device=self.device)
            self._slots[slot] = buf
            self.allocations += 1
        return buf[:need].view(dtype).view(rows, *row_shape)
