"""Draws a run's curves from CSVLogger's metrics.csv into one PNG, one panel per metric, against the step.

  python scripts/plot_metrics.py RUN [-o OUT.png] [--metrics NAME ...]

RUN: a metrics.csv, or a folder holding one (volt_logs/version_N). Without --metrics, every column except `step`
and `epoch` is drawn. Needs matplotlib (`bash scripts/install-python-tools.sh` prints a python that has it).
"""
import argparse
import csv
import math
import os
import sys

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402


def read(path):
    """Each metric's (step, value) points, in file order; empty cells are skipped."""
    series = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            step = int(row["step"])
            for name, cell in row.items():
                if name in ("step", "epoch") or cell in ("", None):
                    continue
                series.setdefault(name, []).append((step, float(cell)))
    return series


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", help="metrics.csv, or the folder that holds it")
    parser.add_argument("-o", "--output", help="the PNG to write (default: curves.png beside metrics.csv)")
    parser.add_argument("--metrics", nargs="+", help="the columns to draw (default: all)")
    args = parser.parse_args()
    path = os.path.join(args.run, "metrics.csv") if os.path.isdir(args.run) else args.run
    if not os.path.exists(path):
        sys.exit(f"plot_metrics: {path} does not exist; give a metrics.csv or the volt_logs/version_N folder of a run")
    series = read(path)
    names = args.metrics or sorted(series)
    unknown = [n for n in names if n not in series]
    if unknown:
        sys.exit(f"plot_metrics: {', '.join(unknown)} not in {path}; it has {', '.join(sorted(series))}")
    if not names:
        sys.exit(f"plot_metrics: {path} holds no metric values")
    columns = min(3, len(names))
    rows = math.ceil(len(names) / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(4.2 * columns, 3.0 * rows), squeeze=False)
    for ax, name in zip(axes.flat, names):
        steps, values = zip(*series[name])
        ax.plot(steps, values, marker="o" if len(steps) < 30 else None, markersize=3)
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(names):]:
        ax.axis("off")
    fig.tight_layout()
    output = args.output or os.path.join(os.path.dirname(path), "curves.png")
    fig.savefig(output, dpi=100)
    print(f"plot_metrics: {len(names)} curves from {path} -> {output}")


if __name__ == "__main__":
    main()
