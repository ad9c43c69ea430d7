"""distca.simulate: one training iteration priced by the cluster simulator, as `distca simulate
--json` prices it.
"""
from __future__ import annotations

import json
import os
from typing import Any, Mapping, Union

import numpy as np

from . import _distca
from . import profile as _profiles
from .arguments import excerpt, integer_arg, number_arg, python_names, string_arg


def simulate(profile: Union[str, os.PathLike, Mapping[str, Any], None] = None, **options: Any) -> dict:
    """Prices one training iteration, as `distca simulate --json` does, and returns its report.

    Options (the command line's flags, dashes as underscores): model, gpus, gpus_per_node, tp, pp,
    cp, wlb_cp, context (e.g. "128K" or 131072), batch, workload, system, seed, tolerance,
    tolerance_sweep (bool, or "on"/"off"), iterations, keep_short, upsample, elongation,
    full_context_share. profile: a profile file's path or a profile dict (distca.profile).
    """
    request = _distca.SimRequest()
    for key, value in options.items():
        if not hasattr(request, key) or key.startswith("_"):
            raise ValueError(f"simulate: unknown option {excerpt(key)}")
        name = f"simulate: {key}"
        kind = type(getattr(request, key))  # the C++ field's type
        if key == "context":  # tokens, or text such as "128K"
            value = value if isinstance(value, str) else str(integer_arg(value, name))
        elif kind is bool:
            if isinstance(value, str):
                if value not in ("on", "off"):
                    raise ValueError(f"{name} must be on or off, got {excerpt(value)}")
                value = value == "on"
            elif not isinstance(value, (bool, np.bool_)):
                raise TypeError(f"{name} must be a bool or 'on'/'off', got {excerpt(value)}")
            value = bool(value)
        elif kind is int:
            value = integer_arg(value, name, 64 if key == "seed" else 32)
        elif kind is float:
            value = number_arg(value, name)
        else:
            value = string_arg(value, name)
        setattr(request, key, value)
    if profile is None:
        text = ""
    elif isinstance(profile, Mapping):
        text = _profiles.dumps(profile)
    elif isinstance(profile, (str, os.PathLike)):
        text = json.dumps(_profiles.load(profile))
    else:
        raise TypeError(f"simulate: profile must be a profile file's path or a dict, got {excerpt(profile)}")
    try:
        return json.loads(_distca.simulate_json(request, text))
    except ValueError as e:
        raise ValueError(python_names(str(e))) from None
