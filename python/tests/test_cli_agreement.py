"""The Python package and the `distca` command line agree: same figures, same hashes, same plan
files, same error messages (they run the same C++ code, so floats should be bit-identical; the
comparison allows 1e-12 relative).

Reads the four reference batches from $DISTCA_SHARED_DATA/reference (default
<repo>/../shared/data/reference) and runs the binary at $DISTCA_BIN (default
<repo>/build/src/tools/distca); tests that need either are skipped when it is missing.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import distca

REPO = Path(__file__).resolve().parents[2]
DATA = Path(os.environ.get("DISTCA_SHARED_DATA") or REPO.parent / "shared" / "data")
REFERENCE = DATA / "reference"
CLI = Path(os.environ.get("DISTCA_BIN") or REPO / "build" / "src" / "tools" / "distca")

BATCH_NAMES = ["batch_prolong_r64", "batch_prolong_r512", "batch_wlbllm_r64", "batch_wlbllm_r512"]
POLICIES = ["none", "distca", "minmax", "minbytes", "minlink"]
CLI_ONLY_KEYS = {"workload", "seed"}  # the CLI adds these; Plan.report() leaves them out
TIMING_KEYS = {"plan_ms"}  # a measurement, different on every run
REL = 1e-12

SIM_ARGS = ["--gpus", "16", "--tp", "8", "--context", "64K", "--iterations", "1", "--seed", "3"]
SIM_KWARGS = dict(gpus=16, tp=8, context="64K", system="all", iterations=1, seed=3)

needs_cli = pytest.mark.skipif(not CLI.is_file(), reason=f"no distca binary at {CLI} (set DISTCA_BIN)")


# ---------------------------------------------------------------------------------------------
# Helpers

def batch_path(name: str) -> Path:
    path = REFERENCE / f"{name}.json"
    if not path.is_file():
        pytest.skip(f"no {path} (set DISTCA_SHARED_DATA to the shared data folder)")
    return path


def run_cli(*args: Any) -> subprocess.CompletedProcess:
    return subprocess.run([str(CLI), *map(str, args)], capture_output=True, text=True, timeout=120)


def cli_json(*args: Any) -> dict:
    done = run_cli(*args)
    assert done.returncode == 0, f"distca {' '.join(map(str, args))} failed ({done.returncode}): {done.stderr}"
    return json.loads(done.stdout)


def cli_error(subcommand: str, *args: Any) -> str:
    """The message of a failing `distca SUBCOMMAND ARGS`: exit status 2, one line on stderr
    `distca SUBCOMMAND: error: MSG`, nothing on stdout."""
    done = run_cli(subcommand, *args)
    assert done.returncode == 2, f"expected exit 2, got {done.returncode}: {done.stdout} {done.stderr}"
    assert done.stdout == ""
    prefix = f"distca {subcommand}: error: "
    line = done.stderr.rstrip("\n")
    assert line.startswith(prefix) and "\n" not in line, repr(done.stderr)
    return line[len(prefix):]


def assert_same(cli: Any, py: Any, path: str = "$", skip: frozenset = frozenset()) -> None:
    """Every key of `cli` (but those in `skip`: at the top level, and timings at any depth) is in `py`
    with the same value: ints, strings, bools and None exactly (and of the same JSON type), floats to
    REL relative."""
    if isinstance(cli, dict):
        assert isinstance(py, dict), f"{path}: CLI has an object, Python {py!r}"
        for key, value in cli.items():
            if key in skip:
                continue
            assert key in py, f"{path}.{key}: printed by the CLI, missing from Python"
            assert_same(value, py[key], f"{path}.{key}", skip & TIMING_KEYS)
    elif isinstance(cli, list):
        assert isinstance(py, list), f"{path}: CLI has a list, Python {py!r}"
        assert len(cli) == len(py), f"{path}: CLI has {len(cli)} items, Python {len(py)}"
        for i, (a, b) in enumerate(zip(cli, py)):
            assert_same(a, b, f"{path}[{i}]", skip & TIMING_KEYS)
    elif isinstance(cli, float):
        assert type(py) is float, f"{path}: CLI {cli!r} (float), Python {py!r} ({type(py).__name__})"
        assert cli == py or math.isclose(cli, py, rel_tol=REL, abs_tol=0.0), f"{path}: CLI {cli!r}, Python {py!r}"
    else:
        assert type(py) is type(cli), f"{path}: CLI {cli!r} ({type(cli).__name__}), Python {py!r} ({type(py).__name__})"
        assert cli == py, f"{path}: CLI {cli!r}, Python {py!r}"


def close(a: float, b: float) -> bool:
    return a == b or math.isclose(a, b, rel_tol=REL, abs_tol=0.0)


# ---------------------------------------------------------------------------------------------
# Module-scoped caches: each CLI call and each distca.plan call runs once.

@pytest.fixture(scope="module")
def cli_report():
    cache: dict = {}

    def get(name: str, policy: str) -> dict:
        if (name, policy) not in cache:
            cache[name, policy] = cli_json("plan", "--batch", batch_path(name), "--policy", policy, "--json")
        return cache[name, policy]

    return get


@pytest.fixture(scope="module")
def py_plan():
    cache: dict = {}

    def get(name: str, policy: str) -> distca.Plan:
        if (name, policy) not in cache:
            cache[name, policy] = distca.plan(batch_path(name), policy=policy)
        return cache[name, policy]

    return get


@pytest.fixture
def small_batch(tmp_path) -> Path:
    path = tmp_path / "small.json"
    path.write_text(json.dumps({"ranks": [[4096, 1024], [2048], [512, 512, 512]]}))
    return path


# ---------------------------------------------------------------------------------------------
# distca.plan vs distca plan --json

def test_policies_are_the_four():
    assert distca.planner_names() == POLICIES


@needs_cli
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name", BATCH_NAMES)
def test_plan_report_agrees_with_cli(name, policy, cli_report, py_plan):
    cli = cli_report(name, policy)
    plan = py_plan(name, policy)
    report = plan.report()
    # The CLI's object is the report plus the workload and seed it adds.
    assert set(report) == set(cli) - CLI_ONLY_KEYS
    assert cli["workload"] == str(batch_path(name))
    assert_same(cli, report, skip=frozenset(CLI_ONLY_KEYS | TIMING_KEYS))
    assert cli["policy"] == policy == plan.policy
    assert isinstance(report["plan_ms"], float) and report["plan_ms"] >= 0
    assert report["plan_ms"] == plan.plan_ms

    # The hash is printed as 16 hex digits.
    assert isinstance(cli["hash"], str) and len(cli["hash"]) == 16
    assert f"{plan.hash:016x}" == cli["hash"]
    assert int(cli["hash"], 16) == plan.hash
    assert len(plan.tasks) == cli["tasks"]
    assert plan.num_ranks == cli["ranks"]
    assert plan.verify() is True
    assert plan.is_balanced == cli["balanced"]
    assert plan.note == cli["note"]
    assert close(plan.tolerance, cli["tolerance"])
    for key in ("max", "mean", "imbalance", "pairs_imbalance"):
        assert close(plan.load[key], cli["load_after"][key]), (key, plan.load[key], cli["load_after"][key])
    # The tasks: sorted by (server, doc, q0, k0), on the plan's servers.
    tasks = plan.tasks
    assert tasks.dtype == distca.TASK_DTYPE
    order = np.lexsort((tasks["k0"], tasks["q0"], tasks["doc"], tasks["server"]))
    assert np.array_equal(order, np.arange(len(tasks)))
    assert tasks["server"].min() >= 0 and tasks["server"].max() < plan.num_ranks
    assert close(float(plan.server_seconds.max()), cli["load_after"]["max"])


@needs_cli
@pytest.mark.parametrize("form", ["dict", "list"])
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name", ["batch_prolong_r64", "batch_wlbllm_r512"])
def test_plan_from_parsed_batch_agrees_with_cli(name, policy, form, cli_report, py_plan):
    with open(batch_path(name)) as f:
        parsed = json.load(f)
    assert set(parsed) == {"ranks"}
    batch = parsed if form == "dict" else parsed["ranks"]
    plan = distca.plan(batch, policy=policy)
    cli = cli_report(name, policy)
    assert_same(cli, plan.report(), skip=frozenset(CLI_ONLY_KEYS | TIMING_KEYS))
    assert f"{plan.hash:016x}" == cli["hash"]
    assert plan.hash == py_plan(name, policy).hash
    assert np.array_equal(plan.tasks, py_plan(name, policy).tasks)


@needs_cli
def test_plan_with_options_agrees_with_cli(tmp_path):
    """Non-default options travel the same way: model, tolerance, granularity, byte budget, profile."""
    name = "batch_wlbllm_r64"
    profile = distca.profile.default()
    profile["name"] = "slow-link"
    profile["inter_node"] = dict(profile["inter_node"], bytes_per_second=profile["inter_node"]["bytes_per_second"] / 4)
    profile_path = tmp_path / "profile.json"
    distca.profile.save(profile, profile_path)
    cases = [
        (["--policy", "minmax", "--tolerance", "0.01", "--granularity", "256"],
         dict(policy="minmax", tolerance=0.01, granularity=256)),
        (["--policy", "minbytes", "--max-rank-bytes", "auto", "--model", "llama-34b"],
         dict(policy="minbytes", max_rank_bytes="auto", model="llama-34b")),
        (["--policy", "minbytes", "--max-rank-bytes", "200000000", "--gpus-per-node", "4"],
         dict(policy="minbytes", max_rank_bytes=200000000, gpus_per_node=4)),
        (["--policy", "distca", "--model", "custom", "--layers", "4", "--hidden", "1024", "--heads", "8",
          "--kv-heads", "2", "--head-dim", "128", "--ffn-hidden", "4096", "--dtype-bytes", "2", "--tp", "2"],
         dict(policy="distca", model=dict(layers=4, hidden=1024, heads=8, kv_heads=2, head_dim=128,
                                          ffn_hidden=4096, dtype_bytes=2, tp=2))),
        (["--policy", "minlink", "--grad-return", "bf16"], dict(policy="minlink", grad_return="bf16")),
        (["--policy", "minbytes", "--max-server-bytes", "0"], dict(policy="minbytes", max_server_bytes=0)),
        (["--policy", "minlink", "--max-server-bytes", "150000000"], dict(policy="minlink", max_server_bytes=150000000)),
        (["--policy", "minbytes", "--profile", profile_path, "--max-rank-bytes", "auto"],
         dict(policy="minbytes", profile=profile_path, max_rank_bytes="auto")),
    ]
    for args, kwargs in cases:
        cli = cli_json("plan", "--batch", batch_path(name), *args, "--json")
        plan = distca.plan(batch_path(name), **kwargs)
        assert_same(cli, plan.report(), skip=frozenset(CLI_ONLY_KEYS | TIMING_KEYS))
        assert f"{plan.hash:016x}" == cli["hash"]
    assert cli["profile"] == "slow-link"


# ---------------------------------------------------------------------------------------------
# Bad input: the CLI's message, word for word

OPTION_ERRORS = [
    (["--tolerance", "3"], dict(tolerance=3)),
    (["--tolerance", "2", "--policy", "minlink"], dict(tolerance=2, policy="minlink")),
    (["--tolerance", "-0.1"], dict(tolerance=-0.1)),
    (["--granularity", "100"], dict(granularity=100)),
    (["--policy", "nope"], dict(policy="nope")),
    (["--policy", "none", "--granularity", "128"], dict(policy="none", granularity=128)),
    (["--policy", "none", "--max-rank-bytes", "auto"], dict(policy="none", max_rank_bytes="auto")),
    (["--max-rank-bytes", "-5"], dict(max_rank_bytes="-5")),
    (["--max-rank-bytes", "12abc"], dict(max_rank_bytes="12abc")),
    (["--max-server-bytes", "-5"], dict(max_server_bytes=-5)),
    (["--policy", "distca", "--max-server-bytes", "0"], dict(policy="distca", max_server_bytes=0)),
    (["--model", "custom", "--heads", "4"], dict(model={"preset": "custom", "heads": 4})),
    (["--model", "llama-99b"], dict(model="llama-99b")),
    (["--grad-return", "fp8"], dict(grad_return="fp8")),
]


@needs_cli
@pytest.mark.parametrize("args,kwargs", OPTION_ERRORS, ids=[" ".join(a) for a, _ in OPTION_ERRORS])
def test_option_error_matches_cli(args, kwargs, small_batch):
    message = cli_error("plan", "--batch", small_batch, *args, "--json")
    with pytest.raises(ValueError) as raised:
        distca.plan(small_batch, **kwargs)
    # The same check and words, naming the Python arguments where the CLI names its flags.
    assert str(raised.value) == distca.python_names(message)
    assert "--" not in str(raised.value), str(raised.value)


BATCH_ERRORS = {
    "empty rank": [[100, 200], []],
    "zero length": [[100, 0]],
    "negative length": [[100, -3]],
    "fractional length": [[100, 2.5]],
    "string length": [[100, "x"]],
}


@needs_cli
@pytest.mark.parametrize("ranks", list(BATCH_ERRORS.values()), ids=list(BATCH_ERRORS))
def test_batch_error_matches_cli(ranks, tmp_path):
    path = tmp_path / "bad_batch.json"
    path.write_text(json.dumps({"ranks": ranks}))
    message = cli_error("plan", "--batch", path, "--json")
    origin = f"{path}: "
    assert message.startswith(origin), message
    # A path: the same origin, the same message.
    with pytest.raises(ValueError) as raised:
        distca.plan(path)
    assert str(raised.value) == message
    with pytest.raises(ValueError) as raised:
        distca.plan(str(path), policy="minmax")
    assert str(raised.value) == message
    # Parsed (a list of ranks or {"ranks": ...}): the same message, from "batch".
    for parsed in (ranks, {"ranks": ranks}):
        with pytest.raises(ValueError) as raised:
            distca.plan(parsed)
        assert str(raised.value) == "batch: " + message[len(origin):]


# ---------------------------------------------------------------------------------------------
# simulate

@pytest.fixture(scope="module")
def cli_simulation():
    if not CLI.is_file():
        pytest.skip(f"no distca binary at {CLI}")
    return cli_json("simulate", *SIM_ARGS, "--json")


def test_simulate_agrees_with_cli(cli_simulation):
    report = distca.simulate(**SIM_KWARGS)
    assert set(report) == set(cli_simulation)
    assert_same(cli_simulation, report)
    assert report["gpus"] == 16 and report["seed"] == 3 and report["iterations"] == 1
    systems = {s["system"] for s in report["systems"]}
    assert {"colocated", "wlb"} <= systems and len(systems) >= 3


@needs_cli
def test_simulate_bad_input():
    message = cli_error("simulate", "--tolerance", "2", "--json")
    with pytest.raises(ValueError) as raised:
        distca.simulate(tolerance=2)
    assert str(raised.value) == distca.python_names(message) and "--" not in str(raised.value)
    with pytest.raises(ValueError, match="unknown option"):
        distca.simulate(gpu=16)
    with pytest.raises(ValueError, match="unknown option"):
        distca.simulate(gpus=16, no_such_flag=True)


# ---------------------------------------------------------------------------------------------
# Plan files

def test_plan_json_round_trip(py_plan):
    plan = py_plan("batch_prolong_r64", "minmax")
    loaded = distca.load_plan(plan.to_json())
    assert loaded.hash == plan.hash
    assert loaded.policy == "minmax"
    assert loaded.tolerance == plan.tolerance
    assert loaded.model == "llama-8b"
    assert loaded.tasks.dtype == distca.TASK_DTYPE
    assert np.array_equal(loaded.tasks, plan.tasks)
    assert loaded.batch.num_ranks == plan.num_ranks
    again = distca.Plan.from_json(plan.to_json())
    assert again.hash == plan.hash


@needs_cli
@pytest.mark.parametrize("name,policy", [("batch_prolong_r64", "minmax"), ("batch_wlbllm_r512", "minbytes"),
                                         ("batch_wlbllm_r64", "distca"), ("batch_prolong_r64", "none")])
def test_cli_plan_file_loads_with_the_same_hash(name, policy, tmp_path, py_plan):
    out = tmp_path / "plan.json"
    cli = cli_json("plan", "--batch", batch_path(name), "--policy", policy, "--out", out, "--json")
    plan = py_plan(name, policy)
    text = out.read_text()
    loaded = distca.load_plan(text)
    assert loaded.hash == plan.hash
    assert f"{loaded.hash:016x}" == cli["hash"]
    assert loaded.policy == policy
    assert np.array_equal(loaded.tasks, plan.tasks)
    # The whole file: what Plan.to_json gives, key for key.
    assert_same(json.loads(text), json.loads(plan.to_json()))


def test_tampered_plan_file_is_refused(py_plan):
    plan = py_plan("batch_prolong_r64", "minmax")
    text = plan.to_json()
    d = json.loads(text)
    assert d["format"] == "distca-plan" and d["version"] == 1
    task = d["tasks"][5]
    task[5] = (task[5] + 1) % plan.num_ranks  # another server
    with pytest.raises(ValueError, match="hash"):
        distca.load_plan(json.dumps(d))
    d = json.loads(text)
    d["tasks"][5][2] -= 1  # a query range one row short: a pair goes uncomputed
    with pytest.raises(ValueError):
        distca.load_plan(json.dumps(d))
    d = json.loads(text)
    d["tasks"].pop()
    with pytest.raises(ValueError):
        distca.load_plan(json.dumps(d))
    with pytest.raises(ValueError):
        distca.load_plan(text[: len(text) // 2])


# ---------------------------------------------------------------------------------------------
# Profiles

def test_default_profile_round_trip(tmp_path):
    default = distca.profile.default()
    assert default["format"] == "distca-profile" and default["version"] == 1
    path = tmp_path / "profile.json"
    distca.profile.save(default, path)
    assert distca.profile.load(path) == default
    assert distca.profile.load(str(path)) == default


@needs_cli
@pytest.mark.parametrize("field", ["linear_flops_per_second", "inter_node", "attention", "name"])
def test_profile_missing_field(field, tmp_path):
    bad = distca.profile.default()
    del bad[field]
    target = tmp_path / "saved.json"
    with pytest.raises(ValueError, match=field):
        distca.profile.save(bad, target)
    assert not target.exists()  # checked before anything is written
    with pytest.raises(ValueError, match=field):
        distca.profile.check(bad)
    path = tmp_path / "bad_profile.json"
    path.write_text(json.dumps(bad))
    with pytest.raises(ValueError, match=field):
        distca.profile.load(path)
    message = cli_error("simulate", "--profile", path, "--json")
    assert message.startswith(f"{path}: ")
    with pytest.raises(ValueError) as raised:
        distca.simulate(profile=path)
    assert str(raised.value) == message


@needs_cli
def test_simulate_with_profile_agrees_with_cli(tmp_path, cli_simulation):
    profile = distca.profile.default()
    profile["name"] = "test-slow-link"
    profile["inter_node"] = dict(profile["inter_node"], bytes_per_second=profile["inter_node"]["bytes_per_second"] / 8)
    path = tmp_path / "profile.json"
    distca.profile.save(profile, path)
    cli = cli_json("simulate", "--profile", path, *SIM_ARGS, "--json")
    assert cli["profile"] == "test-slow-link"
    for given in (path, str(path), distca.profile.load(path)):
        report = distca.simulate(profile=given, **SIM_KWARGS)
        assert set(report) == set(cli)
        assert_same(cli, report)
    # The profile was used: the slower link changes the prices.
    assert cli["systems"] != cli_simulation["systems"]


def test_tolerance_is_auto_by_default_and_says_what_it_picked(small_batch):
    """The default policy is minlink and the default eps auto: of the ladder 0.2, 0.1, ..., 0.2/128, the plan with the fastest
    predicted step of the few its search made (every rung predicted); the same plan as asking for that eps outright."""
    plan = distca.plan(small_batch)
    assert plan.policy == "minlink"  # the default policy: the least busy links
    report = plan.report()
    auto = report["tolerance_auto"]
    assert plan.tolerance == auto["tolerance"] == report["tolerance"]
    assert plan.tolerance in [0.2 / 2**k for k in range(8)]
    tried = auto["tried"]
    assert 1 <= len(tried) <= 8 and len(auto["ladder_predicted"]) == 8
    step = {t["tolerance"]: t["predicted_step_seconds_per_layer"] for t in tried}
    assert step[plan.tolerance] == min(step.values())
    assert distca.plan(small_batch, tolerance="auto").hash == plan.hash
    fixed = distca.plan(small_batch, tolerance=plan.tolerance)
    assert fixed.hash == plan.hash and fixed.report()["tolerance_auto"] is None
    with pytest.raises(TypeError, match=r"tolerance must be a number in \[0, 1\] or 'auto', got 'fast'"):
        distca.plan(small_batch, tolerance="fast")
