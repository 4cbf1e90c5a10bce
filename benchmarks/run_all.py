"""Runs every benchmark and writes one combined JSON and markdown report.

Each benchmark runs in its own process (a failure or a compile cache in one does not touch the
others), in this order: MoE layer, whole step (eager vs compile, float8 on GPU), compile, Engram,
context-parallel exchange, gradient norm. ``--quick`` shrinks sizes and step counts so the whole set finishes
in a few minutes on a laptop CPU; without it each script runs with its own defaults (GPU-sized
when a GPU is visible).

    python benchmarks/run_all.py --quick                  # CPU smoke run, a few minutes
    python benchmarks/run_all.py --out-dir outputs/bench  # full run

Writes ``<out-dir>/run_all.json`` (per benchmark: command, exit code, seconds, parsed result)
and ``<out-dir>/run_all.md`` (the tables each script printed), and prints the markdown; the
step benchmark runs with ``--profile``, its Chrome traces in ``<out-dir>/step_traces``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"

# name -> (script, quick arguments, how its result is read)
BENCHMARKS = {
    "moe": ("moe_bench.py", ["--rounds", "5", "--warmup", "1"], "json_first"),
    "step": (
        "step_bench.py",
        ["--seq-len", "128", "--batch-size", "2", "--steps", "3", "--repeats", "3", "--warmup", "2"],
        "json_first",
    ),
    "compile": ("compile_bench.py", ["--seq-len", "128", "--batch-size", "2", "--steps", "3", "--warmup", "2"], "json_first"),
    "engram": ("engram_bench.py", ["--seq-len", "128", "--batch", "2", "--steps", "4"], "engram_text"),
    "cp": ("cp_comm_bench.py", ["--seq_len", "128"], "json_file"),
    "grad_norm": ("grad_norm_bench.py", ["--flavor", "debugmodel", "--model-override", "n_layers=2"], "json_first"),
}

_ENGRAM_TIMES = re.compile(r"without Engram ([\d.]+) ms .* ([\d.]+) ms \| ratio ([\d.]+)")


def parse(kind: str, stdout: str, json_file: Path | None) -> tuple[dict | None, str]:
    """(structured result, markdown/text to show) of one benchmark's output."""
    if kind == "json_first":
        result, end = json.JSONDecoder().raw_decode(stdout.lstrip())
        return result, stdout.lstrip()[end:].strip()
    if kind == "json_file":
        text = "\n".join(line for line in stdout.splitlines() if not line.startswith("{"))
        return json.loads(json_file.read_text()), "    " + text.replace("\n", "\n    ")
    # engram_bench prints text only: keep it, and pull out the step times.
    m = _ENGRAM_TIMES.search(stdout)
    result = {"ms_without": float(m[1]), "ms_with": float(m[2]), "ratio": float(m[3])} if m else None
    return result, "    " + stdout.strip().replace("\n", "\n    ")


def run_one(name: str, quick: bool, tmp: Path, out: Path) -> dict:
    script, quick_args, kind = BENCHMARKS[name]
    cmd = [sys.executable, str(BENCH / script), *(quick_args if quick else [])]
    if name == "step":  # the profiling counters (kernel launches, host reads) next to tokens/s
        cmd += ["--profile", "--trace-dir", str(out / "step_traces")]
    json_file = None
    if kind == "json_file":
        json_file = tmp / f"{name}.json"
        cmd += ["--json", str(json_file)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    print(f"[run_all] {name}: {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    entry = {
        "command": "python " + " ".join(str(Path(c).relative_to(ROOT)) if c.startswith(str(ROOT)) else c
                                       for c in cmd[1:] if c != str(json_file) and c != "--json"),
        "returncode": proc.returncode,
        "seconds": round(time.perf_counter() - start, 1),
    }
    if proc.returncode != 0:
        entry["error"] = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "no output"
        entry["markdown"] = f"failed (exit {proc.returncode}): {entry['error']}"
        return entry
    try:
        entry["result"], entry["markdown"] = parse(kind, proc.stdout, json_file)
    except (ValueError, OSError) as e:
        entry["error"] = f"could not read the output: {e}"
        entry["markdown"] = "    " + proc.stdout.strip().replace("\n", "\n    ")
    return entry


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="CPU-sized: small inputs, few steps (a few minutes)")
    p.add_argument("--only", default=",".join(BENCHMARKS), help=f"comma-separated subset of {', '.join(BENCHMARKS)}")
    p.add_argument("--out-dir", default="outputs/benchmarks", help="folder for run_all.json and run_all.md")
    a = p.parse_args(argv)
    names = [n.strip() for n in a.only.split(",") if n.strip()]
    unknown = sorted(set(names) - set(BENCHMARKS))
    if unknown:
        p.error(f"unknown benchmark(s) {unknown}; choose from {', '.join(BENCHMARKS)}")
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    started = datetime.datetime.now(datetime.timezone.utc)
    with tempfile.TemporaryDirectory(prefix="run_all_") as tmp:
        report = {
            "date": started.strftime("%Y-%m-%d %H:%M UTC"),
            "quick": a.quick,
            "load_average_at_start": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
            "benchmarks": {name: run_one(name, a.quick, Path(tmp), out) for name in names},
        }
    (out / "run_all.json").write_text(json.dumps(report, indent=2))
    md = [f"# run_all{' --quick' if a.quick else ''}, {report['date']} (load average {report['load_average_at_start']})", ""]
    for name, entry in report["benchmarks"].items():
        md += [f"## {name} ({entry['seconds']} s)", "", f"    {entry['command']}", "", entry["markdown"], ""]
    (out / "run_all.md").write_text("\n".join(md))
    print("\n".join(md))
    failed = [n for n, e in report["benchmarks"].items() if e["returncode"] != 0 or "error" in e]
    if failed:
        print(f"[run_all] failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
