#!/usr/bin/env bash
# Every GPU measurement of the MoE-step efficiency work (issue 13) in one run, one table at the end.
# Installs nothing: needs torch with CUDA (and torchao for float8) already importable.
#
#   bash benchmarks/gpu_check.sh                     # ~7 minutes on one H100 without F (F: two compiled proxy_1b)
#   GPU_CHECK_OUT=$OUT bash benchmarks/gpu_check.sh  # keep the JSON results, logs and traces there
#   GPU_CHECK_DRY_RUN=1 bash benchmarks/gpu_check.sh # the same commands at tiny sizes on CPU (wiring test)
#
# Measurements (each a benchmark of this repository; its JSON and log land in $GPU_CHECK_OUT):
#   A  step_bench proxy_1b, bf16, compile, batch 4 x 4096, with --profile: tokens/s, MFU, peak
#      memory vs the trainer/planning/memory.py estimate, kernel launches and host syncs of one step.
#   B  step_bench 16B flavor (DeepSeek-V2-Lite widths, dim 2048) with n_layers=4, bf16, batch 2 x
#      4096, compile: MFU.
#   D  the same with float8 (routed experts too), in its own process (two such models and their
#      optimizer states do not fit one 80 GB GPU together): the float8 speed-up is D / B.
#   C  moe_bench at proxy_1b sizes, 16384 tokens, bf16: MoE layer time / dense-ideal time.
#   E  step_bench proxy_1b, bf16, eager, batch 1 x 4096, with --profile: the weight-cast bytes and
#      the Python-level host reads of one step (both counted by modes that compiled code bypasses).
#   F  step_bench proxy_1b, bf16, compile, batch 4 x 4096, one process: the weight-cast policy A/B,
#      FSDP2 on a one-rank mesh (the default) vs plain autocast (training.one_process_cast),
#      tokens/s and peak memory side by side; docs/performance.md has the decision rule.
#   G  moe_overlap_bench: [parallelism] moe_overlap on vs off, dp_shard 2 x ep 2 on 2 GPUs (NCCL),
#      16B n_layers=4 widths, bf16, 4 micro-batches of 1 x 4096, no injected delay: the step-time
#      ratio (issue 31). Skipped on a machine with one GPU (EP needs a GPU per rank).
#   H  optim_bench proxy_1b on one GPU: the optimizer step time of AdamW with fp32 states (torch's
#      fused), AdamW with bf16 states and Muon (bf16 Newton-Schulz, batched per expert stack), and
#      the host reads of one step, and batched vs one-matrix-at-a-time bf16 NS of an expert stack
#      (bitwise equal?, largest difference) (issue 32).
# A failed or timed-out measurement shows as "failed" in the table (its log says why); the
# others still run. GPU_CHECK_STEP_TIMEOUT (seconds, default 240) bounds each one.
set -u

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export WANDB_MODE="${WANDB_MODE:-disabled}" HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1
PY="${PYTHON:-python3}"
OUT_DIR="${GPU_CHECK_OUT:-$(mktemp -d -t gpu_check.XXXXXX)}"
STEP_TIMEOUT="${GPU_CHECK_STEP_TIMEOUT:-240}"
DRY="${GPU_CHECK_DRY_RUN:-0}"
mkdir -p "$OUT_DIR"

if [ "$DRY" = "1" ]; then
    # Same commands and table, sizes a 2-core CPU runs in seconds; compile and float8 variants
    # become eager ones / are skipped by step_bench (float8 speed needs a GPU).
    DEVICE=cpu
    SMALL=(--flavor debugmodel --model-override n_layers=2 --seq-len 32)
    A_ARGS=("${SMALL[@]}" --dtype fp32 --batch-size 2 --variants eager)
    B_ARGS=("${SMALL[@]}" --dtype fp32 --batch-size 1)
    B_VARIANT=eager
    D_VARIANTS=eager,eager_float8
    C_ARGS=(--flavor debugmodel --tokens 256 --dtype fp32 --rounds 2 --warmup 1)
    E_ARGS=("${SMALL[@]}" --dtype bf16 --batch-size 1 --variants eager)
    F_ARGS=("${SMALL[@]}" --dtype bf16 --batch-size 1 --variants eager,eager_autocast)
    H_ARGS=(--flavor debugmodel --model-override n_layers=2 --steps 1 --warmup 1)
    TIMING=(--steps 1 --repeats 1 --warmup 1)
    G_ARGS=(--device cpu --flavor debugmodel --model-override n_layers=2 --seq-len 32 --micro-batches 2 --steps 1)
    GPUS=2
