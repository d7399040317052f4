#!/usr/bin/env python3
"""Per-graph kernel timelines from cupti_trace.c's CSV: for each graph replayed at least
--min-launches times, each kernel's median start (from the launch's first kernel start), duration
and gap after the previous kernel's end, in microseconds."""
import argparse
import csv
import signal
import statistics
from collections import defaultdict

ap = argparse.ArgumentParser()
ap.add_argument("csv")
ap.add_argument("--min-launches", type=int, default=5)
ap.add_argument("--skip", type=int, default=2, help="launches of each graph dropped as warm-up")
args = ap.parse_args()
signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # piped into head or grep -m

launches = defaultdict(list)  # (graph, corr) -> rows
for r in csv.DictReader(open(args.csv)):
    if r["graph"] == "0":
        continue
    r["start"], r["end"] = int(r["start"]), int(r["end"])
    launches[(r["graph"], r["corr"])].append(r)

by_graph = defaultdict(list)
for (g, c), rows in launches.items():
    by_graph[g].append(sorted(rows, key=lambda r: (r["start"], r["end"])))

med = statistics.median
for g, ls in sorted(by_graph.items(), key=lambda kv: int(kv[0])):
    ls.sort(key=lambda rows: rows[0]["start"])
    ls = ls[args.skip:]
    if len(ls) < args.min_launches:
        continue
    n = min(len(rows) for rows in ls)
    ls = [rows for rows in ls if len(rows) == n]
    span = med([rows[-1]["end"] - rows[0]["start"] for rows in ls]) / 1e3
    print(f"graph {g}: {len(ls)} launches, {n} kernels, median span {span:.2f} us")
    print(f"  {'#':>3} {'start':>8} {'dur':>7} {'gap':>7} {'grid':>6} {'smem':>7} {'exec':>7} {'regs':>4} name")
    for i in range(n):
        t0 = [rows[0]["start"] for rows in ls]
        start = med([rows[i]["start"] - t for rows, t in zip(ls, t0)]) / 1e3
        dur = med([rows[i]["end"] - rows[i]["start"] for rows in ls]) / 1e3
        gap = med([rows[i]["start"] - rows[i - 1]["end"] for rows in ls]) / 1e3 if i else 0.0
        r = ls[0][i]
        smem = int(r["dyn_smem"]) + int(r["static_smem"])
        print(f"  {i:>3} {start:8.2f} {dur:7.2f} {gap:7.2f} {r['grid']:>6} {smem:>7} {r['smem_executed']:>7} {r['regs']:>4} {r['name'][:60]}")
