#!/usr/bin/env python3
"""Draws bench/compare_hosts.sh's CSV as an SVG (stdlib only): a panel per operator and engine,
symmem's speed against Open MPI's (Open MPI's time / symmem's, log scale, 1 = parity) against
the number of hosts, a line per message size and ranks per host.

    python3 bench/plot_hosts.py target/bench/hosts.csv target/bench/hosts.svg
"""

import csv
import math
import sys
from collections import defaultdict

W, H, PAD, LEGEND = 360, 240, 46, 120
COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#17becf", "#7f7f7f"]


def size_name(b):
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if b >= scale and b % scale == 0:
            return f"{b // scale} {unit}"
    return f"{b} B"


def main(src, dst):
    rows = list(csv.DictReader(open(src)))
    if not rows:
        raise SystemExit(f"{src}: no rows")
    panels = defaultdict(lambda: defaultdict(dict))
    for r in rows:
        per = int(r["ranks"]) // int(r["hosts"])
        line = (int(r["bytes"]), per)
        # The last row of a configuration wins (a rerun appends).
        panels[(r["op"], r["engine"])][line][int(r["hosts"])] = float(r["speed"])
    keys = sorted(panels)
    hosts = sorted({h for p in panels.values() for l in p.values() for h in l})
    speeds = [s for p in panels.values() for l in p.values() for s in l.values() if s > 0]
    lo = 10 ** math.floor(math.log10(min(speeds + [0.5])))
    hi = 10 ** math.ceil(math.log10(max(speeds + [2.0])))
    cols = 2
    nrows = math.ceil(len(keys) / cols)
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{cols * (W + LEGEND)}" height="{nrows * H + 30}" '
        'font-family="DejaVu Sans, sans-serif" font-size="11">',
        '<rect width="100%" height="100%" fill="white"/>',
        f'<text x="10" y="18" font-size="13">symmem speed against Open MPI (Open MPI time / symmem time), '
        f"played hosts on one machine</text>",
    ]

    def x_of(h, x0):
        if len(hosts) == 1:
            return x0 + PAD + (W - 2 * PAD) / 2
        t = (math.log2(h) - math.log2(hosts[0])) / (math.log2(hosts[-1]) - math.log2(hosts[0]))
        return x0 + PAD + t * (W - 2 * PAD)

    def y_of(s, y0):
        t = (math.log10(s) - math.log10(lo)) / (math.log10(hi) - math.log10(lo))
        return y0 + H - PAD - t * (H - 2 * PAD)

    for i, key in enumerate(keys):
        x0, y0 = (i % cols) * (W + LEGEND), 30 + (i // cols) * H
        out.append(f'<text x="{x0 + PAD}" y="{y0 + 16}" font-size="12">{key[0]}, {key[1]}</text>')
        out.append(
            f'<rect x="{x0 + PAD}" y="{y0 + PAD}" width="{W - 2 * PAD}" height="{H - 2 * PAD}" '
            'fill="none" stroke="#999"/>'
        )
        v = lo
        while v <= hi * 1.0001:
            y = y_of(v, y0)
            stroke = "#000" if abs(v - 1) < 1e-9 else "#ddd"
            out.append(f'<line x1="{x0 + PAD}" x2="{x0 + W - PAD}" y1="{y:.1f}" y2="{y:.1f}" stroke="{stroke}"/>')
            out.append(f'<text x="{x0 + PAD - 4}" y="{y + 4:.1f}" text-anchor="end">{v:g}x</text>')
            v *= 10
        for h in hosts:
            x = x_of(h, x0)
            out.append(f'<text x="{x:.1f}" y="{y0 + H - PAD + 14}" text-anchor="middle">{h}</text>')
        out.append(f'<text x="{x0 + W / 2}" y="{y0 + H - 8}" text-anchor="middle">hosts</text>')
        for j, (line, pts) in enumerate(sorted(panels[key].items())):
            color = COLORS[j % len(COLORS)]
            dash = "" if line[1] == 1 else ' stroke-dasharray="5,3"'
            xy = [(x_of(h, x0), y_of(s, y0)) for h, s in sorted(pts.items()) if s > 0]
            path = " ".join(f"{x:.1f},{y:.1f}" for x, y in xy)
            out.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="1.6"{dash}/>')
            for x, y in xy:
                out.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="2.5" fill="{color}"/>')
            ly = y0 + PAD + 14 * j
            out.append(
                f'<line x1="{x0 + W - 6}" x2="{x0 + W + 14}" y1="{ly}" y2="{ly}" stroke="{color}" '
                f'stroke-width="1.6"{dash}/>'
            )
            out.append(f'<text x="{x0 + W + 18}" y="{ly + 4}">{size_name(line[0])}, {line[1]}/host</text>')
    out.append("</svg>")
    with open(dst, "w") as f:
        f.write("\n".join(out) + "\n")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
