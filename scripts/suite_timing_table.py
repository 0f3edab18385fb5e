"""Print where the suite's time went, from the JSON lines of `tests/_suite_timing.py`.

    JAXRL_SUITE_TIMING=/tmp/t.jsonl python -m pytest -q
    python scripts/suite_timing_table.py /tmp/t.jsonl [--top 40] [--write-durations tests/module_durations.json]

Columns: wall, XLA compilation (trace + lower + backend, in the pytest process), subprocess (wall time with a
live child process: servers, CLI runs, workers) and the rest (execution and Python). Several files (one per
xdist worker) are summed; with workers the wall column adds up the workers' time, not the elapsed time.
"""

from __future__ import annotations

import argparse
import glob
import json


def load(patterns: list[str]) -> list[dict]:
    rows: list[dict] = []
    for pattern in patterns:
        for path in sorted(glob.glob(pattern) + glob.glob(pattern + ".*")):
            with open(path) as f:
                rows.extend(json.loads(line) for line in f if line.strip())
    return rows


def _line(name: str, wall: float, compile_s: float, sub: float, n: int) -> str:
    rest = max(wall - compile_s - sub, 0.0)
    return f"| {name} | {wall:.1f} | {compile_s:.1f} | {n} | {sub:.1f} | {rest:.1f} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="+")
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--write-durations", metavar="JSON",
                        help="also write seconds per test module (tests/conftest.py orders modules by it)")
    args = parser.parse_args()
    rows = load(args.paths)
    if args.write_durations:
        modules: dict[str, float] = {}
        for r in rows:
            module = r["test"].split("::")[0]
            modules[module] = modules.get(module, 0.0) + r["wall_s"]
        with open(args.write_durations, "w") as f:
            json.dump({m: round(t, 1) for m, t in sorted(modules.items(), key=lambda kv: -kv[1])}, f, indent=1)
            f.write("\n")
    rows.sort(key=lambda r: r["wall_s"], reverse=True)
    print("| test | wall s | compile s | compiles | subprocess s | rest s |")
    print("|---|---|---|---|---|---|")
    for r in rows[: args.top]:
        print(_line(r["test"], r["wall_s"], r["compile_s"], r["subprocess_s"], r["n_compiles"]))
    for label, subset in (("slowest %d" % args.top, rows[: args.top]), ("all %d tests" % len(rows), rows),
                          ("marked slow", [r for r in rows if r.get("slow")]),
                          ("not slow", [r for r in rows if not r.get("slow")])):
        print(_line(f"**{label}**", sum(r["wall_s"] for r in subset), sum(r["compile_s"] for r in subset),
                    sum(r["subprocess_s"] for r in subset), sum(r["n_compiles"] for r in subset)))


if __name__ == "__main__":
    main()
