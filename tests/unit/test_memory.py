"""trainer/planning/memory.py: the CUDA terms of the estimate and the refusal of a run that cannot fit."""

import pytest
import torch

from models.deepseek_v3 import DeepSeekV3Model, get_flavor
from models.deepseek_v3.stats import stage_unit_costs
from trainer.config import ConfigError, load_config
from trainer.config.pipeline_layout import PipelineCosts, PipelinePlan
from trainer.parallel.parallel_dims import ParallelDims
from trainer.planning.fit_check import available_bytes, check_fits
from trainer.planning.memory import EstimateCache, GiB, MiB, cuda_block_bytes, estimate


def test_cuda_allocator_rounding():
    assert cuda_block_bytes(1) == 512 and cuda_block_bytes(513) == 1024
    assert cuda_block_bytes(5 * MiB + 1) == 5 * MiB + 512  # 1-10 MiB: carved from 20 MiB segments
    assert cuda_block_bytes(11.5 * MiB) == 12 * MiB  # > 10 MiB: a remainder <= 1 MiB stays in the block
    assert cuda_block_bytes(10.5 * MiB + 1) == 10.5 * MiB + 512  # ... a larger one is split off


def test_cuda_terms_of_the_estimate():
    args = (1, 1, 1, 1, 4096, 1, "none")
    cpu = estimate("proxy_1b", *args, device_type="cpu")["gib"]
    cuda = estimate("proxy_1b", *args, device_type="cuda")["gib"]
    params = estimate("proxy_1b", *args)["params_per_gpu_B"] * 1e9
    embedding = get_flavor("proxy_1b").vocab_size * get_flavor("proxy_1b").dim
    assert cuda["bf16_weight_copies"] == pytest.approx((params - embedding) * 2 / GiB)
    assert cuda["cublas_workspace"] == pytest.approx(32 / 1024) and 0 < cuda["allocator_rounding"] < 0.1
    assert cpu["bf16_weight_copies"] == cpu["allocator_rounding"] == cpu["cublas_workspace"] == 0
    # CPU's RMSNorm keeps each norm's input and its normalized rows in fp32, CUDA's fused kernel
    # the input in bf16 (which keeps the rest of wkv_a's output, the rope part, with it): four
    # norms per block, and the final norm and three per MTP module beside the head.
    a = get_flavor("proxy_1b")
    per_block = ((2 * 4 - 2) * (2 * a.dim + a.q_lora_rank + a.kv_lora_rank) - 2 * a.qk_rope_head_dim) * 4096
    assert cpu["layers"] - cuda["layers"] == pytest.approx((a.n_layers + a.mtp_depth) * per_block / GiB)
    assert cpu["logits_and_loss"] - cuda["logits_and_loss"] == pytest.approx(
        (1 + 3 * a.mtp_depth) * a.dim * 2 * 4 * 4096 / GiB)
    # fp32 has no compute copies; FSDP sharding replaces them with its unsharded blocks.
    assert estimate("proxy_1b", *args, mixed_precision="float32")["gib"]["bf16_weight_copies"] == 0
    assert estimate("proxy_1b", 8, 1, 1, 1, 4096, 1, "none")["gib"]["bf16_weight_copies"] == 0
    # The bool mask, and each attention call's additive copy in bf16 (12 blocks and the MTP block;
    # one under full AC).
    mask = estimate("proxy_1b", *args, block_causal_sdpa=True)["gib"]["attention_mask"]
    assert mask == pytest.approx(4096 * 4096 * (1 + 2 * 13) / GiB)
    full = estimate("proxy_1b", *args[:-1], "full", block_causal_sdpa=True)["gib"]["attention_mask"]
    assert full == pytest.approx(4096 * 4096 * (1 + 2) / GiB)


def _cfg(*argv):
    return load_config(["--no-job.print_config", "--training.mixed_precision_param", "float32", *argv])


def test_a_run_that_cannot_fit_is_refused_with_the_estimate():
    cfg = _cfg("--training.seq_len", "1000000", "--model.attn_mask_type", "block_causal",
               "--training.local_batch_size", "1")
    dims = ParallelDims.from_config(cfg.parallelism, 1, cfg.engram)
    args = get_flavor("debugmodel")
    with pytest.raises(ConfigError, match=r"does not fit: estimated \d+\.\d GiB per device > available 16\.0 GiB "
                                          r"on cpu .*largest term attention_mask"):
        check_fits(cfg, args, dims, torch.device("cpu"), available=16 * GiB)
    small = _cfg("--training.seq_len", "64")
    est = check_fits(small, args, dims, torch.device("cpu"), available=16 * GiB)
    assert 0 < est["gib"]["total"] < 1


