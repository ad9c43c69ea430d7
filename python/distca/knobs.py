"""The DISTCA_* environment variables: one table (src/core/knobs.cc, read through the native
module), the one `distca --help-env` prints, with each variable's default and meaning.

    from distca import knobs
    knobs.get("DISTCA_KERNEL_TABLE")   # its value, or None where it is unset
    knobs.table()                      # [{"name", "default", "meaning", "used_by"}, ...]

get() refuses a name the table does not have (ValueError), so a read of a DISTCA_* variable
cannot bypass the table. warn_unknown() writes one line to stderr naming the DISTCA_* variables
set that the table does not know, with the nearest known name where one is close (a misspelt
variable would otherwise do nothing); it speaks once per process, and only on rank 0 under
torchrun (RANK unset or 0). Importing this module calls it.
"""
from __future__ import annotations

import os
import sys
from typing import Optional

from . import _distca

__all__ = ["get", "table", "warn_unknown"]

_TABLE: list[dict] = _distca.knobs()
_NAMES: frozenset[str] = frozenset(k["name"] for k in _TABLE)
_has_warned = False


def table() -> list[dict]:
    """The table, in the order distca --help-env prints it: a dict per variable with name, default
    ("unset" where absence is the default), meaning and used_by ("C++", "Python", "scripts",
    "tests"). A copy: changing it changes nothing."""
    return [dict(k, used_by=list(k["used_by"])) for k in _TABLE]


def get(name: str) -> Optional[str]:
    """The value of the DISTCA_* variable `name` in the environment, or None where it is unset.
    ValueError where the table has no such variable: add it to src/core/knobs.cc first."""
    if name not in _NAMES:
        raise ValueError(f"{name!r} is not in distca's table of environment variables (src/core/knobs.cc; "
                         "distca --help-env lists them): add it there, with its default and meaning, before reading it")
    return os.environ.get(name)


def warn_unknown() -> None:
    """One line on stderr naming the DISTCA_* variables set that the table does not know; nothing
    where all are known, after the first call, or on a rank other than 0."""
    global _has_warned
    if _has_warned or os.environ.get("RANK", "0") not in ("", "0"):
        return
    _has_warned = True
    line = _distca.unknown_knobs_warning(sorted(k for k in os.environ if k.startswith("DISTCA_")))
    if line:
        print(line, file=sys.stderr, flush=True)


warn_unknown()
