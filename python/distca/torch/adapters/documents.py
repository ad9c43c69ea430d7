"""Where the documents of a packed [B, L] batch begin, read from per-document positions: the
convention TorchTitan's block-causal masks, Hugging Face's packed sequences and TRL's padding-free
batches share (a document starts where positions is 0, and at the start of each batch row)."""
from __future__ import annotations

from typing import Optional

import torch

__all__ = ["document_cu_seqlens"]


def document_cu_seqlens(positions: Optional[torch.Tensor] = None, shape: Optional[tuple] = None) -> list:
    """Document boundaries of a [B, L] batch packed row after row: a document starts where
    positions is 0 and at each row's start. positions None: one
    document per row of `shape` (B, L), as TorchTitan's causal attention without positions."""
    if positions is None:
        if shape is None or len(shape) != 2 or any(isinstance(n, bool) or int(n) != n or n <= 0 for n in shape):
            raise ValueError(f"pass positions [B, L], or shape (B, L) for one document per row; got shape {shape!r}")
        b, s = int(shape[0]), int(shape[1])
        return [i * s for i in range(b + 1)]
    if not isinstance(positions, torch.Tensor):
        raise TypeError(f"positions must be a tensor [B, L], got {type(positions).__name__}")
    if positions.dim() != 2 or positions.numel() == 0:
        raise ValueError(f"positions must be [B, L] (per-document positions), got shape "
                         f"{tuple(positions.shape)}")
    if positions.is_floating_point() or positions.is_complex() or positions.dtype == torch.bool:
        raise ValueError(f"positions must hold integers, got {positions.dtype}")
    if shape is not None and tuple(shape) != tuple(positions.shape):
        raise ValueError(f"positions has shape {tuple(positions.shape)}, the batch {tuple(shape)}")
    pos = positions.detach().to("cpu")  # one device-to-host copy per step, as TorchTitan's varlen masks
    starts = pos == 0
    starts[:, 0] = True
    cu = torch.nonzero(starts.reshape(-1)).reshape(-1).tolist()
    return cu + [pos.numel()]