else
    if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
        echo "gpu_check: no CUDA device here (torch.cuda.is_available() is False); skipping every GPU measurement."
        echo "gpu_check: GPU_CHECK_DRY_RUN=1 runs the same commands at tiny sizes on CPU to check the wiring."
        exit 0
    fi
    missing=$("$PY" -c "
import importlib.util
print(' '.join(m for m in ('datasets', 'tomli_w') if importlib.util.find_spec(m) is None))")
    if [ -n "$missing" ]; then
        echo "gpu_check: the trainer needs Python packages this machine lacks: $missing. This script installs"
        echo "gpu_check: nothing: bring them as wheels and put them on PYTHONPATH (docs/performance.md, gpu_check.sh)."
        exit 1
    fi
    DEVICE=cuda
    # The model embeds its flavor's vocabulary (129,280 rows for proxy_1b) since 2026-12-07; the
    # figures measured before had the bundled tokenizer's 8,192 rows, which this keeps comparable.
    VOCAB=(--model-override vocab_size=8192)
    A_ARGS=(--flavor proxy_1b "${VOCAB[@]}" --dtype bf16 --seq-len 4096 --batch-size 4 --variants compile)
    B_ARGS=(--flavor 16B --model-override n_layers=4 "${VOCAB[@]}" --dtype bf16 --seq-len 4096 --batch-size 2)
    B_VARIANT=compile
    D_VARIANTS=compile_float8
    C_ARGS=(--flavor proxy_1b --tokens 16384 --dtype bf16)
    E_ARGS=(--flavor proxy_1b "${VOCAB[@]}" --dtype bf16 --seq-len 4096 --batch-size 1 --variants eager)
    F_ARGS=(--flavor proxy_1b "${VOCAB[@]}" --dtype bf16 --seq-len 4096 --batch-size 4 --variants compile,compile_autocast)
    H_ARGS=(--flavor proxy_1b --steps 5 --warmup 2)
    TIMING=(--steps 5 --repeats 2 --warmup 2)
    G_ARGS=(--device cuda --dtype bf16 --flavor 16B --model-override n_layers=4 vocab_size=8192 --seq-len 4096 --micro-batches 4 --steps 3)
    GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count())")
fi

run() {  # name, command...: stdout+stderr to <name>.log, exit status to <name>.rc
    local name="$1"
    shift
    echo "gpu_check: $name: $*" >&2
    local start=$SECONDS
    timeout "$STEP_TIMEOUT" "$@" >"$OUT_DIR/$name.log" 2>&1
    echo $? >"$OUT_DIR/$name.rc"
    echo "gpu_check: $name: exit $(cat "$OUT_DIR/$name.rc") after $((SECONDS - start)) s" >&2
}

run A "$PY" "$ROOT/benchmarks/step_bench.py" "${A_ARGS[@]}" "${TIMING[@]}" --device "$DEVICE" \
    --profile --trace-dir "$OUT_DIR/traces" --json "$OUT_DIR/A.json"
run B "$PY" "$ROOT/benchmarks/step_bench.py" "${B_ARGS[@]}" --variants "$B_VARIANT" "${TIMING[@]}" \
    --device "$DEVICE" --json "$OUT_DIR/B.json"
run D "$PY" "$ROOT/benchmarks/step_bench.py" "${B_ARGS[@]}" --variants "$D_VARIANTS" --float8-experts "${TIMING[@]}" \
    --device "$DEVICE" --json "$OUT_DIR/D.json"
