#!/usr/bin/env python3
"""Checks a data-parallel run: several processes (one per GPU) that ran the golden cases at
the same time on one cache directory that was empty when they started.

    check_shared_cache.py VERIFY.json GOLDEN.json [GOLDEN.json ...]

VERIFY.json is `rope-jit-cache verify --json` of that directory afterwards; each GOLDEN.json
is one process's `rope-jit-golden --json` output (with its "kernels" counters). Passes when
every process passed every case, the processes together compiled each kernel exactly once
(the compiles add up to the cache's entries, and so do the entries written), every process
got the kernels it did not compile from the disk cache, and verify is clean. Prints one line
per process and a summary; exit status 0 on success, 1 otherwise.
"""

import json
import sys


def main(argv):
    if len(argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    with open(argv[1]) as f:
        verify = json.load(f)
    runs = []
    for path in argv[2:]:
        with open(path) as f:
            runs.append((path, json.load(f)))

    problems = []
    totals = verify["totals"]
    entries = totals["ok"]["count"]
    for kind in ("damaged", "set-aside", "stale", "stray", "temp"):
        if totals[kind]["count"]:
            problems.append(f"verify: {totals[kind]['count']} {kind} item(s)")
    if not verify.get("healthy", False):
        problems.append("verify: the cache is not healthy")

    compiles = writes = 0
    for path, run in runs:
        kernels = run["kernels"]
        compiles += kernels["compiles"]
        writes += kernels["disk_writes"]
        loaded = kernels["compiles"] + kernels["disk_hits"]
        print(f"{path}: {run['passed']} passed, {run['failed']} failed; kernels: {kernels['compiles']} compiled, "
              f"{kernels['disk_hits']} from the disk cache, {kernels['disk_writes']} written, "
              f"{kernels['launches']} launches")
        if run["failed"] or not run["passed"]:
            problems.append(f"{path}: {run['failed']} case(s) failed")
        # Each process needs every kernel of the cases once (one context per process).
        if loaded != entries:
            problems.append(f"{path}: {loaded} kernels compiled or read from disk, the cache holds {entries}")

    print(f"cache: {entries} good entries; compiled {compiles} times in all, written {writes} times")
    if compiles != entries:
        problems.append(f"{compiles} compiles for {entries} kernels: some kernel was compiled more than once "
                        "(or a compiled kernel is missing from the cache)")
    if writes != entries:
        problems.append(f"{writes} entries written for {entries} kernels")
    for problem in problems:
        print("FAIL: " + problem)
    if not problems:
        print(f"ok: each of the {entries} kernels was compiled and stored once, and every process used it")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
