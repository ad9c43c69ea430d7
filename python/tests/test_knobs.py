"""distca.knobs: the table of DISTCA_* environment variables the native module holds (the one
`distca --help-env` prints), get() that refuses a name the table lacks, and the one warning line
for a DISTCA_* variable the table does not know (on import, once per process, rank 0 only)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

import distca
from distca import _distca, knobs

# What the package's own Python reads (python/distca): the table must have each.
READ_BY_PYTHON = {"DISTCA_MAX_INPUT_MB", "DISTCA_KERNEL_TABLE", "DISTCA_SHARED_DATA", "DISTCA_CPU_ISA"}


def test_the_table_is_the_native_modules():
    rows = knobs.table()
    assert [r["name"] for r in rows] == [k["name"] for k in _distca.knobs()]
    assert len({r["name"] for r in rows}) == len(rows), "each name once"
    assert READ_BY_PYTHON <= {r["name"] for r in rows}
    for r in rows:
        assert set(r) == {"name", "default", "meaning", "used_by"}, r
        assert r["name"].startswith("DISTCA_") and r["default"] and r["meaning"].endswith("."), r
        assert r["used_by"] and set(r["used_by"]) <= {"C++", "Python", "scripts", "tests"}, r
    by_name = {r["name"]: r for r in rows}
    assert by_name["DISTCA_MAX_INPUT_MB"]["default"] == "1024"
    assert "Python" in by_name["DISTCA_KERNEL_TABLE"]["used_by"]


def test_table_is_a_copy():
    knobs.table()[0]["name"] = "changed"
    knobs.table()[0]["used_by"].append("changed")
    assert knobs.table()[0] == _distca.knobs()[0]


def test_get_reads_the_environment(monkeypatch):
    monkeypatch.delenv("DISTCA_KERNEL_TABLE", raising=False)
    assert knobs.get("DISTCA_KERNEL_TABLE") is None
    monkeypatch.setenv("DISTCA_KERNEL_TABLE", "/tmp/table.json")
    assert knobs.get("DISTCA_KERNEL_TABLE") == "/tmp/table.json"
    monkeypatch.setenv("DISTCA_KERNEL_TABLE", "")
    assert knobs.get("DISTCA_KERNEL_TABLE") == "", "set but empty is not unset: the caller decides"


@pytest.mark.parametrize("name", ["DISTCA_CPU_ISAA", "DISTCA_NOT_A_KNOB", "OPENBLAS_CORETYPE", ""])
def test_get_refuses_a_name_not_in_the_table(monkeypatch, name):
    if name:
        monkeypatch.setenv(name, "1")  # set or not, a name outside the table is refused
    with pytest.raises(ValueError, match="not in distca's table of environment variables") as e:
        knobs.get(name)
    assert repr(name) in str(e.value) and "src/core/knobs.cc" in str(e.value)


def _distca_vars(monkeypatch, **values):
    """Only `values` among the DISTCA_* variables, and the once-per-process flag cleared."""
    for k in [k for k in os.environ if k.startswith("DISTCA_")]:
        monkeypatch.delenv(k)
    for k, v in values.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(knobs, "_has_warned", False)


def test_an_unknown_variable_is_one_line_naming_the_nearest(monkeypatch, capsys):
    _distca_vars(monkeypatch, DISTCA_CPU_ISAA="avx2", DISTCA_SHARED_DATA="/data")
    knobs.warn_unknown()
    err = capsys.readouterr().err
    assert err == ("distca: warning: DISTCA_CPU_ISAA is not a distca setting (did you mean DISTCA_CPU_ISA? "
                   "distca --help-env lists them)\n"), err
    knobs.warn_unknown()
    assert capsys.readouterr().err == "", "once per process"


def test_several_unknown_variables_are_one_line(monkeypatch, capsys):
    _distca_vars(monkeypatch, DISTCA_MAX_INPUT_MIB="8", DISTCA_ZZZZZZZZZZZZZZZZ="1")
    knobs.warn_unknown()
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("distca: warning: "), err
    assert "DISTCA_MAX_INPUT_MIB (did you mean DISTCA_MAX_INPUT_MB?)" in err, err
    assert "DISTCA_ZZZZZZZZZZZZZZZZ are not distca settings (distca --help-env lists them)" in err, err


def test_known_variables_and_other_ranks_say_nothing(monkeypatch, capsys):
    _distca_vars(monkeypatch, DISTCA_CPU_ISA="portable", DISTCA_TEST_LONG="1")
    knobs.warn_unknown()
    assert capsys.readouterr().err == ""
    _distca_vars(monkeypatch, DISTCA_CPU_ISAA="avx2")
    monkeypatch.setenv("RANK", "1")
    knobs.warn_unknown()
    assert capsys.readouterr().err == "", "rank 0 speaks for the job"


def _import_knobs(extra_env):
    """stderr of a fresh interpreter that imports distca.knobs with only `extra_env`'s DISTCA_*."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISTCA_") and k != "RANK"}
    env.update(extra_env)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(distca.__file__).parents[1])] +
                                        ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))
    run = subprocess.run([sys.executable, "-c", "import distca.knobs; import distca.knobs"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    return run.stderr


def test_importing_warns_once():
    err = _import_knobs({"DISTCA_PROGRES_INTERVAL": "0"})
    assert err == ("distca: warning: DISTCA_PROGRES_INTERVAL is not a distca setting (did you mean "
                   "DISTCA_PROGRESS_INTERVAL? distca --help-env lists them)\n"), err
    assert _import_knobs({"DISTCA_PROGRESS_INTERVAL": "0"}) == ""
