"""Training curves of one or more runs in one PNG: loss, validation loss, tokens/s and MoE load
imbalance against the step, the runs overlaid.

    python scripts/plot_metrics.py RUN_DIR [RUN_DIR ...] -o curves.png

A RUN_DIR is a run folder, the one that holds the run's `metrics.jsonl` (`--metrics-file` for
another `[metrics] jsonl_file`), or a `[job] dump_folder` of fresh runs, which draws its newest
run (`trainer.run_folder.latest_run_folder`) and says which. Each run is labelled with its
folder's path. A resumed run repeats the steps after its checkpoint; the last record of a step is
the one drawn (the steps the run continued from). A line that does not parse (a killed run's cut
off last line) is skipped with a warning.

`-o` names the image file; its suffix picks the format (`.png`, `.svg`, `.pdf`, ...; none: `.png`).
An existing folder, or a path ending in `/`, gets `curves.png` inside it. The output is checked
before anything is drawn: a path that cannot be written is one `error:` line and exit code 2.
Needs matplotlib (`pip install -e ".[plot]"`).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from pathlib import Path

from trainer.run_folder import latest_run_folder

# (metrics.jsonl key, panel title)
PANELS = (
    ("loss", "training loss"),
    ("val_loss", "validation loss"),
    ("tokens_per_sec", "tokens/s per device"),
    ("moe_imbalance", "MoE load imbalance (max/mean expert load)"),
)
IN_A_FOLDER = "curves.png"


class UsageError(Exception):
    """A mistake in the arguments, found before drawing: one line, exit code 2."""


def read_series(metrics_file: Path) -> dict[str, tuple[list[int], list[float]]]:
    """Per panel key, the (steps, values) of a metrics file, steps ascending, one value per step.
    Lines that are not a metrics record are skipped with a warning: a run killed while writing
    leaves its last line cut off (and a resumed run appends after it)."""
    by_step: dict[str, dict[int, float]] = {key: {} for key, _ in PANELS}
    skipped = []
    for number, line in enumerate(metrics_file.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if not (isinstance(record, dict) and isinstance(record.get("step"), int)):
            skipped.append(number)
            continue
        for key, values in by_step.items():
            if key in record:
                values[record["step"]] = record[key]
    if skipped:
        if not any(by_step.values()):
            raise UsageError(f"{metrics_file} holds no metrics records (no line is a JSON object with a step)")
        print(f"warning: {metrics_file}: skipped {len(skipped)} line(s) that are not a metrics record "
              f"(line {', '.join(map(str, skipped[:5]))}{' ...' if len(skipped) > 5 else ''}; a run killed "
              "while writing leaves its last line cut off)", file=sys.stderr)
    return {key: (sorted(values), [values[s] for s in sorted(values)]) for key, values in by_step.items()}


def find_metrics(run_dir: str, metrics_file: str) -> Path:
    """The metrics file of a run folder, or of a dump folder's newest run (announced)."""
    folder = Path(run_dir)
    if (folder / metrics_file).is_file():
        return folder / metrics_file
    newest = latest_run_folder(folder)
    if newest != folder and (newest / metrics_file).is_file():
        print(f"{run_dir}: a dump folder; drawing its newest run, {newest}")
        return newest / metrics_file
    if newest != folder:
        raise UsageError(f"the newest run of {run_dir}, {newest}, has no {metrics_file} (it logged no step yet); "
                         "pass an older run folder")
    inside = sorted(folder.glob(f"*/{metrics_file}"))
    hint = f", e.g. {inside[-1].parent}" if inside else ""
    raise UsageError(f"{run_dir} has no {metrics_file}; pass a run folder (the one holding it){hint}")


def output_path(given: str) -> Path:
    """The file `-o` names, checked writable (its folders created) before anything is drawn."""
    out = Path(given)
    if given.endswith(("/", os.sep)) or out.is_dir():
        out = out / IN_A_FOLDER
    if not out.suffix:
        out = out.with_name(out.name + ".png")  # what matplotlib appends; named here so the message is true
    from matplotlib.backend_bases import FigureCanvasBase

    formats = FigureCanvasBase.get_supported_filetypes()
    if out.suffix[1:].lower() not in formats:
        raise UsageError(f"-o {given}: matplotlib cannot write {out.suffix} files; "
                         f"use one of {', '.join('.' + f for f in sorted(formats))}")
    existing = out.parent
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise UsageError(f"-o {given}: {existing} is a file, so nothing can be written under it; "
                         "pass -o a path in a folder")
    if out.is_dir():
        raise UsageError(f"-o {given}: {out} is a folder; pass -o a file name")
    # Try the write itself: permissions, a read-only disk and the like answer only to that.
    created = not out.exists()
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(out, "ab"):
            pass
    except OSError as e:
        raise UsageError(f"-o {given}: cannot write {out} ({e.strerror or e}); pass -o a path you can write to") from None
    finally:
        if created:
            out.unlink(missing_ok=True)
    return out


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
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR",
                   help="run folder(s) holding metrics.jsonl, or dump folder(s): their newest run")
    p.add_argument("-o", "--output", required=True,
                   help=f"image file to write (.png unless another suffix); a folder gets {IN_A_FOLDER} inside")
    p.add_argument("--metrics-file", default="metrics.jsonl", help="metrics file name inside each run folder")
    a = p.parse_args(argv)
    if importlib.util.find_spec("matplotlib") is None:
        print('error: plot_metrics.py needs matplotlib: pip install -e ".[plot]"', file=sys.stderr)
        return 2
    try:
        out = output_path(a.output)
        runs = {}
        for run_dir in a.run_dirs:
            metrics = find_metrics(run_dir, a.metrics_file)
            label = str(metrics.parent)
            try:
                runs[label] = read_series(metrics)
            except OSError as e:
                raise UsageError(f"cannot read {metrics} ({e.strerror or e})") from None
            print(f"{label}: " + ", ".join(f"{key} {len(runs[label][key][0])} points" for key, _ in PANELS))
        try:
            plot(runs, out)
        except OSError as e:  # checked writable above: the disk filled up or went away meanwhile
            raise UsageError(f"cannot write {out} ({e.strerror or e})") from None
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
