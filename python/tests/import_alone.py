"""Imports each module alone, one fresh interpreter for many modules (test_module_imports.py).

`python -c "import M"` per module is the plain check, but each such interpreter imports PyTorch
again (about 2 s of CPU each here). Instead one fresh interpreter (this file, run as a script)
imports only the third-party libraries it is told to, checks that no module of the package under
test is loaded, and then forks one child per module asked for: the child imports that module and
nothing else, so it starts from the same state as `python -c "import M"` after those libraries,
and no child sees what another imported. The child's output and traceback come back through a
pipe, with its exit status: 0 imported, 1 raised.

Protocol: the client (ImportChecker) writes one module name a line on the server's stdin; the
server answers one JSON line a module, {"module", "status", "output"}, on its stdout; EOF on stdin
ends it. Its first line is {"ready": [modules of the package already loaded]}, which must be empty.
"""
from __future__ import annotations

import importlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
import traceback

# Output kept from one child: the end of a long traceback is the part that names the failure.
MAX_OUTPUT = 1 << 16


def _import_in_child(module: str, deadline: float) -> tuple[int, str]:
    """Fork; the child imports `module` with its stdout and stderr on a pipe -> (status, output)."""
    sys.stdout.flush()
    sys.stderr.flush()
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into the server's loop
        status = 1
        try:
            os.close(read_end)
            os.dup2(write_end, 1)
            os.dup2(write_end, 2)
            try:
                importlib.import_module(module)
                status = 0
            except BaseException:  # noqa: BLE001 (SystemExit and KeyboardInterrupt at import fail it too)
                traceback.print_exc()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(status)
    os.close(write_end)
    chunks, size = [], 0
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([read_end], [], [], left)[0]:
                os.kill(pid, signal.SIGKILL)
                _, wait_status = os.waitpid(pid, 0)
                return (os.waitstatus_to_exitcode(wait_status),
                        b"".join(chunks).decode(errors="replace") + "\n(killed: still importing at the timeout)")
            chunk = os.read(read_end, 1 << 16)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
            while size > MAX_OUTPUT and len(chunks) > 1:
                size -= len(chunks.pop(0))
    finally:
        os.close(read_end)
    _, wait_status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(wait_status), b"".join(chunks).decode(errors="replace")


def serve(package: str, preload: list[str], paths: list[str], timeout: float) -> None:
    """The server's loop (in the fresh interpreter): preload, report, then one child per module."""
    sys.path[:1] = paths  # this file's folder out (as `python -c` has none), the given folders in
    for name in preload:
        importlib.import_module(name)
    protocol = sys.stdout
    sys.stdout = sys.stderr  # nothing else may write on the protocol's stream
    loaded = sorted(m for m in sys.modules if m == package or m.startswith(package + "."))
    protocol.write(json.dumps({"ready": loaded}) + "\n")
    protocol.flush()
    for line in sys.stdin:
        module = line.strip()
        status, output = _import_in_child(module, time.monotonic() + timeout)
        protocol.write(json.dumps({"module": module, "status": status, "output": output}) + "\n")
        protocol.flush()


class ImportChecker:
    """A server in a fresh interpreter that has imported `preload` (and nothing of `package`), with
    `paths` first on its sys.path (the working folder where none are given, as `python -c`).
    check(module) -> (exit status, output) of importing `module` alone in a forked child."""

    def __init__(self, package: str, preload: list[str], paths: list[str] | None = None, timeout: float = 120):
        self.timeout = timeout
        self.stderr = tempfile.TemporaryFile()
        args = json.dumps({"package": package, "preload": preload, "paths": paths if paths is not None else [""],
                           "timeout": timeout})
        self.proc = subprocess.Popen([sys.executable, __file__, args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.stderr)
        ready = self._answer(240)["ready"]
        if ready:
            self.close()
            raise AssertionError(f"importing {preload} loaded modules of {package} before any check: {ready}")

    def _answer(self, timeout: float) -> dict:
        """The server's next line, or AssertionError with its stderr where it ends or none comes in time."""
        if select.select([self.proc.stdout], [], [], timeout)[0]:
            line = self.proc.stdout.readline()
            if line:
                return json.loads(line)
        self.proc.kill()
        self.proc.wait()
        self.stderr.seek(0)
        said = self.stderr.read().decode(errors="replace")[-4000:]
        self.close()
        raise AssertionError(f"the import server gave no answer (waited at most {timeout} s; exit status "
                             f"{self.proc.returncode}):\n{said}")

    def check(self, module: str) -> tuple[int, str]:
        self.proc.stdin.write(module.encode() + b"\n")
        self.proc.stdin.flush()
        answer = self._answer(self.timeout + 30)
        assert answer["module"] == module, answer
        return answer["status"], answer["output"]

    def close(self) -> None:
        """EOF on the server's stdin ends it (killed if it does not end in 30 s)."""
        try:
            self.proc.stdin.close()
        except BrokenPipeError:  # it had ended already
            pass
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()
        self.stderr.close()


if __name__ == "__main__":
    serve(**json.loads(sys.argv[1]))
