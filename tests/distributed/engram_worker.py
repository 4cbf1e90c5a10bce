"""Worker of tests/distributed/test_engram_parallel.py: one gloo rank of a sharded-Engram run.

Every rank also builds the unsharded reference (one process, full tables, the tokens of ALL
ranks as one batch) and compares its own slice of the results with it; `check_context_parallel`
does the same for a context-parallel split of those sequences.
"""

import dataclasses

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from models.deepseek_v3 import DeepSeekV3Model, get_flavor
from models.engram import EngramArgs, EngramTable, NgramHasher, TokenCompression, engram_modules
from trainer.diagnostics import init_local_gloo
from trainer.loss import cross_entropy_sum
from trainer.parallel.weight_init import global_name

VOCAB, B, S = 32, 2, 16
ENGRAM = EngramArgs(layer_ids=(0, 1), max_ngram=3, heads_per_order=2, base_size=29, head_dim=4, seed=5)


def build_model(engram: EngramArgs = ENGRAM, conv_std: float = 0.0) -> DeepSeekV3Model:
    """conv_std > 0: a random short conv instead of the zero init, so that it mixes positions."""
    args = dataclasses.replace(
        get_flavor("debugmodel"), n_layers=2, dim=32, inter_dim=64, moe_inter_dim=16, n_heads=2,
        kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, max_seq_len=S,
        mtp_depth=0, vocab_size=VOCAB, eos_id=1, engram=engram,
    )
    torch.manual_seed(0)
    model = DeepSeekV3Model(args)
    model.init_weights()
    if conv_std > 0:
        with torch.no_grad():
            for m in engram_modules(model):
                m.conv.weight.normal_(0.0, conv_std)
    return model


def build_hasher() -> NgramHasher:
    comp = TokenCompression(lookup=torch.arange(VOCAB) % 20, num_compressed=20, pad_id=0)
    return NgramHasher(ENGRAM, comp)


def rank_tokens(rank: int) -> torch.Tensor:
    # Small vocab: many repeated n-grams within and across ranks; the first 5 positions are
    # the same on every rank, so several ranks ask the same owner for the same rows.
    g = torch.Generator().manual_seed(100 + rank)
    tokens = torch.randint(0, 12, (B, S), generator=g)
    tokens[:, :5] = torch.tensor([3, 4, 5, 3, 4])
    return tokens


class CountA2A:
    """Counts torch.distributed.all_to_all_single calls (the lookup's collectives)."""

    def __init__(self):
        self.calls = 0
        self.original = dist.all_to_all_single

    def __enter__(self):
        def counted(*args, **kwargs):
            self.calls += 1
            return self.original(*args, **kwargs)

        dist.all_to_all_single = counted
        return self

    def __exit__(self, *exc):
        dist.all_to_all_single = self.original


def run(rank: int, world: int, port: int, modes: tuple[bool, ...], queue) -> None:
    """`check_sharded` with precompute on and/or off (`modes`), in one process group; puts
    {precompute: the all-to-all counts}."""
    torch.set_num_threads(1)
    init_local_gloo(rank, world, port)
    try:
        group = dist.new_group(list(range(world)))  # a 1-D group of its own, like a mesh dim
        queue.put((rank, {precompute: check_sharded(rank, world, group, precompute) for precompute in modes}))
    except Exception as e:  # report to the parent instead of hanging it
        queue.put((rank, f"{type(e).__name__}: {e}"))
        raise
    finally:
        dist.destroy_process_group()


