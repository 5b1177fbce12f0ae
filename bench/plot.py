#!/usr/bin/env python
"""Bar chart of the fused op's speedup over PyTorch eager, from a bench_ct_bn_pool.py result.

    python bench/plot.py bench/results/<gpu>-<date>.json [-o docs/speedup-<gpu>.png]

One group of bars per problem (per problem and dtype where the file holds several dtypes),
one bar per mode and pass ("train", "train step"; train: the "auto" algo row, else the first
train row), log y axis, a line at 1 (= eager speed). Needs matplotlib.
"""
import argparse
import json
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; no display needed
import matplotlib.pyplot as plt  # noqa: E402


def group_of(rows):
    """A row's bar group: its problem, with its dtype where the rows hold several."""
    several = len({row.get("dtype", "float32") for row in rows}) > 1
    return lambda row: f"{row['shape']} {row['dtype']}" if several else row["shape"]


def series_of(row) -> str:
    """A row's bar series: its mode, and its pass unless forward (files before step rows
    have no pass)."""
    pass_name = row.get("pass", "forward")
    return row["mode"] if pass_name == "forward" else f"{row['mode']} {pass_name}"


def speedups(rows):
    """{series: {group: speedup or nan}} and the groups in file order."""
    group = group_of(rows)
    shapes = list(dict.fromkeys(group(row) for row in rows))
    modes = list(dict.fromkeys(series_of(row) for row in rows))
    table = {mode: {} for mode in modes}
    for row in rows:
        mode_rows = table[series_of(row)]
        # One bar per (group, mode): the auto row wins over any other algo.
        if group(row) not in mode_rows or row["algo"] == "auto":
            mode_rows[group(row)] = row
    return shapes, {mode: {shape: speedup_of(by_shape.get(shape)) for shape in shapes}
                    for mode, by_shape in table.items()}


def speedup_of(row):
    if row is None or not row.get("eager_ms") or not row.get("fused_ms"):
        return math.nan  # a failed measurement: no bar
    return row["eager_ms"] / row["fused_ms"]


def plot(rows, path: Path):
    shapes, by_mode = speedups(rows)
    width = 0.8 / len(by_mode)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(shapes) + 2), 4.5))
    for i, (mode, values) in enumerate(by_mode.items()):
        xs = [j + (i - (len(by_mode) - 1) / 2) * width for j in range(len(shapes))]
        heights = [values[shape] for shape in shapes]
        bars = ax.bar(xs, heights, width, label=mode)
        ax.bar_label(bars, labels=["" if math.isnan(h) else f"{h:.3g}" for h in heights],
                     fontsize=7, padding=2)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_yscale("log")
    long_names = max(map(len, shapes)) > 8  # the real sweep's names would overlap level
    ax.set_xticks(range(len(shapes)), shapes, rotation=45 if long_names else 0,
                  ha="right" if long_names else "center", fontsize=7 if long_names else None)
    ax.set_ylabel("speedup over eager PyTorch (x)")
    meta = rows[0]
    ax.set_title(f"fused_ops.ct_bn_pool speedup over eager PyTorch\n"
                 f"{meta['gpu']}, torch {meta['torch']}, {meta['date']}", fontsize=10)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", type=Path, help="JSON written by bench_ct_bn_pool.py")
    parser.add_argument("-o", "--output", type=Path,
                        help="image path (default: the results path with .png)")
    args = parser.parse_args()
    rows = json.loads(args.results.read_text())
    if not rows:
        raise SystemExit(f"{args.results} holds no rows")
    output = args.output or args.results.with_suffix(".png")
    output.parent.mkdir(parents=True, exist_ok=True)
    plot(rows, output)
    print(f"wrote {output}")


if __name__ == "__main__":
    main()
