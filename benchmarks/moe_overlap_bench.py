"""How much of the expert-parallel all-to-all ``[parallelism] moe_overlap`` hides
(trainer/parallel/moe_overlap.py), measured with an injected exchange delay.

Two gloo ranks (``dp_shard 2 x ep 2``, fp32) train the debug model (or ``--model-override``
sizes) with ``--micro-batches`` accumulated micro-batches per step. A benchmark-only dispatcher
(``DelayedAllToAll``) sleeps ``delay`` ms inside every token exchange's asynchronous path, as a
callback chained to the collective's future: it runs on gloo's worker thread once the
all-to-all is done, never on the compute thread, and the exchange's ``wait()`` waits for it. So
a step without the overlap pays the delay at every exchange, and an overlapped one only where no
compute of the other micro-batch runs beside it.

Both step objects run on the same Trainer; each round times one step of each (delay, variant)
pair, delay 0 and ``--delay-ms``, so that the machine's load changes fall on all four alike, and
the fastest of the rounds is taken (the least disturbed on a shared machine; medians too). Reported:
- ``ratio``: step time with the overlap / without, at the delay;
- ``hidden_ms``: the delay's cost removed by the overlap, (off(D) - off(0)) - (on(D) - on(0));
- ``ideal_hidden_ms``: min(D, compute beside the exchange) summed over the exchanges of the pairs
  (4 per MoE block interleaved in the step: every MoE block of the (micro-batches - 1) pairs
  without PP, counted in one step under DualPipeV), the compute of each being
  the mean compute of its node (attention forward, experts backward, experts forward, attention
  backward: span less waits) in the traced overlapped step at the delay;
- ``hidden_fraction``: hidden_ms / ideal_hidden_ms (issue 31 asks for >= 0.5 at 50 ms);
- ``trace_hidden_fraction``: the traced step's intersection of delays and compute / the ideal
  hidden time (both from that one step, so that a change of the machine's load cancels);
- a trace of one overlapped step at the delay (``--trace``, Chrome trace JSON, rank 0): the
  schedule's node spans on the compute thread and the injected delays on gloo's thread, timed
  with ``time.perf_counter`` on both (the profiler does not reliably record spans of gloo's
  threads), and ``overlap_ms``, their measured intersection.

    python benchmarks/moe_overlap_bench.py [--delay-ms 50] [--micro-batches 4] [--steps 5]
        [--model-override dim=256 ...] [--seq-len 128] [--trace trace.json] [--json out.json]

``--no-delay`` measures the overlap without injection: the step-time ratio only. With
``--device cuda`` (2 GPUs, NCCL) that is benchmarks/gpu_check.sh's measurement G.

``--dualpipev``: the same under DualPipeV (trainer/parallel/pipeline_overlap.py) on 4 ranks,
``pp 2 x dp_shard 2 x ep 2``, stages split ``Et*2|t*2|t|tL`` (MoE blocks in every stage, so
both ranks pair), one schedule run of ``--micro-batches`` pipeline micro-batches (one row each)
per step; off is plain DualPipeV. The ideal hidden time counts the MoE blocks each rank actually
interleaved in a step (a pair's common ones: the ``OVERLAP_F_B`` actions are counted, not
derived), so ``hidden_fraction`` is per rank.

    python benchmarks/moe_overlap_bench.py --dualpipev [--micro-batches 8] [--delay-ms 50]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from trainer.diagnostics import spawn_local
from trainer.parallel.expert_parallel import AllToAllTokenDispatcher, PendingExchange

# Node beside each exchange of a pair (trainer/parallel/moe_overlap.py, ``pair``).
BESIDE = ("MoELayerNodes.attention", "MoELayerNodes.experts_backward", "MoELayerNodes.experts",
          "MoELayerNodes.attention_backward")


class DelayRecorder:
    """What the delayed dispatchers of one process share: the delay, the compute thread, counts
    and (while tracing) the intervals."""

    def __init__(self):
        self.delay_s = 0.0
        self.compute_thread = threading.get_ident()
        self.on_worker = 0  # delays slept on gloo's thread
        self.as_deadline = 0  # delays left to the consumer's wait (module doc)
        self.intervals: list | None = None  # (start, end) perf_counter seconds of each delay
        self.waits: list | None = None  # (start, end) of each wait for a delayed exchange


class DelayedAllToAll(AllToAllTokenDispatcher):
    """The all-to-all dispatcher with ``recorder.delay_s`` of sleep chained to every token exchange.

    The sleep is a callback on the collective's future, so it runs on the thread that completes
    the all-to-all: gloo's worker thread. A future that is already complete when the callback is
    chained runs it at once on the calling (compute) thread instead; there the callback only sets a
    deadline, ``delay_s`` after the exchange finished, which ``wait()`` sleeps out, so the delay
    never blocks compute that runs before the consumer waits.
    """

    recorder: DelayRecorder

    def start_exchange(self, rows, output_splits, input_splits) -> PendingExchange:
        pending = super().start_exchange(rows, output_splits, input_splits)
        rec = self.recorder
        if not rec.delay_s:
            return pending
        deadline = []

        def delay(future):
            if threading.get_ident() == rec.compute_thread:
                deadline.append(time.perf_counter() + rec.delay_s)
                rec.as_deadline += 1
            else:
                start = time.perf_counter()
                time.sleep(rec.delay_s)
                rec.on_worker += 1
                if rec.intervals is not None:
                    rec.intervals.append((start, time.perf_counter()))
            return future.value()

        return _Delayed(pending.future.then(delay), pending.out, deadline, rec)


class _Delayed(PendingExchange):
    __slots__ = ("deadline", "recorder")

    def __init__(self, future, out, deadline: list, recorder: DelayRecorder):
        super().__init__(future, out)
        self.deadline = deadline
        self.recorder = recorder

    def wait(self):
        rec = self.recorder
        start = time.perf_counter()
        out = super().wait()
        if self.deadline:
            end = self.deadline[0]
            time.sleep(max(0.0, end - time.perf_counter()))
            if rec.intervals is not None:
                rec.intervals.append((end - rec.delay_s, end))
        if rec.waits is not None:
            rec.waits.append((start, time.perf_counter()))
        return out


def _step_time(trainer, batches) -> float:
    start = time.perf_counter()
    trainer.train_step(batches)  # ends with the step's host read: the device is done
    return time.perf_counter() - start


def _traced_step(trainer, batches, rec: DelayRecorder, path: str) -> tuple[float, dict]:
    """One overlapped step with every delay interval, node span and wait for an exchange recorded
    (perf_counter): written as a Chrome trace (chrome://tracing, Perfetto) to ``path``. Returns the
    time (ms) the delays intersect the nodes' compute (their spans less their waits), and each
    node kind's mean compute (ms, its span less its waits)."""
    from trainer.parallel import moe_overlap

    nodes: list = []
    patched = {}
    for cls in (moe_overlap.MoELayerNodes, moe_overlap.NodeRun):  # NodeRun: the pre and head nodes
        for name in ("attention", "experts", "post", "experts_backward", "attention_backward", "post_backward",
                     "forward_pre", "forward_head", "backward_head", "backward_pre"):
            if name in vars(cls):
                patched[(cls, name)] = method = vars(cls)[name]

                def timed(*args, _method=method, _name=f"{cls.__name__}.{name}", **kwargs):
                    start = time.perf_counter()
                    try:
                        return _method(*args, **kwargs)
                    finally:
                        nodes.append((_name, start, time.perf_counter()))

                setattr(cls, name, timed)
    rec.intervals, rec.waits = delays, waits = [], []
    try:
        trainer.train_step(batches)
    finally:
        rec.intervals = rec.waits = None
        for (cls, name), method in patched.items():
            setattr(cls, name, method)
    origin = min(start for _, start, _ in nodes)

    def spans(intervals, name, tid):
        return [
            {"name": name(i), "ph": "X", "pid": 0, "tid": tid, "ts": (i[-2] - origin) * 1e6, "dur": (i[-1] - i[-2]) * 1e6}
            for i in intervals
        ]

    events = (
        spans(nodes, lambda i: i[0], "compute thread")
        + spans(waits, lambda i: "waiting for an exchange", "compute thread")
        + spans(delays, lambda i: "injected exchange delay", "exchange (gloo worker)")
    )
    if path:
        Path(path).write_text(json.dumps({"traceEvents": events}))

    # Compute = the node spans less the waits for an exchange (a node's span includes its wait).
    holes = _union(waits)
    compute = _minus(_union([i[-2:] for i in nodes]), holes)
    per_kind: dict[str, list[float]] = {}
    for name, a, b in nodes:
        per_kind.setdefault(name, []).append(sum(c1 - c0 for c0, c1 in _minus([(a, b)], holes)))
    node_ms = {name: 1e3 * statistics.mean(v) for name, v in per_kind.items()}
    overlap = 1e3 * sum(max(0.0, min(d1, c1) - max(d0, c0)) for d0, d1 in delays for c0, c1 in compute)
    return overlap, node_ms


def _union(intervals) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [tuple(i) for i in out]


def _minus(intervals, holes) -> list[tuple[float, float]]:
    """Disjoint sorted ``intervals`` less disjoint sorted ``holes``."""
    out = []
    for a, b in intervals:
        for h0, h1 in holes:
            if h1 <= a or h0 >= b:
                continue
            if h0 > a:
                out.append((a, h0))
            a = max(a, h1)
        if a < b:
            out.append((a, b))
    return out


def _paired_layers(trainer, step, batches) -> int:
    """The MoE blocks interleaved in one step of ``step``, summed over its pairs (a pair
    interleaves the two micro-batches' common number of MoE blocks)."""
    from trainer.parallel import moe_overlap, pipeline_overlap

    counts = []
    originals = {module: module.pair for module in (moe_overlap, pipeline_overlap)}

    def counting(b, f, _pair=moe_overlap.pair):
        counts.append(min(len(b.moe_blocks), len(f.moe_blocks)))
        return _pair(b, f)

    trainer.parallel = step
    try:
        for module in originals:
            module.pair = counting
        trainer.train_step(batches)
    finally:
        for module, original in originals.items():
            module.pair = original
    return sum(counts)


def _worker(rank: int, world: int, port: int, a, queue) -> None:
    import os

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world)
    )
    torch.set_num_threads(a.threads)
    from models.moe import moe_modules
    from trainer.config import load_config
    from trainer.data import build_tokenizer
    from trainer.diagnostics import apply_overrides
    from trainer.model_args import build_model_args
    from trainer.parallel.moe_overlap import MoEOverlapStep
    from trainer.parallel.pipeline_step import PipelineStep
    from trainer.parallel.step import ParallelStep
    from trainer.runtime import resolve_path
    from trainer.trainer import Trainer

    folder = tempfile.mkdtemp()
    # Without PP: one row per accumulated micro-batch. DualPipeV: one schedule run per step, its
    # pipeline micro-batches one row each.
    local_batch = a.micro_batches if a.dualpipev else 1
    pipeline = [
        "--parallelism.pp", "2", "--parallelism.pp_schedule", "DualPipeV", "--parallelism.pp_layout", "Et*2|t*2|t|tL",
        "--parallelism.pp_microbatches", str(a.micro_batches),
    ] if a.dualpipev else []
    cfg = load_config([
        "--job.config_file", str(Path(__file__).resolve().parents[1] / "train_configs" / "debug_model.toml"),
        "--job.dump_folder", folder, "--no-job.print_config", "--no-validation.enable",
        "--model.flavor", a.flavor, *pipeline,
        "--parallelism.dp_shard", "2", "--parallelism.ep", "2", "--training.device", a.device,
        "--training.seq_len", str(a.seq_len), "--training.local_batch_size", str(local_batch),
        "--training.global_batch_size", str(2 * a.micro_batches),
        "--training.mixed_precision_param", "bfloat16" if a.dtype == "bf16" else "float32",
        "--training.steps", "1000", "--lr_scheduler.warmup_steps", "1",
        "--parallelism.fsdp_reshard_after_forward", "never",
    ])
    tokenizer = build_tokenizer(resolve_path(cfg.model.tokenizer_path))
    model_args = apply_overrides(build_model_args(cfg, tokenizer.vocab_size, tokenizer.eos_id), a.model_override)
    with contextlib.redirect_stdout(sys.stderr):
        trainer = Trainer(cfg, model_args)
    try:
        moes = moe_modules(trainer.model)
        rec = DelayRecorder()
        for moe in moes:
            moe.dispatcher.__class__ = DelayedAllToAll
            moe.dispatcher.recorder = rec
        # Both keep FSDP's units gathered through the step (reshard_after_forward "never" and no
        # reshard between micro-batches, as the overlapped step does), so that the two differ only
        # in the schedule: re-gathering units in the plain step would hide behind the delays too.
        dims = trainer.parallel.dims
        if a.dualpipev:  # zero-bubble: both keep the stages' units gathered from forward to REDUCE_GRAD
            plain = trainer.parallel
            steps = {"off": plain, "on": PipelineStep(
                trainer.model, dims, plain.stages, (plain.activation_shape, plain.activation_dtype), moe_overlap=True
            )}
        else:
            steps = {
                "off": ParallelStep(trainer.model, dims, keep_weights_between_microbatches=True),
                "on": MoEOverlapStep(trainer.model, dims),
            }
        batches = trainer.next_microbatches()[0]
        paired = _paired_layers(trainer, steps["on"], batches)
        delays = [0.0] if a.no_delay else [0.0, a.delay_ms / 1e3]
        times: dict[str, dict[str, list[float]]] = {}
        # Every (delay, variant) once per round, so that a change of the machine's load falls on
        # all four alike; round 0 is the warm-up.
        for round_index in range(a.steps + 1):
            for delay in delays:
                rec.delay_s = delay
                runs = times.setdefault(f"{delay * 1e3:g}", {"off": [], "on": []})
                for name, step in steps.items():
                    trainer.parallel = step
                    seconds = _step_time(trainer, batches)
                    if round_index:
                        runs[name].append(seconds)
        trainer.parallel = steps["on"]
        result = {
            "rank": rank,
            "moe_layers": len(moes),
            # MoE blocks interleaved in a step, summed over its pairs (MTP's runs outside them).
            "paired_layers": paired,
            "micro_batches": trainer.grad_accum_steps,
            # The fastest of the rounds: on a shared machine the least disturbed one.
            "step_s": {d: {k: min(v) for k, v in r.items()} for d, r in times.items()},
            "step_s_median": {d: {k: statistics.median(v) for k, v in r.items()} for d, r in times.items()},
        }
        if not a.no_delay:
            rec.delay_s = a.delay_ms / 1e3
            trace = a.trace if rank == 0 else ""
            result["overlap_ms"], result["node_ms"] = _traced_step(trainer, batches, rec, trace)
            result["delays_on_gloo_thread"] = rec.on_worker
            result["delays_as_deadline"] = rec.as_deadline
        queue.put(result)
    finally:
        trainer.close()


