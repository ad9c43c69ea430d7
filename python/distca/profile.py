"""Profiles (format distca-profile, version 1): what one machine's kernels and links cost, as the
simulator prices them. Loaded and saved as plain dicts, checked by the C++ reader; read and written
by the C++ file layer (an input of at most DISTCA_MAX_INPUT_MB, an output replaced atomically and
only when it is a regular file)."""
from __future__ import annotations

import json
import os
from typing import Any, Mapping, Union

from . import _distca


def _path(path: Any) -> str:
    if not isinstance(path, (str, os.PathLike)) or not isinstance(os.fspath(path), str):
        raise TypeError(f"path must be a str or os.PathLike of str, got {type(path).__name__}")
    return os.fspath(path)


def dumps(profile: Mapping[str, Any]) -> str:
    """The profile as JSON text for the C++ reader; TypeError for what is not a dict, ValueError for
    inf or NaN (JSON holds neither)."""
    if not isinstance(profile, Mapping):
        raise TypeError(f"profile must be a dict, got {type(profile).__name__}")
    try:
        return json.dumps(dict(profile), allow_nan=False)
    except ValueError as e:
        raise ValueError(f"profile: {e} (a profile holds finite numbers)") from None
    except RecursionError:
        raise ValueError("profile: nested too deeply") from None


def default() -> dict:
    """The built-in H200 profile (every number with its source)."""
    return json.loads(_distca.default_profile_json())


def load(path: Union[str, os.PathLike]) -> dict:
    """Reads and checks a profile file; ValueError naming the file and the field when it is bad, or
    when the path is not a file (a directory, a device) or holds more than DISTCA_MAX_INPUT_MB."""
    return json.loads(_distca.load_profile_json(_path(path)))


def check(profile: Mapping[str, Any]) -> dict:
    """The profile as the C++ reader keeps it; ValueError when a field is missing or out of range."""
    return json.loads(_distca.check_profile_json(dumps(profile), "profile"))


def save(profile: Mapping[str, Any], path: Union[str, os.PathLike]) -> None:
    """Checks the profile, then writes it atomically: a new file renamed into place, so a failed
    write leaves no partial file. A symbolic link is followed (the file it names is replaced, the
    link stays); a directory, a device or a FIFO is refused with ValueError naming the path, and
    left as it was."""
    target = _path(path)
    checked = check(profile)
    _distca.write_file_atomic(target, json.dumps(checked, indent=2) + "\n")