def check_sharded(rank: int, world: int, group, precompute: bool) -> dict[str, int]:
    from trainer.optim.engram import OffloadedAdam
    from trainer.parallel.engram_parallel import apply_engram_parallel, shard_rows
    from trainer.parallel.grad_norm import grad_norm

    hasher = build_hasher()

    # Identical primes, multipliers and compression on every rank.
    mine = torch.cat([hasher.primes.flatten(), hasher.multipliers.flatten(), hasher.compress])
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine)
    assert all(torch.equal(g, mine) for g in gathered), "hash constants differ across ranks"

    all_tokens = torch.cat([rank_tokens(r) for r in range(world)])
    labels_all = torch.roll(all_tokens, -1, dims=1)
    n_global = labels_all.numel()

    # Reference: unsharded, all ranks' tokens in one batch.
    ref = build_model()
    out_ref = ref(all_tokens, engram_ids=hasher(all_tokens))
    (cross_entropy_sum(out_ref.logits, labels_all) / n_global).backward()
    ref_tables = [m.table.weight for m in engram_modules(ref)]
    ref_sq = sum(float(p.grad.pow(2).sum()) for p in ref_tables)
    torch.optim.Adam(ref_tables, lr=1e-2).step()

    # Sharded: this rank's tokens only; tables split over the group.
    model = build_model()
    apply_engram_parallel(model, group, precompute=precompute)
    tokens = rank_tokens(rank)
    labels = torch.roll(tokens, -1, dims=1)
    with CountA2A() as fwd:
        out = model(tokens, engram_ids=hasher(tokens))
    loss = cross_entropy_sum(out.logits, labels) / n_global
    with CountA2A() as bwd:
        loss.backward()

    rows = slice(rank * B, (rank + 1) * B)
    torch.testing.assert_close(out.logits, out_ref.logits[rows], rtol=1e-5, atol=1e-6)
    tables = [m.table.weight for m in engram_modules(model)]
    shard_ranges = []
    for p, m in zip(tables, engram_modules(model)):
        _, start, n = shard_rows(m.table.num_rows, world, rank)
        assert (m.table.row_start, p.shape[0]) == (start, n)
        shard_ranges.append((start, n))
    for p, (start, n), m_ref in zip(tables, shard_ranges, engram_modules(ref)):
        torch.testing.assert_close(p.grad, m_ref.table.weight.grad[start : start + n], rtol=1e-5, atol=1e-7)
    sq = float(grad_norm(tables, row_sharded=tables, row_group=group)) ** 2
    assert abs(sq - ref_sq) <= 1e-5 * ref_sq, (sq, ref_sq)

    # One optimizer step on the shards equals the unsharded step, also with CPU-held state.
    shard_copies = [p.detach().clone() for p in tables]
    torch.optim.Adam(tables, lr=1e-2).step()
    for p, (start, n), p_ref in zip(tables, shard_ranges, ref_tables):
        torch.testing.assert_close(p, p_ref[start : start + n], rtol=1e-6, atol=1e-7)
    offloaded = [torch.nn.Parameter(c) for c in shard_copies]
    for q, p in zip(offloaded, tables):
        q.grad = p.grad.clone()
    OffloadedAdam(offloaded, lr=1e-2, betas=(0.9, 0.999), weight_decay=0.0).step()
    for q, p in zip(offloaded, tables):
        torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-7)

    if precompute:  # once per world size
        # The rows' all-to-all is left in flight when the lookup returns (the blocks before
        # the first Engram layer can run meanwhile) and is waited on by the first read.
        pending_rows = model.engram_lookup([m.table for m in engram_modules(model)], hasher(tokens))
        assert pending_rows.pending, "the rows' all-to-all was waited on before any layer read them"
        assert pending_rows[0].shape[:2] == tokens.shape and not pending_rows.pending
        check_context_parallel(rank, world, group, hasher, all_tokens, labels_all)
    return {"forward_a2a": fwd.calls, "backward_a2a": bwd.calls}


