"""Prints rope-jit-bench's fraction of copy for each case (rows) under each variant (columns),
from the JSON files that scripts/device_check.sh's step rope-variants wrote:
    python3 scripts/bench_variants_table.py OUT_DIR NAME...   (reads OUT_DIR/variant_NAME.json)
"""
import json
import sys


def main():
    out, names = sys.argv[1], sys.argv[2:]
    rows = {}
    for name in names:
        try:
            with open(f"{out}/variant_{name}.json") as file:
                cases = json.load(file)["cases"]
        except (OSError, KeyError, ValueError) as error:
            print(f"{name}: no results ({error})")
            continue
        for case in cases:
            rows.setdefault(case["name"], {})[name] = case.get("fraction_of_copy")
    print(f"{'case':44s}" + "".join(f"{name[:12]:>13s}" for name in names))
    for case, values in rows.items():
        cells = "".join(
            f"{values[name]:13.3f}" if isinstance(values.get(name), float) else f"{'-':>13s}"
            for name in names
        )
        print(f"{case[:44]:44s}{cells}")


if __name__ == "__main__":
    main()
