#!/usr/bin/env python3
"""Summarizes a bench results.tsv (bench/run.sh, protocols.sh, topologies.sh): per run,
the median over rounds with [min-max] of the rate and the medians of the columns the file
has; then every run that is not a ceiling (`evalsha-*`) over each ceiling measured around
it in the same round (docs/benchmarks.md: the ratio measured in the same run is the
figure)."""
import csv, statistics, sys
from collections import defaultdict

# Columns shown when present: (tsv column, table heading, format).
COLUMNS = [
    ("p50_ms", "p50 ms", "{:.3f}"),
    ("p99_ms", "p99 ms", "{:.3f}"),
    ("p999_ms", "p99.9 ms", "{:.3f}"),
    ("quotad_us_per_op", "quotad CPU us/op", "{:.1f}"),
    ("redis_us_per_op", "Redis CPU us/op", "{:.1f}"),
    ("client_us_per_op", "client CPU us/op", "{:.1f}"),
]
# Counters summed over a run's rounds when present ("-" where they do not apply).
COUNTS = [("errors", "errors"), ("fail_open", "fail_open")]

rows = list(csv.DictReader(open(sys.argv[1]), delimiter="\t"))
by = defaultdict(list)
for r in rows:
    by[r["run"]].append(r)
med = statistics.median
have = set(rows[0]) if rows else set()
cols = [c for c in COLUMNS if c[0] in have]
counts = [c for c in COUNTS if c[0] in have]


def value(rs, k, fmt):
    v = [float(r[k]) for r in rs if r.get(k) not in (None, "-", "", "nan")]
    return fmt.format(med(v)) if v else "-"


def total(rs, k):
    v = [int(r[k]) for r in rs if r[k] not in ("-", "")]
    return str(sum(v)) if v else "-"


heads = ["run", "decisions/s median [min-max]"] + [h for _, h, _ in cols] + [h for _, h in counts]
print("| " + " | ".join(heads) + " |")
print("|" + "---|" * len(heads))
for run, rs in by.items():
    rps = [float(r["rps"]) for r in rs]
    cells = [f"{run} ({len(rs)} runs)", f"{med(rps):,.0f} [{min(rps):,.0f}-{max(rps):,.0f}]"]
    cells += [value(rs, k, fmt) for k, _, fmt in cols]
    cells += [total(rs, k) for k, _ in counts]
    print("| " + " | ".join(cells) + " |")

print()
ceilings = [run for run in by if run.startswith("evalsha")]
ratios = defaultdict(list)
for rd in sorted({r["round"] for r in rows if r["round"].isdigit()}, key=int):
    rr = [r for r in rows if r["round"] == rd]
    for c in ceilings:
        cs = [float(r["rps"]) for r in rr if r["run"] == c]
        for r in rr:
            if cs and not r["run"].startswith("evalsha"):
                ratios[(r["run"], c)].append(float(r["rps"]) / statistics.mean(cs))
for (run, c), v in ratios.items():
    print(f"{run} / {c} (same round): median {med(v):.3f} [{min(v):.3f}-{max(v):.3f}]")
