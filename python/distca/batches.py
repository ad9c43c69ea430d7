"""Batches, the documents of one step on every rank: the forms distca.plan takes (as_batch), and
pack and batch_from_pieces, which build a Batch from document lengths.
"""
from __future__ import annotations

import json
import os
from typing import Any, Mapping, Sequence, Union

import numpy as np

from . import _distca
from .arguments import excerpt, integer_arg, lengths_arg, path_arg

Batch = _distca.Batch

BatchLike = Union[Batch, Sequence[Sequence[int]], Mapping[str, Any], str, os.PathLike]


def as_batch(batch: BatchLike, tokens_per_rank: int) -> Batch:
    """A Batch from the forms distca.plan takes (see its docstring)."""
    tokens_per_rank = integer_arg(tokens_per_rank, "tokens_per_rank")
    if isinstance(batch, Batch):
        if tokens_per_rank:
            raise ValueError("tokens_per_rank applies to a batch given as lengths; this Batch already has its size")
        return batch
    if isinstance(batch, (str, os.PathLike)):
        return _distca.batch_from_file(path_arg(batch, "batch"), tokens_per_rank)
    if isinstance(batch, Mapping):
        value: Any = dict(batch)
    else:
        try:
            value = {"ranks": [list(rank) for rank in batch]}
        except TypeError as e:
            raise ValueError(f"batch must be a Batch, a list of ranks' document lengths, {{'ranks': ...}} or a "
                             f"batch file's path, got {type(batch).__name__}") from e
    # The C++ reader checks every length (the command line's messages, word for word): 2.5, True
    # (JSON true) and "2" are refused there; inf and NaN, which JSON cannot hold, here.
    try:
        text = json.dumps(value, default=_json_default, allow_nan=False)
    except ValueError as e:  # allow_nan=False, or a list that holds itself
        nan = "Out of range float" in str(e)
        raise ValueError(f"batch: {'a document length is inf or NaN, expected a positive integer' if nan else e}") from e
    except RecursionError as e:
        raise ValueError("batch: nested too deeply, expected {'ranks': [[len, ...], ...]}") from e
    return _distca.batch_from_json(text, tokens_per_rank, "batch")


def _json_default(value: Any) -> Any:
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.floating):
        return float(value)
    raise TypeError(f"{type(value).__name__} is not a document length")


def pack(lengths: Sequence[int], num_ranks: int, tokens_per_rank: int, *, overflow: str = "error") -> Batch:
    """Packs documents, in order, into num_ranks ranks of tokens_per_rank tokens: each rank is
    filled to tokens_per_rank before the next starts, and a document that overflows a rank
    continues on the next (it becomes pieces on several ranks). With room to spare nothing is
    padded: the last rank used holds fewer tokens, and ranks after it hold none.

    overflow: what happens when the documents hold more than num_ranks x tokens_per_rank tokens:
      "error" (the default) raises ValueError, so every document is kept whole; "cut" fills the
      ranks and stops, cutting the document that overflows the last rank there and dropping the
      rest (what a data loader drawing documents until the step is full wants)."""
    if overflow not in ("error", "cut"):
        raise ValueError(f"overflow must be 'error' or 'cut', got {excerpt(overflow)}")
    return _distca.pack_documents(lengths_arg(lengths, "lengths"), integer_arg(num_ranks, "num_ranks", 32),
                                  integer_arg(tokens_per_rank, "tokens_per_rank"), overflow == "cut")


def batch_from_pieces(doc_lengths: Sequence[int], pieces: Any, tokens_per_rank: int = 0, num_ranks: int = 0) -> Batch:
    """A batch whose documents may span ranks: pieces is an (n, 4) integer array of rows
    (doc, begin, end, rank), ordered by rank and, within a rank, by position in its linear layout;
    the pieces of each document tile it. tokens_per_rank = 0 takes the fullest rank's tokens.
    num_ranks = 0 takes one past the highest rank a piece names; more adds ranks that hold no
    tokens (an idle pipeline stage: it only serves attention), and a piece beyond it is refused."""
    rows = np.asarray(pieces)
    if rows.size and (rows.dtype.kind not in "iu" or (rows.dtype.kind == "u" and rows.max() > np.iinfo(np.int64).max)):
        raise TypeError(f"pieces must be an integer array (int64 values), got dtype {rows.dtype}")
    return _distca.batch_from_pieces(lengths_arg(doc_lengths, "doc_lengths"), rows.astype(np.int64),
                                     integer_arg(tokens_per_rank, "tokens_per_rank"),
                                     integer_arg(num_ranks, "num_ranks", 32))
