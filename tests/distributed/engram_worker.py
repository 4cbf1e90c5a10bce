"""Worker of tests/distributed/test_engram_parallel.py: one gloo rank of a sharded-Engram run.

Every rank also builds the unsharded reference (one process, full tables, the tokens of ALL
ranks as one batch) and compares its own slice of the results with it.
"""

import dataclasses
import os

import torch
import torch.distributed as dist

from models.deepseek_v3 import DeepSeekV3Model, get_flavor
from models.engram import EngramArgs, NgramHasher, TokenCompression, engram_modules
from trainer.loss import cross_entropy_sum

VOCAB, B, S = 32, 2, 16
ENGRAM = EngramArgs(layer_ids=(0, 1), max_ngram=3, heads_per_order=2, base_size=29, head_dim=4, seed=5)


def build_model() -> DeepSeekV3Model:
    args = dataclasses.replace(
        get_flavor("debugmodel"), n_layers=2, dim=32, inter_dim=64, moe_inter_dim=16, n_heads=2,
        kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, max_seq_len=S,
        mtp_depth=0, vocab_size=VOCAB, eos_id=1, engram=ENGRAM,
    )
    torch.manual_seed(0)
    model = DeepSeekV3Model(args)
    model.init_weights()
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


def run(rank: int, world: int, port: int, precompute: bool, queue) -> None:
    from trainer.parallel.engram_parallel import (
        OffloadedAdam,
        apply_engram_parallel,
        shard_rows,
        table_grad_sq_norm,
    )

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        group = dist.new_group(list(range(world)))  # a 1-D group of its own, like a mesh dim
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
        sq = float(table_grad_sq_norm(model, group))
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

        queue.put((rank, {"forward_a2a": fwd.calls, "backward_a2a": bwd.calls}))
    except Exception as e:  # report to the parent instead of hanging it
        queue.put((rank, f"{type(e).__name__}: {e}"))
        raise
    finally:
        dist.destroy_process_group()


def reference_table(num_rows: int, head_dim: int, layer: int) -> torch.Tensor:
    """Distinct, non-initial values for checkpoint tests: row r, column c -> r + c / 10 + layer * 1000."""
    return torch.arange(num_rows).unsqueeze(1) + torch.arange(head_dim) / 10 + layer * 1000.0


def run_checkpoint(rank: int, world: int, port: int, mode: str, ckpt_dir: str, queue) -> None:
    """mode "save": tables set to `reference_table`, sharded over `world`, DCP-saved.
    mode "load": a fresh model sharded over `world` loads that checkpoint; rows must match."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    from trainer.parallel.engram_parallel import apply_engram_parallel

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("engram",))
        model = build_model()
        if mode == "save":
            with torch.no_grad():
                for m in engram_modules(model):
                    m.table.weight.copy_(reference_table(m.table.num_rows, m.table.head_dim, m.layer_id))
                model.norm.weight.fill_(3.0)
        apply_engram_parallel(model, mesh)
        if mode == "save":
            dcp.save(model.state_dict(), checkpoint_id=ckpt_dir)
        else:
            state = model.state_dict()
            dcp.load(state, checkpoint_id=ckpt_dir)
            model.load_state_dict(state)
            assert torch.all(model.norm.weight == 3.0)
            for m in engram_modules(model):
                full = reference_table(m.table.num_rows, m.table.head_dim, m.layer_id)
                start, n = m.table.row_start, m.table.weight.shape[0]
                torch.testing.assert_close(m.table.weight.detach(), full[start : start + n], rtol=0, atol=0)
        queue.put((rank, {"ok": True}))
    except Exception as e:
        queue.put((rank, f"{type(e).__name__}: {e}"))
        raise
    finally:
        dist.destroy_process_group()
