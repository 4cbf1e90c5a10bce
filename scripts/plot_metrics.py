"""Training curves of one or more runs in one PNG: loss, validation loss, tokens/s and MoE load
imbalance against the step, the runs overlaid.

    python scripts/plot_metrics.py RUN_DIR [RUN_DIR ...] -o curves.png

A RUN_DIR is a run folder: the one that holds the run's `metrics.jsonl` (`--metrics-file` for
another `[metrics] jsonl_file`). Each run is labelled with its path as given. A resumed run
repeats the steps after its checkpoint; the last record of a step is the one drawn (the steps the
run continued from). Needs matplotlib (`pip install -e ".[plot]"`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# (metrics.jsonl key, panel title)
PANELS = (
    ("loss", "training loss"),
    ("val_loss", "validation loss"),
    ("tokens_per_sec", "tokens/s per device"),
    ("moe_imbalance", "MoE load imbalance (max/mean expert load)"),
)


def read_series(metrics_file: Path) -> dict[str, tuple[list[int], list[float]]]:
    """Per panel key, the (steps, values) of a metrics file, steps ascending, one value per step."""
    by_step: dict[str, dict[int, float]] = {key: {} for key, _ in PANELS}
    for line in metrics_file.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        record = json.loads(line)
        for key, values in by_step.items():
            if key in record:
                values[record["step"]] = record[key]
    return {key: (sorted(values), [values[s] for s in sorted(values)]) for key, values in by_step.items()}


def plot(runs: dict[str, dict[str, tuple[list[int], list[float]]]], out: Path):
    """Draw the panels of every run and save them to `out`; returns the matplotlib Figure."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7), sharex=True, layout="constrained")
    for ax, (key, title) in zip(axes.flat, PANELS):
        drawn = False
        for label, series in runs.items():
            steps, values = series[key]
            if steps:
                # Validation is sparse (every validation.freq steps): markers show where it was taken.
                ax.plot(steps, values, label=label, marker="o" if key == "val_loss" else None, markersize=3)
                drawn = True
        if not drawn:
            ax.text(0.5, 0.5, "not in these runs", ha="center", va="center", transform=ax.transAxes, color="gray")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    for ax in axes[1]:
        ax.set_xlabel("step")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="outside lower center", ncols=min(len(labels), 3), fontsize="small")
    fig.savefig(out, dpi=80)
    plt.close(fig)
    return fig


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run folder(s), each holding metrics.jsonl")
    p.add_argument("-o", "--output", required=True, help="PNG file to write")
    p.add_argument("--metrics-file", default="metrics.jsonl", help="metrics file name inside each run folder")
    a = p.parse_args(argv)
    runs = {}
    for run_dir in a.run_dirs:
        metrics = Path(run_dir) / a.metrics_file
        if not metrics.is_file():
            inside = sorted(Path(run_dir).glob(f"*/{a.metrics_file}"))
            hint = f", e.g. {inside[-1].parent}" if inside else ""
            print(f"error: {run_dir} has no {a.metrics_file}; pass a run folder (the one holding it){hint}",
                  file=sys.stderr)
            return 2
        runs[run_dir] = read_series(metrics)
        print(f"{run_dir}: " + ", ".join(f"{key} {len(runs[run_dir][key][0])} points" for key, _ in PANELS))
    out = Path(a.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    plot(runs, out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
