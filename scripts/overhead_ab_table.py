"""Prints python/benchmarks/call_overhead.py's rows (best microseconds per call) side by side
for several logs of one machine, e.g. a baseline tree and this one in turns, from
scripts/device_check.sh's step overhead-ab:
    python3 scripts/overhead_ab_table.py LOG...   (columns named by the logs' file names)
A row is a section (the kind of tensors) and its label, so that the same label under NumPy,
torch CPU and torch CUDA tensors stays apart.
"""
import os
import re
import sys

# "  <label>   12.34 us  (median   13.45 us)"
ROW = re.compile(r"^(\s+)(.*?)\s+([0-9.]+) us\s+\(median\s+([0-9.]+) us\)")


def rows_of(path):
    """{(section, label): best us}; an indented "of which ..." row's label is its parent's
    plus its own (every parent has the same two)."""
    rows, section, parent = {}, "", ""
    with open(path) as file:
        for line in file:
            match = ROW.match(line)
            if match:
                label = match.group(2).strip()
                if len(match.group(1)) > 2:
                    label = f"{parent} / {label.removeprefix('of which ')}"
                else:
                    parent = label
                rows[(section, label)] = float(match.group(3))
            elif line.rstrip().endswith(":") and not line.startswith(" "):
                section = line.strip().rstrip(":")  # (other lines: warnings, the header)
    return rows


def main():
    logs = sys.argv[1:]
    tables = [rows_of(path) for path in logs]
    names = [os.path.splitext(os.path.basename(path))[0] for path in logs]
    common = len(os.path.commonprefix(names)) if len(names) > 1 else 0
    names = [name[common:] or name for name in names]
    keys = []  # in the first log's order; a later log's own rows after their section's
    for table in tables:
        for key in table:
            if key in keys:
                continue
            same_section = [i for i, known in enumerate(keys) if known[0] == key[0]]
            keys.insert(same_section[-1] + 1 if same_section else len(keys), key)
    section = None
    for key in keys:
        if key[0] != section:
            section = key[0]
            print(f"{section[:60]}\n{'':90s}" + "".join(f"{name[-12:]:>13s}" for name in names))
        cells = "".join(
            f"{table[key]:13.2f}" if key in table else f"{'-':>13s}" for table in tables
        )
        print(f"  {key[1][:88]:88s}{cells}")


if __name__ == "__main__":
    main()
