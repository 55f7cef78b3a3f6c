#!/usr/bin/env python3
"""Summary and plot of a bench/soak.sh run: soak_plot.py DIR (reads DIR/soak.tsv and
DIR/faults.tsv, writes DIR/soak.svg, prints the summary). Standard library only."""

import csv
import statistics
import sys

RECOVERY = 15  # seconds after a fault's start that still count as the fault's


def rows(path):
    with open(path) as f:
        return [{k: int(v or 0) if k != "fault" else v for k, v in r.items()}
                for r in csv.DictReader(f, delimiter="\t")]


def main(out):
    s = rows(f"{out}/soak.tsv")
    faults = rows(f"{out}/faults.tsv")
    end = s[-1]["t"]
    first = [r for r in s if 60 <= r["t"] < 120] or s[:60]
    last = [r for r in s if r["t"] >= end - 60] or s[-60:]

    def med(rs, k):
        return statistics.median(r[k] for r in rs)

    in_fault = lambda t: any(f["t"] <= t < f["t"] + RECOVERY for f in faults)
    growth = {"fault": {}, "calm": {}}
    for a, b in zip(s, s[1:]):
        phase = "fault" if in_fault(b["t"]) else "calm"
        for k in ("fail_open", "store_errors", "shed"):
            growth[phase][k] = growth[phase].get(k, 0) + max(0, b[k] - a[k])
    decisions = s[-1]["decisions"] - s[0]["decisions"]
    lines = [
        f"duration {end} s, {len(faults)} faults ({', '.join(f['fault'] for f in faults)})",
        f"decisions {decisions} ({decisions / max(end, 1):.0f}/s)",
    ]
    for k, unit in (("rss_kib", "KiB"), ("fds", "fds")):
        a, b = med(first, k), med(last, k)
        lines.append(f"{k}: minute 2 median {a:.0f} {unit}, last minute {b:.0f} {unit}, "
                     f"end/start {b / a:.3f}; max {max(r[k] for r in s)}")
    lines.append(f"connections: min {min(r['connections'] for r in s)}, "
                 f"max {max(r['connections'] for r in s)}")
    for phase in ("fault", "calm"):
        g = growth[phase]
        lines.append(f"during {phase} seconds ({'within ' + str(RECOVERY) + ' s of a fault' if phase == 'fault' else 'the rest'}): "
                     f"fail_open +{g.get('fail_open', 0)}, store errors +{g.get('store_errors', 0)}, "
                     f"shed +{g.get('shed', 0)}")
    lines.append(f"breaker openings {s[-1]['breaker_opens'] - s[0]['breaker_opens']}; "
                 f"store down at the end: {'no' if s[-1]['store_up'] == 1 else 'YES'}")
    print("\n".join(lines))
    svg(out, s, faults, end)


def svg(out, s, faults, end):
    W, H, L, P = 900, 170, 70, 30
    charts = [
        ("resident memory (MiB)", [r["rss_kib"] / 1024 for r in s]),
        ("open file descriptors", [r["fds"] for r in s]),
        ("fail_open decisions per second", [max(0, b["fail_open"] - a["fail_open"]) for a, b in zip(s, s[1:])]),
    ]
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H * len(charts)}" '
             f'font-family="sans-serif" font-size="11">']
    for i, (title, ys) in enumerate(charts):
        top = i * H
        hi = max(ys) * 1.1 or 1
        x = lambda t: L + (W - L - 10) * t / max(end, 1)
        y = lambda v: top + H - P - (H - 2 * P) * v / hi
        parts.append(f'<text x="{L}" y="{top + 16}" font-weight="bold">{title}</text>')
        parts.append(f'<line x1="{L}" y1="{top + H - P}" x2="{W - 10}" y2="{top + H - P}" stroke="#999"/>')
        parts.append(f'<text x="{L - 6}" y="{y(hi / 1.1) + 4:.1f}" text-anchor="end">{hi / 1.1:.0f}</text>')
        parts.append(f'<text x="{L - 6}" y="{top + H - P + 4}" text-anchor="end">0</text>')
        for f in faults:
            parts.append(f'<line x1="{x(f["t"]):.1f}" y1="{top + P - 6}" x2="{x(f["t"]):.1f}" '
                         f'y2="{top + H - P}" stroke="#d33" stroke-dasharray="3,3"/>')
        ts = [r["t"] for r in s][-len(ys):]
        pts = " ".join(f"{x(t):.1f},{y(v):.1f}" for t, v in zip(ts, ys))
        parts.append(f'<polyline fill="none" stroke="#36c" stroke-width="1" points="{pts}"/>')
        parts.append(f'<text x="{W - 10}" y="{top + H - P + 16}" text-anchor="end">{end} s</text>')
    parts.append("</svg>")
    with open(f"{out}/soak.svg", "w") as f:
        f.write("\n".join(parts) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
