"""Where a kernel's time goes, from an Nsight Compute source page (SASS, CSV), by program region.

    ncu --clock-control none -k regex:NAME -s 2 -c 1 --set full --import-source yes -o /tmp/rep python ...
    ncu -i /tmp/rep.ncu-rep --page source --csv --print-source sass > /tmp/sass.csv
    python scripts/ncu_sass_profile.py /tmp/sass.csv [--window 100] [--top 30]

Prints: the stall-sample totals by reason and by opcode; then the SASS in windows of ``--window``
instructions in program order (a phase of a kernel is a run of windows), each with its share of
the stall samples, the warp instructions it executed, and the loads, stores, barriers, warp
reductions and shuffles in it, so that a loop shows as windows whose executed count is a multiple
of their size; then the ``--top`` SASS lines by samples with their three main stall reasons.
"""

from __future__ import annotations

import argparse
import collections
import csv


def _num(x: str) -> float:
    try:
        return float(x.replace(",", ""))
    except ValueError:
        return 0.0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--window", type=int, default=100)
    ap.add_argument("--top", type=int, default=30)
    a = ap.parse_args(argv)
    with open(a.csv, newline="") as f:
        rows = list(csv.reader(f))
    head = next(i for i, r in enumerate(rows) if any(c.strip() == "Source" for c in r))
    hdr = [c.strip() for c in rows[head]]
    data = [r for r in rows[head + 1 :] if len(r) == len(hdr)]
    col = {c: i for i, c in enumerate(hdr)}
    samp = next(i for i, c in enumerate(hdr) if c.startswith("Warp Stall Sampling (All"))
    execd = col.get("Instructions Executed")
    src = col["Source"]
    stall = [i for i, c in enumerate(hdr) if c.startswith("stall_") and "Not Issued" not in c]
    total = sum(_num(r[samp]) for r in data) or 1.0
    print(f"{len(data)} SASS lines, {total:.0f} stall samples")
    sums = sorted(((sum(_num(r[i]) for r in data), hdr[i]) for i in stall), reverse=True)
    print("by reason:", ", ".join(f"{n[6:]} {100 * v / total:.1f} %" for v, n in sums if v))

    def opcode(text: str) -> str:
        parts = text.split()
        if parts and parts[0].startswith("@"):
            parts = parts[1:]
        return parts[0].split(".")[0] if parts else "?"

    ops: collections.Counter[str] = collections.Counter()
    for r in data:
        ops[opcode(r[src])] += _num(r[samp])
    print("by opcode:", ", ".join(f"{o} {100 * v / total:.1f} %" for o, v in ops.most_common(14)))
    print(f"\nwindows of {a.window} instructions (first address; samples %; warp instructions executed; contents)")
    for w in range(0, len(data), a.window):
        chunk = data[w : w + a.window]
        s = sum(_num(r[samp]) for r in chunk)
        e = sum(_num(r[execd]) for r in chunk) if execd is not None else 0.0
        kinds = collections.Counter(opcode(r[src]) for r in chunk)
        marks = " ".join(
            f"{k}x{kinds[k]}" for k in ("LDG", "STG", "LDL", "STL", "LDS", "BAR", "REDUX", "SHFL") if kinds[k]
        )
        print(f"  {chunk[0][col['Address']]:>8s} {100 * s / total:5.1f} % {e:12.0f}  {marks}")
    print(f"\ntop {a.top} lines")
    top = sorted(range(len(data)), key=lambda i: -_num(data[i][samp]))[: a.top]
    for i in sorted(top):
        r = data[i]
        why = sorted(((_num(r[j]), hdr[j][6:]) for j in stall), reverse=True)[:3]
        print(
            f"  {i:6d} {100 * _num(r[samp]) / total:5.2f} %  {r[src][:60]:60s} "
            + "; ".join(f"{n}={v:.0f}" for v, n in why if v)
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