def check_context_parallel(rank, world, group, hasher, tokens, labels) -> None:
    """Context parallelism over the same ranks, with the tables also split over them: the
    sequences of ALL ranks, cut head-tail into 2 x world chunks, against the unsplit model.

    Kernel 2 (left context (2-1) x 3 = 3 positions) with S = 16: chunks of 8 and 4 (world 1, 2)
    take the context from one chunk, chunks of 2 (world 4) from two. The conv is random, so a
    missing or misplaced left context, or ids hashed after the split, change the logits."""
    from torch.distributed.device_mesh import init_device_mesh

    from trainer.parallel.context_parallel import apply_context_parallel, load_balanced_positions
    from trainer.parallel.engram_parallel import apply_engram_parallel

    engram = dataclasses.replace(ENGRAM, kernel_size=2)
    n_global = labels.numel()
    ref = build_model(engram, conv_std=0.5)
    out_ref = ref(tokens, engram_ids=hasher(tokens))
    (cross_entropy_sum(out_ref.logits, labels) / n_global).backward()

    model = build_model(engram, conv_std=0.5)
    apply_engram_parallel(model, group)
    cp = apply_context_parallel(model, init_device_mesh("cpu", (world,), mesh_dim_names=("cp",)))
    full_ids = hasher(tokens)
    b = cp.shard_batch(tokens, labels, full_ids)  # hashed before the split, as the trainer does
    q_pos = load_balanced_positions(S, world, rank)
    assert torch.equal(b.engram_ids, full_ids[:, q_pos])
    if world > 1:  # hashing the shard itself would be wrong at the chunk starts
        assert not torch.equal(b.engram_ids, hasher(b.tokens))
    out = model(b.tokens, positions=b.positions, attn_mask=b.attn_mask, engram_ids=b.engram_ids)
    (cross_entropy_sum(out.logits, b.labels) / n_global).backward()
    torch.testing.assert_close(out.logits, out_ref.logits[:, q_pos], rtol=1e-5, atol=1e-6)

    tables = {id(m.table.weight): m for m in engram_modules(model)}
    for (name, p), p_ref in zip(model.named_parameters(), ref.parameters()):
        if id(p) in tables:  # this rank's rows, already summed over the ranks by the lookup
            start = tables[id(p)].table.row_start
            expected = p_ref.grad[start : start + p.shape[0]]
            grad = p.grad
        else:  # replicated weight: each rank holds its tokens' part of the gradient
            expected, grad = p_ref.grad, p.grad.clone()
            dist.all_reduce(grad, group=group)
        torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


class _NoData:
    """The checkpointer's data-loader slot (batches here are a function of the step)."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def global_batch(step: int) -> torch.Tensor:
    """The step's 4 sequences, the same whatever the layout (each rank trains on its slice)."""
    tokens = torch.randint(0, 12, (4, S), generator=torch.Generator().manual_seed(1000 + step))
    tokens[:, :5] = torch.tensor([3, 4, 5, 3, 4])  # shared n-grams: ranks ask the same owners
    return tokens


@torch.no_grad()
def load_full_state_dict(model: nn.Module, full: dict[str, torch.Tensor]) -> None:
    """Copies single-device tensors (``full[name]``) into the parallel model in place: each
    DTensor (routed experts under EP included) gets its shard. Parameter identity is kept."""
    tensors = dict(model.named_parameters())
    tensors.update(dict(model.named_buffers()))
    table_rows = {  # Engram tables may hold a row range only: [start, stop) global rows held here
        global_name(f"{name}.weight"): (m.row_start, m.row_start + m.weight.shape[0])
        for name, m in model.named_modules()
        if isinstance(m, EngramTable)
    }
    for raw_name, tensor in tensors.items():
        name = global_name(raw_name)
        if name not in full:
            continue
        src = full[name]
        if name in table_rows:
            src = src[slice(*table_rows[name])]
        if isinstance(tensor, DTensor):
            local = distribute_tensor(src.to(tensor.device), tensor.device_mesh, tensor.placements).to_local()
            tensor.to_local().copy_(local)
        else:
            tensor.copy_(src)


