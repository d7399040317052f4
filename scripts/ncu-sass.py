#!/usr/bin/env python3
"""Summarises `ncu --page source --print-source sass --csv` output, per kernel: the opcode mix
weighted by instructions executed, stall reasons, and the SASS lines with the most stall
samples. Usage: ncu-sass.py FILE [TOP]."""
import csv, sys, collections

def num(x):
    try:
        return float(x.replace(",", ""))
    except Exception:
        return 0.0

top = int(sys.argv[2]) if len(sys.argv) > 2 else 25
kernels, cur = [], None
for r in csv.reader(open(sys.argv[1], errors="replace")):
    if r and r[0] == "Kernel Name":
        cur = {"name": r[1], "hdr": None, "rows": []}
        kernels.append(cur)
    elif cur is not None and r and r[0] == "Address":
        cur["hdr"] = r
    elif cur is not None and cur["hdr"] and len(r) == len(cur["hdr"]):
        cur["rows"].append(r)
for k in kernels:
    h = k["hdr"]
    ix = {n: i for i, n in enumerate(h)}
    reasons = [n for n in h if n.startswith("stall_") and "(Not Issued)" not in n]
    ops, why, lines = collections.Counter(), collections.Counter(), []
    tex = tst = 0.0
    for r in k["rows"]:
        s = r[ix["Source"]].strip()
        w = s.split()
        op = (w[1] if w and w[0].startswith("@") and len(w) > 1 else (w[0] if w else "?")).split(".")[0]
        n, st = num(r[ix["Instructions Executed"]]), num(r[ix["Warp Stall Sampling (All Samples)"]])
        ops[op] += n
        tex += n
        tst += st
        rs = {q: num(r[ix[q]]) for q in reasons}
        for q, v in rs.items():
            why[q] += v
        lines.append((st, n, r[0][-5:], s, max(rs, key=rs.get) if st else ""))
    print(f"== {k['name']}: {tex:.0f} warp instructions, {tst:.0f} stall samples")
    print("  opcodes: " + ", ".join(f"{o} {100*n/max(tex,1):.1f}%" for o, n in ops.most_common(14)))
    print("  stalls:  " + ", ".join(f"{q[6:]} {100*v/max(tst,1):.1f}%" for q, v in why.most_common(8)))
    for st, n, a, s, q in sorted(lines, reverse=True)[:top]:
        print(f"  {st:6.0f} {100*st/max(tst,1):5.1f}% ex={n:8.0f} {a} {q[6:]:14s} {s[:80]}")
