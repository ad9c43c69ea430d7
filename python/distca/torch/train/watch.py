"""How the trainer (distca.torch.train) ends when a collective fails: a heartbeat per rank, so that
a rank whose collective timed out names the rank it waited for, and the one line it prints.

Why a heartbeat: gloo says only "Timed out waiting 20000ms for recv operation to complete" (or,
on the next call over that pair, "Application timeout caused pair closure"), never on whom. So
in the process group's store (the rendezvous store: torchrun's, or init_process_group's) every
rank's Watch thread counts under the rank's key every BEAT_SECONDS, and the rank writes where it
is (step, phase, backend) under another as it gets there (one small write per phase, a few per
step). A rank whose collective failed reads every rank's count, waits SILENT_SECONDS and reads
them again:

  1. a rank whose count did not move gives no sign of life: stopped (SIGSTOP), hung outside
     Python, or gone; it is the one named;
  2. else a rank whose last place is behind this rank's (every rank passes the same places in the
     same order, so their counts compare) is named with where it is;
  3. else the line says it waited for the other ranks.

The lowest rank that is alive prints the line (so a job prints one), naming itself; the others
end silently. Exit status 1 (the CLI's "the run failed": docs/cli.md).
"""
from __future__ import annotations

import datetime
import re
import threading
import time
from typing import Any, Optional

import torch.distributed as dist

BEAT_SECONDS = 0.5
SILENT_SECONDS = 1.5          # three beats: a live rank's count moves in this window
STORE_SECONDS = 2.0           # how long the failing rank waits for the store itself to answer
_BEAT = "distca.torch.train/beat/"      # + rank: the heartbeat's count
_AT = "distca.torch.train/at/"          # + rank: "place where", place counting the places passed

# The words PyTorch's gloo and NCCL use for a collective that timed out, or whose peer went away.
_TIMED_OUT = re.compile(r"timed out|timeout|pair closure", re.IGNORECASE)
_PEER_GONE = re.compile(r"connection (closed|reset) by peer|connection refused|broken pipe|socket closed|"
                        r"NCCL communicator was aborted|remote process exited", re.IGNORECASE)


def collective_failure(e: BaseException) -> Optional[str]:
    """'timed out' or 'failed' when `e` is a collective's failure (gloo's or NCCL's), else None
    (an error of the trainer's own code keeps its traceback)."""
    if not isinstance(e, RuntimeError):
        return None
    text = str(e)
    if _TIMED_OUT.search(text):
        return "timed out"
    if isinstance(e, dist.DistError) or _PEER_GONE.search(text) or "gloo" in text:
        return "failed"
    return None


class CollectiveFailure(Exception):
    """A collective of the run failed (timed out, or a peer went away): exit status 1. `line` is
    the one line to print, None on a rank that stays silent (a lower live rank prints)."""

    def __init__(self, line: Optional[str]):
        super().__init__(line or "a collective failed (another rank reports it)")
        self.line = line


class Watch:
    """This rank's heartbeat (see the module docstring); `at(where)` names the place it enters."""

    def __init__(self, rank: int, world: int):
        self.rank, self.world = rank, world
        self.where, self.place = "start-up", 0
        self._count = 0
        self._stop = threading.Event()
        self._store: Any = None      # the process group's store (a c10d Store), None in a world of one
        if world > 1:
            try:
                self._store = dist.distributed_c10d._get_default_store()
            except (AttributeError, KeyError, RuntimeError, ValueError):
                self._store = None       # no store to be read: the line names no rank
        self._thread: Optional[threading.Thread] = None
        if self._store is not None:
            self._beat()
            self.at(self.where)
            self._thread = threading.Thread(target=self._run, name="distca-heartbeat", daemon=True)
            self._thread.start()

    def at(self, where: str) -> None:
        """This rank enters `where` (every rank passes the same places in the same order)."""
        self.where, self.place = where, self.place + 1
        if self._store is not None:
            self._store.set(f"{_AT}{self.rank}", f"{self.place} {where}")

    def _beat(self) -> None:
        self._count += 1
        self._store.set(f"{_BEAT}{self.rank}", str(self._count))

    def _run(self) -> None:
        while not self._stop.wait(BEAT_SECONDS):
            try:
                self._beat()
            except Exception:  # noqa: BLE001 (the store is gone: the run is ending anyway)
                return

    def close(self) -> None:
        """Stops the heartbeat (joined: no thread of ours is left in the store at exit)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=STORE_SECONDS)
            self._thread = None

    def _board(self) -> Optional[dict]:
        """{rank: (count, place, where)} of every other rank that has beaten, None when the store
        does not answer."""
        out = {}
        try:
            for r in range(self.world):
                if r == self.rank or not self._store.check([f"{_BEAT}{r}", f"{_AT}{r}"]):
                    continue
                place, where = self._store.get(f"{_AT}{r}").decode().split(" ", 1)
                out[r] = (int(self._store.get(f"{_BEAT}{r}")), int(place), where)
        except Exception:  # noqa: BLE001 (a store hosted by the stalled rank, or gone)
            return None
        return out

    def failure(self, kind: str, what: str, timeout: float) -> CollectiveFailure:
        """The ending of this rank's collective failure: the other ranks' beats read twice,
        SILENT_SECONDS apart, and the line (on the lowest live rank) naming what failed and on whom."""
        seconds = f"{timeout:g} s"
        head = (f"rank {self.rank}: a collective in {what} timed out after {seconds} (--timeout)" if kind == "timed out"
                else f"rank {self.rank}: a collective in {what} failed (a peer closed its connection)")
        if self._store is None:
            return CollectiveFailure(f"{head}, waiting for the other ranks" if self.rank == 0 else None)
        try:
            self._store.set_timeout(datetime.timedelta(seconds=STORE_SECONDS))
        except Exception:  # noqa: BLE001
            pass
        before = self._board()
        time.sleep(SILENT_SECONDS)
        after = self._board()
        if before is None or after is None:
            return CollectiveFailure(f"{head}; the rendezvous store does not answer either (its host, rank 0 or "
                                     f"torchrun, is stopped or gone)" if self.rank != 0 else None)
        others = [r for r in range(self.world) if r != self.rank]
        silent = [r for r in others if r not in after or before.get(r, (None,))[0] == after[r][0]]
        live = sorted(set(range(self.world)) - set(silent))
        if live[0] != self.rank:
            return CollectiveFailure(None)
        if silent:
            ranks = ", ".join(map(str, silent))
            last = "; ".join(f"rank {r} last in {after[r][2]}" if r in after else f"rank {r} never beat"
                             for r in silent)
            return CollectiveFailure(f"{head}, waiting for rank{'s' if len(silent) > 1 else ''} {ranks}: no sign of "
                                     f"life for {SILENT_SECONDS:g} s (stopped, hung or gone; {last})")
        behind = [r for r in others if after[r][1] < self.place]
        if behind:
            where = "; ".join(f"rank {r} in {after[r][2]}" for r in behind)
            return CollectiveFailure(f"{head}, waiting for rank{'s' if len(behind) > 1 else ''} "
                                     f"{', '.join(map(str, behind))}, alive but behind ({where})")
        return CollectiveFailure(f"{head}, waiting for the other ranks (every one alive, none behind)")
