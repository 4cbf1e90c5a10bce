"""Worker of tests/distributed/test_pipeline_grads.py: every gradient after one pipelined training
step (forward, backward and the step's gradient finishing, no clip and no optimizer step),
compared on each rank with one process computing the same step on the whole batch.

The model is a small DeepSeek-V3 (4 blocks, the first dense, MoE with the sequence-wise balance
loss, MTP depth 1), fp32, on the trainer's own path: `parallelize_model` (pipeline split, FSDP,
step object) and `PipelineStep.forward_backward` with the trainer's objective. The one-process
reference is the same model built and initialised in this process (initial weights depend on the
seed and each parameter's global name only), with its gradients summed over the whole batch.

``negative_control``: the same pipeline with every FSDP unit resharding its parameters after
forward (torch's public ``set_reshard_after_forward``), which the zero-bubble schedules cannot
handle. The step object is built past `build_step`'s guard, which is checked to refuse it.

``ac``: the activation checkpointing mode. Every call of a checkpointed block is counted per
micro-batch (a forward pre-hook on the wrapped block, keyed by the block and its input's sum: each
micro-batch's rows differ), so ``calls`` - 1 is how often the block was recomputed. With ``ac`` set
and a zero-bubble schedule the case runs twice on fresh models: the trainer's path, then torch's own
weight pass (the schedule's registered ``BACKWARD_WEIGHT`` function removed, so torch's runtime runs
``stage_backward_weight`` itself), and the two runs' gradients are compared bit for bit.
"""

from __future__ import annotations

import contextlib
from functools import partial

import torch
import torch.distributed as dist

SEQ_LEN = 16
GLOBAL_BATCH = 8
VOCAB = 128
SEED = 3
MTP_WEIGHT = 0.3


def model_args():
    from models.deepseek_v3 import DeepSeekV3ModelArgs
    from models.moe import MoEArgs

    return DeepSeekV3ModelArgs(
        vocab_size=VOCAB, dim=32, inter_dim=64, moe_inter_dim=16, n_layers=4, n_dense_layers=1, n_heads=2,
        moe=MoEArgs(num_experts=4, num_shared_experts=1, top_k=2, score_func="sigmoid", route_norm=True,
                    seq_aux_loss_alpha=1e-2),
        q_lora_rank=0, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
        max_seq_len=SEQ_LEN, mtp_depth=1,
    )


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    seq = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ_LEN + 1), generator=g)
    return seq[:, :-1], seq[:, 1:].clone()


def _objective(out, targets, aux_scale, n_valid, n_valid_mtp):
    """The trainer's objective (trainer/trainer.py `Trainer.objective`) with its default loss."""
    from trainer.loss import cross_entropy_sum

    loss = cross_entropy_sum(out.logits, targets.labels) / n_valid
    mtp = targets.mtp_loss_sum(out.mtp_logits) / n_valid_mtp
    return loss + out.aux_loss * aux_scale + MTP_WEIGHT * mtp, loss, mtp


def _reference_grads() -> dict[str, torch.Tensor]:
    """One process, the whole batch, one micro-batch."""
    from models.deepseek_v3 import DeepSeekV3Model
    from trainer.parallel.parallelize import materialize
    from trainer.parallel.step import Targets

    with torch.device("meta"):
        model = DeepSeekV3Model(model_args())
    materialize(model, torch.device("cpu"), SEED)
    model.train()
    tokens, labels = _batch()
    targets = Targets(labels)
    n_valid = torch.tensor(float(labels.numel()))
    n_mtp = torch.tensor(float(sum(t.numel() for t in targets.mtp_targets(1))))
    objective, _, _ = _objective(model(tokens, labels=labels), targets, 1.0, n_valid, n_mtp)
    objective.backward()
    return {name: p.grad for name, p in model.named_parameters()}


