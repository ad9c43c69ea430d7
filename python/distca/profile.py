"""Profiles (format distca-profile, version 1): what one machine's kernels and links cost, as the
simulator prices them. Loaded and saved as plain dicts, checked by the C++ reader."""
from __future__ import annotations

import json
import os
from typing import Any, Union

from . import _distca


def default() -> dict:
    """The built-in H200 profile (every number with its source)."""
    return json.loads(_distca.default_profile_json())


def load(path: Union[str, os.PathLike]) -> dict:
    """Reads and checks a profile file; ValueError naming the file and the field when it is bad."""
    return json.loads(_distca.load_profile_json(os.fspath(path)))


def check(profile: dict) -> dict:
    """The profile as the C++ reader keeps it; ValueError when a field is missing or out of range."""
    return json.loads(_distca.check_profile_json(json.dumps(profile), "profile"))


def save(profile: dict, path: Union[str, os.PathLike]) -> None:
    """Checks the profile, then writes it atomically (a failed write leaves no partial file)."""
    checked = check(profile)
    _distca.write_file_atomic(os.fspath(path), json.dumps(checked, indent=2) + "\n")