run C "$PY" "$ROOT/benchmarks/moe_bench.py" "${C_ARGS[@]}" --device "$DEVICE"
run E "$PY" "$ROOT/benchmarks/step_bench.py" "${E_ARGS[@]}" "${TIMING[@]}" --device "$DEVICE" \
    --profile --trace-dir "$OUT_DIR/traces" --json "$OUT_DIR/E.json"
run F "$PY" "$ROOT/benchmarks/step_bench.py" "${F_ARGS[@]}" "${TIMING[@]}" --device "$DEVICE" --json "$OUT_DIR/F.json"
if [ "$GPUS" -ge 2 ]; then
    run G "$PY" "$ROOT/benchmarks/moe_overlap_bench.py" "${G_ARGS[@]}" --no-delay --json "$OUT_DIR/G.json"
else
    echo "needs 2 GPUs (one per ep rank), this machine has $GPUS" >"$OUT_DIR/G.skipped"
fi
run H "$PY" "$ROOT/benchmarks/optim_bench.py" "${H_ARGS[@]}" --worlds 1 --device "$DEVICE" \
    --settings AdamW:float32,AdamW:bfloat16,muon:float32 --json "$OUT_DIR/H.json" --ns-compare "$OUT_DIR/H_ns.json"

"$PY" - "$OUT_DIR" <<'EOF'
import json
import sys
from pathlib import Path

out = Path(sys.argv[1])


def load(name):
    """The measurement's JSON result, or None when it failed (its .rc / .log say why)."""
    if (out / f"{name}.rc").read_text().strip() != "0":
        return None
    if (out / f"{name}.json").exists():
        return json.loads((out / f"{name}.json").read_text())
    text = (out / f"{name}.log").read_text()  # moe_bench prints its JSON first on stdout
    start = text.index("{")
    return json.JSONDecoder().raw_decode(text[start:])[0]


def last_line(name):
    lines = [line for line in (out / f"{name}.log").read_text().splitlines() if line.strip()]
    return lines[-1][:200].replace("|", "/") if lines else "(empty log)"


def fmt(value, spec):
    return "n/a" if value is None else format(value, spec)


rows = []
a, b, c, d, e, f, g = load("A"), load("B"), load("C"), load("D"), load("E"), load("F"), load("G")
for tag, res in (("A", a), ("E", e)):
    if res is None:
        rows.append((f"{tag} step proxy_1b", f"failed, see {tag}.log", last_line(tag)))
        continue
    for name, r in res["variants"].items():
        where = f"{tag} {res['flavor']} {res['dtype']} {name} {res['batch_size']}x{res['seq_len']}"
        rows.append((where, "tokens/s", fmt(r["tokens_per_s"], ",.0f")))
        rows.append((where, "MFU %", fmt(r["mfu_pct"], ".1f")))
        rows.append((where, "peak memory MiB", fmt(r["peak_mem_mib"], ".0f")))
        rows.append((where, "estimate / measured peak", fmt(r.get("estimate_vs_measured"), ".3f")))
        rows.append((where, "kernel launches per step", fmt(r.get("kernel_launches"), "d")))
        rows.append((where, "host syncs per step", fmt(r.get("host_syncs"), "d")))
        rows.append((where, "host reads of device values", fmt(r.get("host_reads"), "d")))
        casts = r.get("weight_cast_bytes")
        rows.append((where, "weight casts MiB per step", fmt(None if casts is None else casts / 2**20, ".1f")))
for name, res in (("B", b), ("D", d)):
    if res is None:
        rows.append((f"{name} step 16B n_layers=4", f"failed, see {name}.log", last_line(name)))
        continue
    shape = f"{res['flavor']} {' '.join(res['model_overrides'])} {res['dtype']} {res['batch_size']}x{res['seq_len']}"
    for variant, r in res["variants"].items():
        rows.append((f"{name} {shape} {variant}", "tokens/s", fmt(r["tokens_per_s"], ",.0f")))
        rows.append((f"{name} {shape} {variant}", "MFU %", fmt(r["mfu_pct"], ".1f")))
    for variant, why in res["skipped"].items():
        rows.append((f"{name} {shape} {variant}", "skipped", why))
