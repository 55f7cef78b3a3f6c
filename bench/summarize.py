#!/usr/bin/env python3
"""Summarizes bench/run.sh results.tsv: medians over rounds, quotad's ratio to the ceilings
measured around it in the same round."""
import csv, statistics, sys
from collections import defaultdict

rows = list(csv.DictReader(open(sys.argv[1]), delimiter="\t"))
by = defaultdict(list)
for r in rows:
    by[(r["run"])].append(r)

def med(xs):
    return statistics.median(xs) if xs else float("nan")

print("| run | decisions/s median [min-max] | p50 ms | p99 ms | p99.9 ms | quotad CPU us/op | redis CPU us/op | errors |")
print("|---|---|---|---|---|---|---|---|")
for run, rs in by.items():
    rps = [float(r["rps"]) for r in rs]
    def col(k):
        v = [float(r[k]) for r in rs if r[k] not in ("-", "", "nan")]
        return f"{med(v):.3f}" if v else "-"
    errs = sum(int(r["errors"]) for r in rs)
    print(f"| {run} ({len(rs)} runs) | {med(rps):,.0f} [{min(rps):,.0f}-{max(rps):,.0f}] | {col('p50_ms')} | {col('p99_ms')} | {col('p999_ms')} | {col('quotad_us_per_op')} | {col('redis_us_per_op')} | {errs} |")

print()
ratios = defaultdict(list)
rounds = sorted({r["round"] for r in rows if r["round"].isdigit()}, key=int)
for rd in rounds:
    rr = [r for r in rows if r["round"] == rd]
    q = [float(r["rps"]) for r in rr if r["run"] == "quotad"]
    for c in ("evalsha-c50", "evalsha-P32"):
        cs = [float(r["rps"]) for r in rr if r["run"] == c]
        if q and cs:
            ratios[c].append(q[0] / statistics.mean(cs))
for c, v in ratios.items():
    print(f"quotad / {c} (same round): median {med(v):.3f} [{min(v):.3f}-{max(v):.3f}]")
