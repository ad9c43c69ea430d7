"""The trainer's stopwatches: a server kernel timed (TimedKernel), the seconds inside
cad_attention (AttentionWatch), and the learning-rate schedule both backends share (lr_at).
"""
from __future__ import annotations

import time
from typing import Optional

import torch

from ..kernels.server import ServerKernel


class TimedKernel(ServerKernel):
    """A server kernel with a stopwatch (forward + backward seconds). On CUDA it synchronises
    around each call, so the seconds are the kernel's own (and the overlap of ping-pong is lost)."""

    def __init__(self, inner: ServerKernel, device: torch.device):
        self.inner, self.name, self.device = inner, inner.name, device
        self.seconds = 0.0

    def unavailable(self, device, dtype):
        return self.inner.unavailable(device, dtype)

    def _timed(self, fn, args):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        try:
            return fn(*args)
        finally:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.seconds += time.perf_counter() - start

    def forward(self, *args):
        return self._timed(self.inner.forward, args)

    def backward(self, *args):
        return self._timed(self.inner.backward, args)


class AttentionWatch:
    """Seconds inside cad_attention: the forward call, and the backward from the moment the
    output's gradient is ready (a hook on o) to the moment the inputs' gradients are (a hook on q)."""

    def __init__(self):
        self.forward = self.backward = 0.0
        self._started: Optional[float] = None

    def reset(self) -> None:
        self.forward = self.backward = 0.0
        self._started = None

    def _begin(self, grad):
        self._started = time.perf_counter()

    def _end(self, grad):
        if self._started is not None:
            self.backward += time.perf_counter() - self._started
            self._started = None


def lr_at(step: int, lr: float, warmup: int) -> float:
    """Linear warm-up from lr / warmup to lr over `warmup` steps (step counts from 0), then constant."""
    return lr * (step + 1) / warmup if step < warmup else lr