float8 = [r for v, r in (d or {}).get("variants", {}).items() if "float8" in v]
if b is not None and b["variants"] and float8:
    base = next(iter(b["variants"].values()))["tokens_per_s"]
    rows.append(("D / B", "float8 speed-up (tokens/s ratio)", fmt(float8[0]["tokens_per_s"] / base, ".3f")))
if f is None:
    rows.append(("F cast policy proxy_1b", "failed, see F.log", last_line("F")))
else:
    shape = f"{f['flavor']} {f['dtype']} {f['batch_size']}x{f['seq_len']}"
    for variant, r in f["variants"].items():
        rows.append((f"F {shape} {variant}", "tokens/s", fmt(r["tokens_per_s"], ",.0f")))
        rows.append((f"F {shape} {variant}", "peak memory MiB", fmt(r["peak_mem_mib"], ".0f")))
    fsdp, autocast = f["variants"].values()
    rows.append(("F FSDP2 cast / autocast", "tokens/s ratio (keep FSDP2 on one process only if > 1.03)",
                 fmt(fsdp["tokens_per_s"] / autocast["tokens_per_s"], ".3f")))
if c is None:
    rows.append(("C moe_bench", "failed, see C.log", last_line("C")))
else:
    for r in c["results"]:
        where = f"C moe_bench {c['flavor']} {c['tokens']} tokens {c['dtype']} {r['variant']}"
        rows.append((where, "time / dense ideal", fmt(r["ratio_to_ideal"], ".2f")))

if (out / "G.skipped").exists():
    rows.append(("G moe_overlap dp_shard 2 x ep 2", "skipped", (out / "G.skipped").read_text().strip()))
elif (g := load("G")) is None:
    rows.append(("G moe_overlap dp_shard 2 x ep 2", "failed, see G.log", last_line("G")))
else:
    ga = g["args"]
    where = f"G moe_overlap {ga['flavor']} {' '.join(ga['model_override'])} {ga['dtype']} {ga['micro_batches']}x1x{ga['seq_len']}"
    for rank, s in enumerate(g["summary"]):
        rows.append((f"{where} rank {rank}", "step time on / off", fmt(s["ratio_no_delay"], ".3f")))
if (h := load("H")) is None:
    rows.append(("H optimizer step", "failed, see H.log", last_line("H")))
else:
    for r in h:
        where = f"H optimizer step {r['optimizer']} {r['state_dtype']} states"
        rows.append((where, "optimizer step ms", fmt(r["step_ms"], ".1f")))
        rows.append((where, "host reads per optimizer step", fmt(r["host_reads"], "d")))
    base = h[0]["step_ms"]
    for r in h[1:]:
        rows.append((f"H {r['optimizer']} {r['state_dtype']} / AdamW float32", "optimizer step time ratio",
                     fmt(r["step_ms"] / base, ".2f")))
    ns = json.loads((out / "H_ns.json").read_text())
    where = f"H expert stack {'x'.join(map(str, ns['shape']))} {ns['dtype']} NS, batched vs per matrix"
    rows.append((where, "bitwise equal", str(ns["bitwise_equal"])))
    rows.append((where, "max abs difference", fmt(ns["max_abs_diff"], ".3g")))

device = next((x["device"] for x in (a, b, c, d, e, f) if x is not None), "unknown")
print(f"\ngpu_check on {device}; results, logs and traces in {out}\n")
print("| measurement | figure | value |")
print("|---|---|---|")
for row in rows:
    print("| " + " | ".join(row) + " |")
failed = [n for n in "ABCDEFGH" if (out / f"{n}.rc").exists() and (out / f"{n}.rc").read_text().strip() != "0"]
if failed:
    print(f"\nfailed: {', '.join(failed)} (see {', '.join(n + '.log' for n in failed)})")
sys.exit(1 if failed else 0)
EOF
