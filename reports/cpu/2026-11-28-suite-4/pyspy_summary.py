"""Summarises a py-spy raw profile of the Python suite (folded stacks, `frames... count` a line):
the share of samples by process, and, in the fork server's rank processes, by the module a rank
imported after the fork.

    py-spy record -r 25 --subprocesses --format raw -o pyspy.txt -- \
        .venv/bin/python -m pytest -q -p no:cacheprovider -n 2 --dist loadgroup python/tests
    python3 pyspy_summary.py pyspy.txt
"""
import collections
import re
import sys


def main(path):
    total = 0
    by_process = collections.Counter()
    importing = collections.Counter()
    rank_imports = collections.Counter()
    for line in open(path):
        m = re.match(r"(.*) (\d+)$", line.rstrip())
        if not m:
            continue
        stack, n = m.group(1).split(";"), int(m.group(2))
        total += n
        procs = [f for f in stack if f.startswith("process ")]
        proc = re.sub(r'^process \d+:"', "", procs[-1]) if procs else "?"
        name = "fork server and its ranks" if "multiprocessing.forkserver" in proc else proc[:70]
        by_process[name] += n
        frames = [f for f in stack if not f.startswith(("process ", "thread "))]
        first = next((i for i, f in enumerate(frames) if f.startswith("_find_and_load ")), None)
        if first is None:
            continue
        importing[name] += n
        in_rank = any(f.startswith("_worker (") for f in frames)
        mods = [re.sub(r":\d+\)$", ")", f) for f in frames[first:] if f.startswith("<module> (")]
        if name == "fork server and its ranks":
            rank_imports[("in a rank" if in_rank else "in the server", mods[0] if mods else "?")] += n
    print(f"{total} samples")
    print("\nby process: share of all samples, and of them importing")
    for k, v in by_process.most_common(12):
        print(f"  {100 * v / total:5.1f} %  importing {100 * importing[k] / total:5.1f} %  {k}")
    print("\nimports in the fork server's processes, by the first module imported")
    for (where, mod), v in rank_imports.most_common(12):
        print(f"  {100 * v / total:5.1f} %  {where}: {mod}")


if __name__ == "__main__":
    main(sys.argv[1])