@pytest.mark.parametrize("argv, advice, not_advised", [
    ([], "use activation_checkpoint.mode full", "pp_schedule"),
    (["--activation_checkpoint.mode", "full"], "lower training.seq_len", "use activation_checkpoint.mode full"),
    # Under a zero-bubble schedule full AC keeps the weight pass's recomputes: another schedule helps.
    (["--activation_checkpoint.mode", "full", "--parallelism.pp", "2", "--parallelism.pp_schedule", "DualPipeV"],
     "use parallelism.pp_schedule Interleaved1F1B or 1F1B (under DualPipeV", "use activation_checkpoint.mode full"),
])
def test_the_refusal_advises_what_can_help(argv, advice, not_advised):
    cfg = _cfg("--training.seq_len", "4096", *argv)
    world = cfg.parallelism.pp
    dims = ParallelDims.from_config(cfg.parallelism, world, cfg.engram)
    with pytest.raises(ConfigError) as err:
        check_fits(cfg, get_flavor("debugmodel"), dims, torch.device("cpu"), available=MiB)
    assert advice in str(err.value) and not_advised not in str(err.value)


def test_available_memory_on_cpu():
    free, where = available_bytes(torch.device("cpu"))
    assert free is not None and free > 0 and "CPU memory" in where


def test_available_memory_on_cuda_counts_cached_free_blocks(monkeypatch):
    """The CUDA calls are stubbed: what the check asks of the allocator, not a GPU."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (10 * GiB, 80 * GiB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 30 * GiB)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 26 * GiB)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA H100 80GB HBM3")
    free, where = available_bytes(torch.device("cuda", 0))
    assert free == 14 * GiB and where == "NVIDIA H100 80GB HBM3 (cuda:0)"


def test_the_trainer_asks_before_the_build_unless_switched_off(tmp_path):
    from trainer.trainer import Trainer

    def cfg(folder, *extra):
        return _cfg("--training.seq_len", "32", "--no-validation.enable", "--job.dump_folder", str(tmp_path / folder), *extra)

    # One MiB is less than any run needs: the check refuses before the build, unless it is off.
    with pytest.raises(ConfigError, match=r"does not fit: .* > available 0\.0 GiB on cpu"):
        Trainer(cfg("checked"), available_memory=MiB)
    Trainer(cfg("unchecked", "--no-training.check_memory_fit"), available_memory=MiB).close()


@pytest.mark.parametrize("flavor", ["proxy_1b", "16B"])  # with and without the query bottleneck
def test_allocator_rounding_sees_the_blocks_real_tensors(flavor):
    """The CUDA rounding term rounds each parameter tensor: its list must be the module's."""
    from trainer.planning.memory import _block_tensor_numels

    args = get_flavor(flavor)
    with torch.device("meta"):
        model = DeepSeekV3Model(args)
    for i, moe in ((0, False), (args.n_dense_layers, True)):
        block = model.layers[str(i)]
        real = sorted(p.numel() for p in block.parameters())
        assert real == sorted(_block_tensor_numels(args, moe)), (flavor, i)


def test_pipeline_estimate_is_the_fullest_rank():
    """pp 8 x FSDP 64 holds what FSDP 512 holds per GPU, split by stages: the first rank has the
    embedding, the last the head, MTP and the embedding replica, and only it the logits."""
    flat = estimate("671B", 512, 64, 1, 1, 4096, 1, "full")
    piped = estimate("671B", 64, 32, 1, 1, 4096, 8, "full",
                     pipeline=PipelinePlan(pp=8, pp_schedule="Interleaved1F1B", pp_stages_per_rank=2, pp_microbatches=8))
    assert piped["layout"]["gpus"] == flat["layout"]["gpus"] == 512
    assert piped["params_total_B"] == flat["params_total_B"]
    per_rank = piped["gib_per_pp_rank"]
    assert len(per_rank) == 8 and piped["gib"]["total"] == max(per_rank) == per_rank[-1]
    assert max(per_rank[:-1]) < per_rank[-1]
    # 1 sequence per micro-batch and up to pp = 8 of them in flight vs 1 sequence: the same rows.
    assert piped["gib"]["logits_and_loss"] == flat["gib"]["logits_and_loss"]


