"""JSON input files read in Python under the rules every distca input follows (docs/cli.md, "Inputs
and outputs"), the same as the C++ file layer's (core/file.h, core/json.h) for the files the native
module does not read itself (distca.torch's kernel tables and the bench reports they come from):

- a regular file or a pipe of at most DISTCA_MAX_INPUT_MB MiB (default 1024; a whole number
  1..1048576); a directory, a device or a socket is refused, a FIFO with no writer reads as empty;
- UTF-8 JSON nested at most MAX_DEPTH levels, checked before parsing (so no RecursionError);
  NaN, Infinity and a number that overflows a double (1e400) are malformed, as in C++;
- every failure is one InputFileError (a ValueError) naming the file, quoting at most 80
  characters of what it read.
"""
from __future__ import annotations

import json
import math
import os
import re
import stat
from typing import Any

import numpy as np

from . import knobs

MAX_INPUT_ENV = "DISTCA_MAX_INPUT_MB"
DEFAULT_MAX_INPUT_MIB = 1024
MAX_DEPTH = 64            # core/json.h's kMaxJsonDepth
_CHUNK = 1 << 16
# A JSON string (an unterminated one runs to the end of the text): what the depth scan skips.
_STRING = re.compile(rb'"(?:[^"\\]+|\\.)*"?', re.S)
_NOT_BRACKETS = bytes(sorted(set(range(256)) - set(b"[]{}")))


class InputFileError(ValueError):
    """An input file that cannot be used: str() is "<path>: <reason>"; `path` and `reason` apart
    for a caller that names the file its own way (an environment variable)."""

    def __init__(self, path: str, reason: str):
        super().__init__(f"{path}: {reason}" if path else reason)
        self.path, self.reason = path, reason


def max_input_bytes() -> int:
    """The input limit in bytes: DISTCA_MAX_INPUT_MB MiB where set, else 1024 MiB; ValueError
    naming the variable for anything but a whole number in 1..1048576."""
    text = knobs.get(MAX_INPUT_ENV) or ""
    if not text:
        return DEFAULT_MAX_INPUT_MIB << 20
    if not re.fullmatch(r"[0-9]{1,7}", text) or not 1 <= int(text) <= 1 << 20:
        raise ValueError(f"{MAX_INPUT_ENV}={text[:40]}: expected a whole number of MiB in 1..1048576")
    return int(text) << 20


def _too_large(size: str, limit: int) -> str:
    return f"too large ({size}; an input may have at most {limit >> 20} MiB: set {MAX_INPUT_ENV} to raise the limit)"


def read_bytes(path: str) -> bytes:
    """The whole file at `path` under the input rules (the module docstring)."""
    if not path:
        raise InputFileError(path, "an empty file name")
    limit = max_input_bytes()
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise InputFileError(path, "no such file") from None
    except NotADirectoryError:
        raise InputFileError(path, "no such file") from None
    except OSError as e:
        raise InputFileError(path, f"cannot open file ({e.strerror})") from None
    if stat.S_ISDIR(st.st_mode):
        raise InputFileError(path, "is a directory, expected a file")
    if not stat.S_ISREG(st.st_mode) and not stat.S_ISFIFO(st.st_mode):
        kind = ("a character device" if stat.S_ISCHR(st.st_mode) else "a block device" if stat.S_ISBLK(st.st_mode)
                else "a socket" if stat.S_ISSOCK(st.st_mode) else "not a regular file")
        raise InputFileError(path, f"is {kind}, not a file (inputs are regular files or pipes)")
    if stat.S_ISREG(st.st_mode) and st.st_size > limit:
        raise InputFileError(path, _too_large(f"{st.st_size / (1 << 20):.1f} MiB", limit))
    try:
        # O_NONBLOCK: a FIFO no process writes to opens at once (and reads as empty) instead of
        # waiting forever; reads block again once it is open.
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as e:
        raise InputFileError(path, f"cannot open file ({e.strerror})") from None
    try:
        os.set_blocking(fd, True)
        chunks, size = [], 0
        while True:
            chunk = os.read(fd, _CHUNK)
            if not chunk:
                break
            size += len(chunk)
            if size > limit:
                raise InputFileError(path, _too_large(f"more than {limit >> 20} MiB", limit))
            chunks.append(chunk)
    except OSError as e:
        raise InputFileError(path, f"read failed ({e.strerror})") from None
    finally:
        os.close(fd)
    return b"".join(chunks)


def nesting_depth(data: bytes, limit: int = MAX_DEPTH) -> int:
    """The deepest nesting of [ and { outside JSON strings, stopping once it passes `limit`
    (memory: the text without its strings, then a few bytes per bracket of one chunk)."""
    brackets = _STRING.sub(b"", data).translate(None, _NOT_BRACKETS)
    depth = deepest = 0
    for at in range(0, len(brackets), _CHUNK):
        chunk = np.frombuffer(brackets, dtype=np.uint8, count=min(_CHUNK, len(brackets) - at), offset=at)
        steps = np.where((chunk == ord("[")) | (chunk == ord("{")), 1, -1).astype(np.int32)
        levels = depth + np.cumsum(steps)
        deepest, depth = max(deepest, int(levels.max())), int(levels[-1])
        if deepest > limit:
            break
    return deepest


def _number(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:80]} overflows a double")
    return value


def _constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON (a file holds finite numbers)")


def parse_json(data: bytes, path: str) -> Any:
    """`data`, read from `path`, as JSON under the rules above; InputFileError naming `path`."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputFileError(path, f"malformed JSON: not UTF-8 (byte 0x{data[e.start]:02x} at offset {e.start})") from None
    if not text.strip(" \t\r\n"):
        raise InputFileError(path, "is empty, expected JSON")
    if nesting_depth(data) > MAX_DEPTH:
        raise InputFileError(path, f"malformed JSON: nested more than {MAX_DEPTH} levels deep")
    try:
        return json.loads(text, parse_float=_number, parse_constant=_constant)
    except json.JSONDecodeError as e:
        raise InputFileError(path, f"malformed JSON: {e.msg} (line {e.lineno}, column {e.colno})") from None
    except ValueError as e:   # _number, _constant, or an integer past Python's 4300 digits
        reason = "an integer of more than 4300 digits" if "digits" in str(e) else str(e)
        raise InputFileError(path, f"malformed JSON: {reason}") from None


def read_json(path: str) -> Any:
    """The JSON value in the file at `path`, read and parsed under the input rules; one
    InputFileError (a ValueError) naming the file for whatever is wrong."""
    return parse_json(read_bytes(path), path)
