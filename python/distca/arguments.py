"""The checks of distca's arguments: an integer, number, string, path or list of integers, or a
TypeError (ValueError out of range) naming the argument with an excerpt of what it got; and
python_names, which words the C++ checks' messages (naming the command line's flags) in the
Python arguments' names.
"""
from __future__ import annotations

import os
import re
from typing import Any, Mapping

import numpy as np


def excerpt(value: Any) -> str:
    """repr(value) for a message, at most 80 characters (an int of 5000 digits has no repr)."""
    try:
        text = repr(value)
    except ValueError:
        return f"an int of {value.bit_length()} bits"
    return text if len(text) <= 80 else f"{text[:80]}... ({len(text)} characters)"


def integer_arg(value: Any, name: str, bits: int = 64) -> int:
    """An integer argument: a Python or NumPy integer that fits the C++ field (`bits`-bit signed).
    TypeError for anything else: a bool, a float (128.0 too) or a string is not cast."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an integer, got {excerpt(value)}")
    result = int(value)
    if not -(1 << (bits - 1)) <= result < 1 << (bits - 1):
        raise ValueError(f"{name} must be a {bits}-bit integer, got {excerpt(result)}")
    return result


def number_arg(value: Any, name: str) -> float:
    """A real argument: a Python or NumPy int or float, not a bool or a string (the C++ side checks
    its range, inf and NaN included)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a number, got {excerpt(value)}")
    return float(value)


def string_arg(value: Any, name: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a string, got {excerpt(value)}")
    return value


def path_arg(value: Any, name: str) -> str:
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{name} must be a path (str or os.PathLike), got {excerpt(value)}")
    path = os.fspath(value)
    if not isinstance(path, str):
        raise TypeError(f"{name} must be a str path, got {excerpt(path)}")
    return path


def lengths_arg(lengths: Any, name: str) -> list[int]:
    if isinstance(lengths, (str, bytes, Mapping)) or not hasattr(lengths, "__iter__"):
        raise TypeError(f"{name} must be a sequence of integers, got {excerpt(lengths)}")
    return [integer_arg(x, f"{name}[{i}]") for i, x in enumerate(lengths)]


def python_names(message: str) -> str:
    """A message of distca's C++ checks, which name the command line's flags, in the Python
    arguments' names: "--max-rank-bytes must ..." -> "max_rank_bytes must ..."."""
    message = message.replace("--model custom needs every shape flag", "model (a dict without a preset) needs "
                              "every shape key")
    return re.sub(r"(?<![\w-])--([a-z][a-z0-9-]*)", lambda m: m.group(1).replace("-", "_"), message)