def test_the_estimate_splits_stages_as_the_trainer_does():
    """By cost (stats.stage_unit_costs): the debug model's head and MTP leave one block on the
    last of 2 stages, where the even split leaves two."""
    args = {"flavor": "debugmodel", "dp_shard": 1, "ep": 1, "tp": 1, "cp": 1, "seq_len": 64, "local_batch_size": 2,
            "ac": "none", "device_type": "cpu"}

    def per_rank(pp_layout: str = "") -> list[float]:
        plan = PipelinePlan(pp=2, pp_schedule="1F1B", pp_microbatches=2, pp_layout=pp_layout)
        return estimate(**args, pipeline=plan)["gib_per_pp_rank"]

    by_cost = per_rank()
    assert by_cost == per_rank("Et*5|tL")
    assert by_cost != per_rank("Et*4|t*2L")


def _held_params(args, specs, rank_specs, embed_replica):
    """Elements of the parameters a pp rank holds, counted on the real (meta) module."""
    with torch.device("meta"):
        model = DeepSeekV3Model(args)
    layers = {str(i) for s in rank_specs for i in s.layers}
    last = any(s.last for s in rank_specs)
    n = sum(p.numel() for i, block in model.layers.items() if i in layers for p in block.parameters())
    if any(s.first for s in rank_specs) or (last and embed_replica):
        n += model.embed.weight.numel()
    if last:
        n += sum(p.numel() for m in (model.norm, model.head, model.mtp) for p in m.parameters())
    return n


@pytest.mark.parametrize("mixed_precision", ["bfloat16", "float32"])
def test_pipeline_stages_stay_unsharded_through_the_step(mixed_precision):
    """InterleavedZeroBubble against LoopedBFS (the same stages per rank, and at 2 micro-batches
    the same in flight) on the same pp 2 x FSDP 2 layout and split:
    both hold their stages' fp32 gradient accumulators through the step (torch reduces a stage once
    per step) and their stages' unsharded parameters (compute dtype; the zero-bubble one from the
    first forward, the other from the first backward), which replace the all-gathered blocks of the
    FSDP buffers, keeping one block's fp32 reduce-scatter buffer."""
    from models.deepseek_v3.stats import stage_unit_costs
    from trainer.config.pipeline_layout import PipelineCosts, rank_stages, split_stages, stage_ranks
    from trainer.planning.memory import ACT_BYTES, _block_params

    layout = {"flavor": "debugmodel", "dp_shard": 2, "ep": 1, "tp": 1, "cp": 1, "seq_len": 256, "local_batch_size": 8,
              "ac": "none", "device_type": "cpu", "mixed_precision": mixed_precision}

    def estimate_with(schedule: str, **changes) -> dict:
        plan = PipelinePlan(pp=2, pp_schedule=schedule, pp_stages_per_rank=2, pp_microbatches=2)
        return estimate(**{**layout, **changes}, pipeline=plan)

    zb = estimate_with("InterleavedZeroBubble")
    base = estimate_with("LoopedBFS")
    # torch's stage backward keeps the parameters unsharded from the first backward on under
    # every schedule (set_reshard_after_backward(False)); LoopedBFS runs every forward before its
    # first backward, so its activations peak while the stages are sharded and accumulate nothing
    # (`test_a_rank_running_every_forward_first_peaks_before_its_accumulators`): no higher.
    assert all(b < z for b, z in zip(base["gib_per_pp_rank"], zb["gib_per_pp_rank"]))

    args = get_flavor("debugmodel")
    specs = split_stages(6, 1, 4, costs=PipelineCosts(**stage_unit_costs(args, 256)),
                         ranks=stage_ranks("Interleaved1F1B", 2, 4))
    moe_block = sum(_block_params(args, moe=True).values())  # the biggest block: its FSDP buffers
    compute = ACT_BYTES[mixed_precision]
    last = zb["gib"]  # the fullest rank: the last stage's, with the head and MTP
    held = _held_params(args, specs, rank_stages(specs, "InterleavedZeroBubble", 2, 1), embed_replica=True)
    assert last["stage_unsharded_params"] == pytest.approx(held * compute / GiB)
    assert last["stage_grad_accumulators"] == pytest.approx(held * 4 / GiB)
    assert last["fsdp_unsharded_block"] == pytest.approx(moe_block * 4 / GiB)
    # That fp32 reduce-scatter buffer belongs to REDUCE_GRAD, after the last backward: beside the
    # sharded gradients, not beside the activations.
    held = sum(last[k] for k in ("params", "optimizer", "stage_unsharded_params", "stage_grad_accumulators",
                                 "pipeline_buffers"))
    sides = (last["grads"] + last["fsdp_unsharded_block"], last["layers"] + last["logits_and_loss"] + last["attention_mask"],
             last["late_backward"] + last["attention_mask"])
    assert last["total"] == pytest.approx(held + max(sides))
    # The fp32 embedding / head gradients are the accumulators; what passes is FSDP's unsharded
    # gradient in the compute dtype.
    assert last["backward_temporaries"] == pytest.approx(2 * args.vocab_size * args.dim * compute / GiB)
    # Without sharding nothing is gathered or accumulated apart, and a zero-bubble schedule costs
    # what LoopedBFS does.
    assert estimate_with("LoopedBFS", dp_shard=1)["gib"]["stage_grad_accumulators"] == 0
    assert (estimate_with("InterleavedZeroBubble", dp_shard=1)["gib_per_pp_rank"]
            == estimate_with("LoopedBFS", dp_shard=1)["gib_per_pp_rank"])