def run_checkpoint(
    rank: int, world: int, port: int, phases: list[tuple[int, str, bool]], ckpt_dir: str, queue
) -> None:
    """`checkpoint_phase` for each (degree, mode, offload) of `phases`, one after the other in
    one process group (a save and a resume at the same world size share a launch)."""
    torch.set_num_threads(1)
    init_local_gloo(rank, world, port)
    try:
        results = [checkpoint_phase(rank, world, degree, mode, ckpt_dir, offload) for degree, mode, offload in phases]
        queue.put((rank, results))
    except Exception as e:
        queue.put((rank, f"{type(e).__name__}: {e}"))
        raise
    finally:
        dist.destroy_process_group()


def checkpoint_phase(rank: int, world: int, degree: int, mode: str, ckpt_dir: str, offload: bool) -> dict:
    """Trainer path at embedding-parallel `degree` (FSDP2 over all `world` ranks, EP 2): model
    from `parallelize_model`, optimizer from `build_optimizer`, checkpoints by
    `CheckpointManager`, the step as `Trainer.train_step` does it. mode "save": 2 steps,
    checkpoint, steps 3-4. mode "load": resume from that checkpoint, steps 3-4. Reports the
    global losses of steps 3 and 4 and the table rows held."""
    from trainer.checkpoint import CheckpointManager
    from trainer.config import load_config
    from trainer.optim.build import build_optimizer
    from trainer.optim.lr_schedule import build_lr_scheduler
    from trainer.parallel.parallel_dims import ParallelDims
    from trainer.parallel.parallelize import parallelize_model

    cfg = load_config([
        "--engram.enable", "--engram.layer_ids", "0,1", "--engram.embedding_parallel_degree", str(degree),
        f"--engram.offload_optimizer_state={offload}", "--parallelism.ep", "2",
        "--optimizer.lr", "1e-2", "--lr_scheduler.warmup_steps", "1", "--optimizer.implementation", "for-loop",
        "--checkpoint.enable", "--training.mixed_precision_param", "float32",
    ])
    dims = ParallelDims.from_config(cfg.parallelism, world, cfg.engram)
    reference = build_model()
    with torch.device("meta"):
        model = DeepSeekV3Model(reference.args)
    hasher = build_hasher()
    _, parallel = parallelize_model(
        model, dims, cfg.parallelism, cfg.training, cfg.activation_checkpoint, cfg.quantize, cfg.engram, "cpu",
        hasher,
    )
    model.to_empty(device="cpu")
    model.init_weights()  # buffers (rope tables) and sharded init; then the reference weights:
    load_full_state_dict(model, reference.state_dict())  # every layout starts from the same weights
    optimizer, optimizer_hooks = build_optimizer(model, cfg.optimizer, cfg.engram)
    scheduler = build_lr_scheduler(optimizer, cfg.lr_scheduler, total_steps=4)
    checkpointer = CheckpointManager(
        cfg.checkpoint, ckpt_dir, model=model, optimizer=optimizer, lr_scheduler=scheduler,
        dataloader=_NoData(), model_args=reference.args, device=torch.device("cpu"),
    )

    def train_step(step: int) -> tuple[float, float]:
        rows = global_batch(step).chunk(world)[rank]
        labels = torch.roll(rows, -1, dims=1)
        out = model(rows, engram_ids=hasher(rows))
        loss = cross_entropy_sum(out.logits, labels) / (4 * S)
        loss.backward()
        norm = parallel.finish_grads([p for p in model.parameters() if p.grad is not None], 1.0)
        for hook in optimizer_hooks:  # the Engram tables' CPU-resident step, when offloaded
            hook.before_optimizer(skip=False)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        total = loss.detach().clone()
        dist.all_reduce(total)
        return float(total), float(norm)

    if mode == "save":
        for step in (1, 2):
            train_step(step)
        checkpointer.save(2, {"step": 2})
    else:
        assert int(checkpointer.load()["step"]) == 2
    losses, norms = zip(*[train_step(step) for step in (3, 4)])
    rows = sum(m.table.weight.shape[0] for m in engram_modules(model))
    checkpointer.close()
    return {
        "losses": losses, "grad_norms": norms, "table_rows": rows,
        "num_rows": sum(m.table.num_rows for m in engram_modules(model)),
    }
