#!/usr/bin/env python3
"""How many cores a long run kept busy, second by second and part by part (the whole suite's
reports: reports/cpu/suite-timings.md). Three steps, each a subcommand:

    dev/busy_cores/busy_cores.py sample > cpu.txt &                 # the machine's busy jiffies each second
    CI=true bash .ci/run 2>&1 | dev/busy_cores/busy_cores.py stamp > run.log   # the console, each line after its epoch second
    dev/busy_cores/busy_cores.py by-part cpu.txt run.log --window 60

`sample` reads the first line of /proc/stat (the whole machine, every process, so it also counts
the rank processes a test forks, which `time` on the test runner misses) and prints
`epoch jiffies idle_jiffies` a line, after a `# cores N` header. `by-part` splits the run at the
log lines that end a part (`test.sh: <part> took N s`, or --marks REGEX) and prints, for each part,
the mean busy cores and the idle core-seconds, then the mean over each window of --window seconds.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import time

STAT_FIELDS = 8  # user nice system idle iowait irq softirq steal (guest time is inside user)


def read_stat(path: str) -> tuple[int, int]:
    """(all jiffies, idle + iowait jiffies) since boot, from the `cpu` line of /proc/stat."""
    with open(path) as f:
        words = f.readline().split()
    if not words or words[0] != "cpu" or len(words) < 1 + STAT_FIELDS:
        raise ValueError(f"{path}: the first line is not the 'cpu' line of /proc/stat")
    values = [int(w) for w in words[1:1 + STAT_FIELDS]]
    return sum(values), values[3] + values[4]


def sample(args: argparse.Namespace) -> int:
    print(f"# cores {os.cpu_count()}", flush=True)
    total, idle = read_stat(args.stat)
    n = 0
    while args.count == 0 or n < args.count:
        time.sleep(args.interval)
        now_total, now_idle = read_stat(args.stat)
        print(f"{int(time.time())} {now_total - total} {now_idle - idle}", flush=True)
        total, idle, n = now_total, now_idle, n + 1
    return 0


def stamp(args: argparse.Namespace) -> int:
    for line in sys.stdin:
        sys.stdout.write(f"{int(time.time())} {line}")
        sys.stdout.flush()
    return 0


def read_samples(path: str) -> tuple[dict[int, float], int | None]:
    """Busy fraction of the machine at each epoch second, and the core count of the header."""
    busy: dict[int, float] = {}
    cores = None
    with open(path) as f:
        for number, line in enumerate(f, 1):
            m = re.match(r"^# cores (\d+)$", line.strip())
            if m:
                cores = int(m.group(1))
                continue
            try:
                t, total, idle = (int(w) for w in line.split())
            except ValueError:
                raise ValueError(f"{path}:{number}: expected 'epoch jiffies idle_jiffies', got {line.strip()[:80]!r}")
            busy[t] = 1 - idle / total if total else 0.0
    if not busy:
        raise ValueError(f"{path}: no samples")
    return busy, cores


def read_log(path: str) -> list[tuple[int, str]]:
    lines = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            epoch, _, text = line.rstrip("\n").partition(" ")
            if not epoch.isdigit():
                raise ValueError(f"{path}:{number}: a line must start with its epoch second ('stamp' writes them)")
            lines.append((int(epoch), text))
    if not lines:
        raise ValueError(f"{path}: empty")
    return lines


def by_part(args: argparse.Namespace) -> int:
    busy, header_cores = read_samples(args.cpu)
    cores = args.cores or header_cores or os.cpu_count() or 1
    log = read_log(args.log)
    marks = [(t, text) for t, text in log if re.search(args.marks, text)]
    if not marks:
        raise ValueError(f"{args.log}: no line matches --marks {args.marks!r}")
    t0 = prev = log[0][0]
    for t, text in marks:
        seconds = [busy[x] * cores for x in range(prev, t) if x in busy]
        mean = sum(seconds) / len(seconds) if seconds else 0.0
        idle = sum(cores - x for x in seconds)
        print(f"{prev - t0:5d}-{t - t0:5d}s  busy {mean:.2f} cores, idle core-s {idle:6.0f}  {text}")
        prev = t
    cells = []
    for start in range(t0, max(busy) + 1, args.window):
        seconds = [busy[x] * cores for x in range(start, start + args.window) if x in busy]
        if seconds:
            cells.append(f"{start - t0:5d}s {sum(seconds) / len(seconds):.2f}")
    print(" | ".join(cells))
    return 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="busy_cores.py", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("sample", help="print the machine's busy jiffies every --interval seconds")
    s.add_argument("--interval", type=float, default=1.0, help="seconds between samples (default 1)")
    s.add_argument("--count", type=int, default=0, help="samples to take, 0: until killed (default)")
    s.add_argument("--stat", default="/proc/stat", help=argparse.SUPPRESS)
    sub.add_parser("stamp", help="copy stdin to stdout, each line after its epoch second")
    p = sub.add_parser("by-part", help="busy cores in each part of a run, and per window")
    p.add_argument("cpu", help="what 'sample' printed")
    p.add_argument("log", help="the run's console as 'stamp' printed it")
    p.add_argument("--window", type=int, default=60, help="seconds per window of the last line (default 60)")
    p.add_argument("--cores", type=int, default=0, help="the sampled machine's cores (default: the header's)")
    p.add_argument("--marks", default=r"^test\.sh: .* took ", help="regex of the lines that end a part")
    args = parser.parse_args(argv)
    if args.command == "sample" and (args.interval <= 0 or args.count < 0):
        parser.error("--interval must be > 0 and --count >= 0")
    if args.command == "by-part" and (args.window < 1 or args.cores < 0):
        parser.error("--window must be >= 1 and --cores >= 0")
    try:
        return {"sample": sample, "stamp": stamp, "by-part": by_part}[args.command](args)
    except (OSError, ValueError, re.error) as e:
        print(f"busy_cores.py: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