def test_ep_as_cp_splits_the_sequence_and_keeps_fsdp_over_dp_shard():
    """ep_as_cp over dp_shard D, ep E holds what cp E over dp_shard D / E holds: the same FSDP
    degree (D), expert split and tokens per rank (the context degree was once read as more FSDP)."""
    as_cp = estimate("proxy_1b", 16, 4, 1, 1, 4096, 1, "none", ep_as_cp=True)
    plain_cp = estimate("proxy_1b", 4, 4, 1, 4, 4096, 1, "none")
    assert as_cp["gib"] == plain_cp["gib"]
    assert as_cp["layout"]["gpus"] == 16 and as_cp["layout"]["ep_as_cp"]
    whole = estimate("proxy_1b", 16, 4, 1, 1, 4096, 1, "none")["gib"]
    assert whole["logits_and_loss"] == pytest.approx(4 * as_cp["gib"]["logits_and_loss"])
    assert whole["params"] == as_cp["gib"]["params"]


def test_zero_bubble_with_full_ac_holds_the_weight_pass_recomputes():
    """InterleavedZeroBubble against LoopedBFS (the same stages per rank and, at 2 micro-batches,
    in flight), full AC, no FSDP:
    the zero-bubble rank adds ZB_WEIGHT_PASS_RECOMPUTES copies (one: the weight pass recomputes a
    block once) of its largest stage's activations without checkpointing, and still needs less with
    full AC than without (torch's own weight pass, recomputing per parameter group, needed more)."""
    from models.deepseek_v3.stats import stage_unit_costs
    from trainer.config.pipeline_layout import PipelineCosts
    from trainer.planning.activation_memory import layer_activation_bytes
    from trainer.planning.memory import ZB_WEIGHT_PASS_RECOMPUTES

    layout = {"flavor": "debugmodel", "dp_shard": 1, "ep": 1, "tp": 1, "cp": 1, "seq_len": 256, "local_batch_size": 2,
              "device_type": "cpu", "mixed_precision": "float32"}

    def with_schedule(schedule: str, ac: str) -> dict:
        plan = PipelinePlan(pp=2, pp_schedule=schedule, pp_stages_per_rank=2, pp_microbatches=2)
        return estimate(**layout, ac=ac, pipeline=plan)

    zb, base = with_schedule("InterleavedZeroBubble", "full"), with_schedule("LoopedBFS", "full")
    args = get_flavor("debugmodel")
    plan = PipelinePlan(pp=2, pp_schedule="InterleavedZeroBubble", pp_stages_per_rank=2, pp_microbatches=2)
    specs = plan.split(args.n_layers, args.mtp_depth, PipelineCosts(**stage_unit_costs(args, 256)))
    fullest = zb["gib_per_pp_rank"].index(zb["gib"]["total"])
    assert fullest == base["gib_per_pp_rank"].index(base["gib"]["total"])
    stages = [[i >= args.n_dense_layers for i in s.layers] + [True] * (args.mtp_depth if s.last else 0)
              for s in plan.rank_stages(specs, fullest)]
    largest = max(sum(layer_activation_bytes(args, moe, 1, 1, 4, cpu_norms=True) * 256 for moe in s) for s in stages)
    assert zb["gib"]["layers"] - base["gib"]["layers"] == pytest.approx(ZB_WEIGHT_PASS_RECOMPUTES * largest / GiB)
    for with_ac, without in zip(zb["gib_per_pp_rank"], with_schedule("InterleavedZeroBubble", "none")["gib_per_pp_rank"]):
        assert with_ac < without


