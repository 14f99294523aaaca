"""The SASS instructions with the most warp-state samples in an ncu source page exported as CSV
(`ncu --import R --page source --csv --print-source sass`), with each one's main stall reasons:
where a short kernel's time goes (scripts/device_check.sh, step rope-ncu-source).

    python3 scripts/ncu_source_top.py REPORT.csv [COUNT]
"""

import csv
import sys


def number(text):
    try:
        return float(str(text).replace(",", ""))
    except ValueError:
        return 0.0


def main():
    path = sys.argv[1]
    count = int(sys.argv[2]) if len(sys.argv) > 2 else 30
    lines = open(path, newline="").read().splitlines()
    # ncu may print notes before the table: the header is the first line naming the source.
    start = next((i for i, line in enumerate(lines) if "Source" in line and "," in line), 0)
    rows = list(csv.DictReader(lines[start:]))
    if not rows:
        print(f"no rows in {path}")
        return
    columns = list(rows[0].keys())
    total_column = next((c for c in columns if "Sampling (All" in c), None)
    if total_column is None:
        print("no warp-sampling column; columns:", columns)
        return
    # Per-reason samples (ncu also prints each reason's not-issued share: left out).
    stall_columns = [c for c in columns if c.startswith("stall_") and "Not Issued" not in c]
    total = sum(number(r[total_column]) for r in rows) or 1.0
    print(f"{len(rows)} instructions, {total:.0f} samples ({total_column})")
    order = sorted(range(len(rows)), key=lambda i: -number(rows[i][total_column]))
    for i in order[:count]:
        row = rows[i]
        samples = number(row[total_column])
        reasons = sorted(
            ((number(row[c]), c) for c in stall_columns if number(row[c]) > 0),
            reverse=True,
        )[:3]
        why = ", ".join(f"{c} {v:.0f}" for v, c in reasons)
        source = (row.get("Source") or "").strip()
        print(f"{i:5d} {100 * samples / total:5.1f}% {source[:70]:<70} {why}")


if __name__ == "__main__":
    main()
