"""Test sizes: quick for the suite, soak for `scripts/test.sh --long`.

A randomized or repeated test has a size (random batches, training steps, repetitions) that is a
soak, not a separate check: each check runs at either size, and either size is large enough for
every assertion about it to mean something (the counts a test asserts scale with its size). The
suite (`scripts/test.sh`, plain `pytest`) runs the quick sizes; `scripts/test.sh --long` sets
DISTCA_TEST_LONG=1 and runs the soak sizes, the ones the suite ran before it was sized."""
from __future__ import annotations

import os


def soak(quick, full):
    """`full` where the environment has DISTCA_TEST_LONG=1 (scripts/test.sh --long), else `quick`."""
    return full if os.environ.get("DISTCA_TEST_LONG") == "1" else quick