def summarize(r: dict, delay_ms: float | None) -> dict:
    """The figures of one rank's measurements (module doc)."""
    step = r["step_s"]
    out = {"ratio_no_delay": step["0"]["on"] / step["0"]["off"]}
    if delay_ms is None:
        return out
    d = f"{delay_ms:g}"
    ideal = sum(min(delay_ms, r["node_ms"][kind]) for kind in BESIDE) * r["paired_layers"]
    hidden = ((step[d]["off"] - step["0"]["off"]) - (step[d]["on"] - step["0"]["on"])) * 1e3
    out.update({
        "ratio": step[d]["on"] / step[d]["off"],
        "hidden_ms": hidden,
        "ideal_hidden_ms": ideal,
        "hidden_fraction": hidden / ideal,
        "overlap_ms_in_trace": r["overlap_ms"],
        # The trace's own measure: compute and delays of the same step (load changes cancel).
        "trace_hidden_fraction": r["overlap_ms"] / ideal,
    })
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--delay-ms", type=float, default=50.0)
    p.add_argument("--no-delay", action="store_true", help="no injection: the overlap's own effect (GPU check)")
    p.add_argument("--micro-batches", type=int, default=4,
                   help="accumulated micro-batches per step; with --dualpipev pipeline micro-batches (>= 4)")
    p.add_argument("--dualpipev", action="store_true", help="DualPipeV pp 2 x dp_shard 2 x ep 2 on 4 ranks (module doc)")
    p.add_argument("--flavor", default="debugmodel")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: one GPU per rank (2 GPUs, NCCL); use with --no-delay")
    p.add_argument("--steps", type=int, default=5, help="timed steps per variant and delay (after one warm-up)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--model-override", nargs="*", default=[], help="ModelArgs overrides, e.g. dim=256 moe.num_experts=8")
    p.add_argument("--trace", default="", help="write rank 0's trace of one delayed overlapped step here")
    p.add_argument("--json", default="")
    a = p.parse_args(argv)
    if a.device == "cuda" and not a.no_delay:
        p.error("the injected delay is a gloo (CPU) measurement: add --no-delay with --device cuda")
    ranks = sorted(spawn_local(_worker, 4 if a.dualpipev else 2, a, timeout=1800), key=lambda r: r["rank"])
    delay = None if a.no_delay else a.delay_ms
    result = {"args": vars(a), "ranks": ranks, "summary": [summarize(r, delay) for r in ranks]}
    print(json.dumps(result, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