def test_a_rank_running_every_forward_first_peaks_before_its_accumulators():
    """1F1B's rank 0 at pp 2 and 2 micro-batches runs both forwards before its first backward
    (torch's warm-up of pp - r): at its activations' peak the stage is sharded, FSDP gathers one
    block ahead and keeps the root unsharded, and no accumulator exists; once they exist the first
    backward has freed a micro-batch (the dry run of the debug model's pp 2 1F1B rank 0: 1.19 of it
    when both were held with every micro-batch, benchmarks/RESULTS.md)."""
    from trainer.planning.memory import _block_params, _estimate_share

    a = get_flavor("debugmodel")
    layers = list(range(3))
    share = dict(fsdp=4, ep=2, tp=1, cp=1, seq_len=256, ac="none", mixed_precision="float32", device_type="cpu",
                 block_causal_sdpa=False, optimizer="AdamW", state_dtype="float32", pipelined=True,
                 stage_blocks=[3], stage_io=(1, 1), micro=2)
    first, steady = (_estimate_share(a, layers, True, False, False, 2, 2, forwards_first=f, **share)["gib"]
                     for f in (True, False))
    assert steady["before_first_backward"] == 0
    stage = first["stage_unsharded_params"] + first["stage_grad_accumulators"]
    assert stage > 0 and first["late_backward"] < steady["late_backward"]
    block = _block_params(a, moe=True)  # the biggest block, its routed experts split over ep 2
    gathered = 2 * (block["tp_split"] + block["tp_replicated"] + block["experts"] / 2) * 4 + a.vocab_size * a.dim * 4
    assert first["before_first_backward"] * GiB == pytest.approx(first["layers"] * GiB + gathered)
    held = first["params"] + first["optimizer"] + first["pipeline_buffers"]
    assert first["total"] == pytest.approx(held + first["before_first_backward"])  # the activations' moment
    assert first["total"] < steady["total"] - stage / 2