def _count_block_calls(model) -> dict[tuple[str, float], int]:
    """Calls of each checkpointed block by (block, micro-batch), filled as the model runs."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    calls: dict[tuple[str, float], int] = {}

    def count(name, module, args):
        with torch.no_grad():
            key = (name, round(args[0].double().sum().item(), 6))
        calls[key] = calls.get(key, 0) + 1

    for name, module in model.named_modules():
        if isinstance(module, CheckpointWrapper):
            module._checkpoint_wrapped_module.register_forward_pre_hook(partial(count, name))
    return calls


def _pipelined(schedule: str, pp: int, dp_shard: int, ep: int, negative_control: bool, ac: str = "none",
               torch_weight_pass: bool = False, max_deferred: int = -1):
    """This rank's model after one forward and backward, whether the guard refused, the
    checkpointed blocks' calls and the step (`_count_block_calls`). ``torch_weight_pass``: torch's runtime runs
    the weight pass itself (module doc). ``max_deferred``: ``pp_max_deferred_weight_passes``."""
    from torch.distributed.pipelining.schedules import BACKWARD_WEIGHT

    from models.deepseek_v3 import DeepSeekV3Model
    from trainer.config import ActivationCheckpoint, Engram, Parallelism, Quantize, Training
    from trainer.parallel.parallel_dims import ParallelDims
    from trainer.parallel.parallelize import apply_pipeline, build_step, materialize, parallelize_stage
    from trainer.parallel.pipeline_step import PipelineStep, activation_meta

    world = dist.get_world_size()
    parallelism = Parallelism(pp=pp, dp_shard=dp_shard, ep=ep, pp_schedule=schedule,
                              pp_max_deferred_weight_passes=max_deferred)
    dims = ParallelDims.from_config(parallelism, world)
    dims.build_meshes("cpu")
    training = Training(seq_len=SEQ_LEN, local_batch_size=GLOBAL_BATCH // dims.dp_degree,
                        mixed_precision_param="float32")
    with torch.device("meta"):
        model = DeepSeekV3Model(model_args())
    specs = apply_pipeline(model, dims, SEQ_LEN)
    stage = parallelize_stage(model, dims, parallelism, training, ActivationCheckpoint(mode=ac), Quantize(), Engram(),
                              "cpu", specs)
    calls = _count_block_calls(model)
    refused = None
    if negative_control:
        for module in stage.stages:  # the blocks' units (the stage roots hold what two stages share)
            for unit in module.blocks:
                unit.set_reshard_after_forward(True)
        try:
            build_step(model, dims, training, stage)
        except ValueError as e:
            refused = str(e)
        step = PipelineStep(model, dims, stage.stages, activation_meta(training, dims, model.args.dim, torch.float32),
                            context_parallel=stage.context_parallel)
    else:
        step = build_step(model, dims, training, stage)
    materialize(model, torch.device("cpu"), SEED)
    model.train()
    tokens, labels = _batch()
    dp_rank, dp_size = dims.dp_rank_and_degree() if dims.has_mesh("dp") else (0, 1)
    rows = slice(dp_rank * GLOBAL_BATCH // dp_size, (dp_rank + 1) * GLOBAL_BATCH // dp_size)
    micro, n_valid, n_mtp = step.prepare([(tokens[rows], labels[rows])], model.args.mtp_depth)
    if torch_weight_pass:
        step.schedule(tokens.device, train=True)._comp_type_to_function_map.pop(BACKWARD_WEIGHT, None)
    objective = partial(_objective, n_valid=n_valid, n_valid_mtp=n_mtp)
    with step.loss_context():
        step.forward_backward(micro, objective, contextlib.nullcontext)
    # What the step owes the gradients before the optimizer (the embedding replica's sum); no clip.
    step.finish_grads([p for p in model.parameters() if p.grad is not None], 0.0)
    return model, refused, calls, step


def _most_waiting(step) -> int:
    """The most weight passes waiting at once in this rank's executed order."""
    from torch.distributed.pipelining.schedules import BACKWARD_INPUT, BACKWARD_WEIGHT

    schedule = step.schedule(torch.device("cpu"), train=True)
    waiting = most = 0
    for action in schedule.pipeline_order_with_comms[schedule.rank]:
        waiting += {BACKWARD_INPUT: 1, BACKWARD_WEIGHT: -1}.get(action.computation_type, 0)
        most = max(most, waiting)
    return most


def run(rank: int, world: int, port: int, cases: list[dict], queue) -> None:
    """Each case (`_pipelined`'s keyword arguments) in turn on the same process group; puts one
    result per case and rank."""
    from torch.distributed.tensor import DTensor

    from trainer.config.schedules import ZERO_BUBBLE_SCHEDULES
    from trainer.diagnostics import init_local_gloo

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    init_local_gloo(rank, world, port)
    try:
        reference = _reference_grads()
        for case in cases:
            model, refused, calls, step = _pipelined(**case)
            torch_path = {}
            if case.get("ac", "none") != "none" and case["schedule"] in ZERO_BUBBLE_SCHEDULES:
                torch_model, _, torch_calls, _ = _pipelined(**case, torch_weight_pass=True)
                torch_grads = dict(torch_model.named_parameters())
                torch_path = {
                    "calls": torch_calls,
                    "bitwise": all(torch.equal(p.grad, torch_grads[name].grad)
                                   for name, p in model.named_parameters() if p.grad is not None),
                }
                if case["schedule"] == "DualPipeV":
                    # One weight pass at most waiting: the oldest taken in its input pass instead.
                    capped, _, _, capped_step = _pipelined(**case, max_deferred=1)
                    capped_grads = dict(capped.named_parameters())
                    torch_path["capped_bitwise"] = all(
                        torch.equal(p.grad, capped_grads[name].grad)
                        for name, p in model.named_parameters() if p.grad is not None)
                    torch_path["waiting"] = (_most_waiting(step), _most_waiting(capped_step))
            worst, missing = 0.0, []
            for name, param in model.named_parameters():
                if param.grad is None:
                    missing.append(name)
                    continue
                got = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
                want = reference[name.replace("._checkpoint_wrapped_module", "")]  # the wrapper's own name
                worst = max(worst, ((got - want).abs().max() / want.abs().max().clamp_min(1e-12)).item())
            queue.put({"case": case, "rank": rank, "max_rel": worst, "missing": missing, "refused": refused,
                       "params": sum(1 for _ in model.parameters()), "calls": calls, "torch_path": torch_path})
    finally:
        dist.destroy_process_group()


class _Results(list):
    """A queue that keeps what is put on it."""

    put = list.append


def run_job(rank: int, world: int, port: int, cases: list[dict], queue) -> None:
    """`run` as a `spawn_local_jobs` job: puts this rank's results of all cases as one list."""
    results = _Results()
    run(rank, world, port, cases, results)
    queue.put(list(results))