def test_micro_batches_in_flight_follow_each_schedules_warm_up():
    """1F1B rank r holds pp - r micro-batches, GPipe all of them, Interleaved1F1B the stage chunks
    of torch's own warm-up (`_get_warmup_ops`) in units of the rank's v stages (the dry run of
    proxy_1b's last Interleaved1F1B rank: 0.985 with it, 1.66 with pp everywhere)."""
    from torch.distributed.pipelining.schedules import _get_warmup_ops

    from trainer.planning.memory import _in_flight

    def depths(schedule: str, v: int, m: int) -> list[float]:
        return [_in_flight(PipelinePlan(4, schedule, v, m), r) for r in range(4)]

    assert depths("1F1B", 1, 8) == [4, 3, 2, 1]
    assert depths("GPipe", 1, 8) == [8] * 4
    for m in (4, 8, 12):
        torch_chunks = [_get_warmup_ops(r, 2, m // max(1, m // 4), 4, m) for r in range(4)]
        assert depths("Interleaved1F1B", 2, m) == [c / 2 for c in torch_chunks], m
    assert depths("Interleaved1F1B", 2, 4) == [4, 4, 3, 2]


def test_late_backward_without_pp_holds_the_fsdp_root_and_the_output_logits():
    """Without pp the first blocks' backward runs with nearly every sharded gradient, one block's
    activations and its FSDP buffers, the logits the step keeps through backward (compute dtype, per
    head use), and under FSDP the root's unsharded embedding and head and their unsharded gradients
    (compute dtype; the root is not resharded after forward): the 671B FSDP 256 dry run's peak."""
    from trainer.planning.activation_memory import layer_activation_bytes

    a = get_flavor("671B")
    est = estimate("671B", 256, 64, 1, 1, 4096, 1, "full", device_type="cpu")["gib"]
    logits = 2 * 4096 * a.vocab_size * 2  # main and MTP head, bf16
    root = 2 * 2 * a.vocab_size * a.dim * 2  # embedding and head, parameters and gradients, bf16
    block = layer_activation_bytes(a, True, 1, 1, 2, cpu_norms=True) * 4096
    assert est["late_backward"] == pytest.approx((logits + root + block) / GiB)
    late = est["grads"] + est["late_backward"] + est["fsdp_unsharded_block"]
    assert late > est["fsdp_unsharded_block"] + est["layers"] + est["logits_and_loss"]
    assert est["total"] == pytest.approx(est["params"] + est["optimizer"] + late)
    # One rank holds no FSDP root: only the logits and the block.
    alone = estimate("debugmodel", 1, 1, 1, 1, 256, 4, "none", mixed_precision="float32", device_type="cpu")["gib"]
    d = get_flavor("debugmodel")
    block = max(layer_activation_bytes(d, moe, 1, 1, 4, cpu_norms=True) for moe in (False, True)) * 1024
    assert alone["late_backward"] == pytest.approx((2 * 1024 * d.vocab_size * 4 + block) / GiB)


def test_pipeline_stages_hold_their_receive_buffers_for_every_micro_batch():
    """torch's stage allocates the receive buffers of every micro-batch up front (a stage not first:
    its inputs, a stage not last: its output gradients); 1F1B's first rank also keeps the outputs
    of its in-flight micro-batches (pp 4: 4) until their backward; the last rank's stage receives
    only inputs and sends no output to keep."""
    plan = PipelinePlan(pp=4, pp_schedule="1F1B", pp_stages_per_rank=1, pp_microbatches=8)
    layout = ("debugmodel", 2, 1, 1, 1, 256, 8, "none")
    est = estimate(*layout, mixed_precision="float32", device_type="cpu", pipeline=plan)
    residual = 256 * get_flavor("debugmodel").dim * 4  # one micro-batch row's [seq, dim] in fp32
    worst = est["gib_per_pp_rank"].index(est["gib"]["total"])
    expected = {0: 8 + 4, 1: 2 * 8 + 3, 2: 2 * 8 + 2, 3: 8}[worst]
    assert est["gib"]["pipeline_buffers"] == pytest.approx(expected * residual / GiB)
    assert estimate(*layout, mixed_precision="float32", device_type="cpu")["gib"]["pipeline_buffers"] == 0


@pytest.mark.parametrize("mode", ["none", "op", "selective", "modules"])
def test_what_the_blocks_hold_for_backward_is_the_estimators_per_mode(mode):
    """The debug model's six blocks (one dense, five MoE) as the trainer wraps them: what they hold
    after the forward (torch's MemTracker, the dry run's tracker) against the estimator's kept
    bytes per block, with its choice of the blocks ``selective`` checkpoints."""
    import dataclasses

    from torch.distributed._tools.mem_tracker import MemTracker

    from models.common.rope import precompute_freqs_cis
    from trainer.config.activation_checkpoint import CHEAP_PARTS, recompute_module_set
    from trainer.parallel.activation_checkpoint import apply_activation_checkpointing
    from trainer.planning.activation_memory import block_activation_bytes, checkpointed_blocks, layer_activation_bytes

    batch, seq = 2, 64
    a = dataclasses.replace(get_flavor("debugmodel"), max_seq_len=seq)
    torch.manual_seed(0)
    holder = torch.nn.Module()
    holder.layers = DeepSeekV3Model(a).layers
    apply_activation_checkpointing(holder, mode, selective_every=2, recompute_modules=("deepseek",))
    freqs = precompute_freqs_cis(a.qk_rope_head_dim, seq, a.rope_theta, device="cpu")
    x = torch.randn(batch, seq, a.dim)

    def forward():
        h = x.clone().requires_grad_()
        for block in holder.layers.values():
            h, _ = block(h, freqs, None)
        return h

    forward().sum().backward()  # first-call allocations
    tracker = MemTracker()
    tracker.track_external(holder)
    with tracker:
        before = tracker.get_tracker_snapshot("current")
        out = forward()
        after = tracker.get_tracker_snapshot("current")
    total = lambda snap: sum(v for stats in snap.values() for k, v in stats.items() if getattr(k, "value", k) == "Total")
    held = total(after) - total(before) - out.numel() * 4  # the last block's output is no block's input

    parts = recompute_module_set(("deepseek",)) if mode == "modules" else CHEAP_PARTS if mode == "op" else ()
    kinds = [i >= a.n_dense_layers for i in range(a.n_layers)]
    flags = checkpointed_blocks(mode, a.n_layers, a.n_layers, 2)
    assert flags == ([False] * 6 if mode == "none" else [True, False] * 3 if mode == "selective" else [True] * 6)
    per_token = [
        block_activation_bytes(a, moe, "modules" if parts else "full", parts) if checkpointed
        else layer_activation_bytes(a, moe, 1, 1, 4, cpu_norms=True)
        for moe, checkpointed in zip(kinds, flags)
    ]
    estimated = sum(per_token) * batch * seq
    assert abs(estimated - held) <= 0.1 * held, (mode, estimated / MiB, held / MiB)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_what_a_block_saves_for_backward_is_the_estimators(dtype):
    """Every tensor autograd keeps for one block's backward (saved_tensors_hooks, counted once per
    storage, parameters aside), the debug model's dense and MoE blocks in bf16 and fp32 on CPU,
    against `layer_activation_bytes`: its widths follow what the model keeps, not a guess (the
    combine's fp32 copy of every routed row, the norms' fp32 rows, SDPA's inputs)."""
    import dataclasses

    from models.common.rope import precompute_freqs_cis
    from trainer.planning.activation_memory import layer_activation_bytes

    seq, act_bytes = 64, torch.empty((), dtype=dtype).element_size()
    a = dataclasses.replace(get_flavor("debugmodel"), max_seq_len=seq)
    torch.manual_seed(0)
    freqs = precompute_freqs_cis(a.qk_rope_head_dim, seq, a.rope_theta, device="cpu")
    layers = DeepSeekV3Model(a).layers
    for i in (0, 1):  # dense, MoE
        block = layers[str(i)].to(dtype)
        x = torch.randn(1, seq, a.dim, dtype=dtype).requires_grad_()
        skip = {p.untyped_storage().data_ptr() for p in block.parameters()} | {x.untyped_storage().data_ptr()}
        kept = {}

        def pack(t):
            if t.untyped_storage().data_ptr() not in skip:
                kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            block(x, freqs, None)
        # In fp32 the first norm keeps the block's input itself, which the caller allocated.
        held = sum(kept.values()) + (a.dim * 4 * seq if act_bytes == 4 else 0)
        estimated = layer_activation_bytes(a, i >= a.n_dense_layers, 1, 1, act_bytes, cpu_norms=True) * seq
        assert abs(estimated - held) <= 0.03 * held, (i, dtype, estimated / seq, held / seq)


def test_a_shared_cache_gives_every_estimate_unchanged():
    """``EstimateCache`` (the layout planner's, one per group of layouts) computes a rank's states,
    the block figures and the pipeline's ranks once: each estimate through one shared cache, in
    any order, is the one without it, term by term and bit for bit."""
    args = get_flavor("16B")
    costs = PipelineCosts(**stage_unit_costs(args, 4096))  # the meta model built once
    dualpipev = PipelinePlan(pp=4, pp_schedule="DualPipeV", pp_microbatches=16, pp_max_deferred_weight_passes=2)
    cases = [
        ("none", {}),
        ("full", dict(pipeline=dualpipev)),
        ("modules", dict(recompute_modules=("megatron_dsv3",), pipeline=dualpipev)),
        ("selective", dict(pipeline=PipelinePlan(pp=4, pp_schedule="Interleaved1F1B", pp_microbatches=8))),
        ("full", dict(pipeline=PipelinePlan(pp=4, pp_schedule="1F1B", pp_microbatches=4), ep_as_cp=True)),
        ("op", dict(device_type="cpu", optimizer="muon", state_dtype="bfloat16", block_causal_sdpa=True)),
    ]
    cache = EstimateCache(args)
    for ac, kw in [*cases, *reversed(cases)]:
        plain = estimate("16B", 4, 2, 1, 1, 4096, 16, ac, model_args=args, stage_costs=costs, **kw)
        assert estimate("16B", 4, 2, 1, 1, 4096, 16, ac, model_args=args, stage_costs=costs, cache=cache, **kw) == plain
    assert cache.figures
    with pytest.raises(ValueError, match="another model"):
        estimate("16B", 4, 2, 1, 1, 4096, 16, "none", cache=cache)  # a fresh copy of the flavor
