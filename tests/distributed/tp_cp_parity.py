"""Loss / grad-norm parity of TP, CP and EP-as-CP layouts against one process (gloo, CPU, fp32).

`run_reference()` trains a small DeepSeek-V3 (dense + MoE block, MTP, document-causal mask) for
STEPS steps in this process; `train_layout(layout)`, on every rank of a gloo process group of the
layout's world size (tests/distributed/parity_worker.py runs it beside the Trainer's layouts, in
the same process group), trains the same model on the same data. Both return per-step (loss, grad_norm).

Data: GLOBAL_BATCH sequences per step. Data ranks ("dp" mesh) split the sequences; context
ranks (cp, or ep with ep_as_cp) split each sequence in head-tail chunks. The loss of each rank
is its token-sum divided by the global token count, so the losses of all ranks add up to the
single-process loss (summed over the "loss" mesh).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from models.deepseek_v3 import DeepSeekV3Model, DeepSeekV3ModelArgs
from models.moe import MoEArgs, moe_modules, update_expert_bias
from trainer.loss import IGNORE_INDEX, cross_entropy_sum

STEPS = 5
GLOBAL_BATCH = 2
SEQ_LEN = 32
VOCAB = 256
EOS = 0
MAX_NORM = 1.0

LAYOUTS = {
    # name: (world, ParallelDims kwargs)
    "tp2": (2, dict(dp_shard=1, cp=1, tp=2, ep=1, ep_as_cp=False)),
    "fsdp2_cp2": (4, dict(dp_shard=2, cp=2, tp=1, ep=1, ep_as_cp=False)),
    "ep2_as_cp": (2, dict(dp_shard=2, cp=1, tp=1, ep=2, ep_as_cp=True)),
    "fsdp2_ep2_tp2": (4, dict(dp_shard=2, cp=1, tp=2, ep=2, ep_as_cp=False)),
}


def model_args() -> DeepSeekV3ModelArgs:
    return DeepSeekV3ModelArgs(
        vocab_size=VOCAB, dim=64, inter_dim=128, moe_inter_dim=32, n_layers=2, n_dense_layers=1, n_heads=4,
        moe=MoEArgs(num_experts=4, num_shared_experts=1, top_k=2, score_func="sigmoid", route_norm=True,
                    num_expert_groups=2, num_limited_groups=1, load_balance_coeff=1e-3,
                    seq_aux_loss_alpha=0.0),
        q_lora_rank=16, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        max_seq_len=SEQ_LEN, mtp_depth=1, attn_mask_type="block_causal", eos_id=EOS,
    )


def build_model() -> DeepSeekV3Model:
    torch.manual_seed(0)
    model = DeepSeekV3Model(model_args())
    model.init_weights()
    model.train()
    return model


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    seq = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ_LEN + 1), generator=g)
    seq[seq < 12] = EOS  # ~5% document ends
    labels = seq[:, 1:].clone()
    labels[:, -3:] = IGNORE_INDEX  # some ignored targets
    return seq[:, :-1], labels


def shifted(labels: torch.Tensor, k: int) -> torch.Tensor:
    """MTP depth k targets on the full sequence: labels[i + k + 1], IGNORE past the end."""
    out = torch.full_like(labels, IGNORE_INDEX)
    out[:, : labels.shape[1] - k - 1] = labels[:, k + 1 :]
    return out


def _optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, foreach=False)


def _objective(out, labels, mtp_labels, n_valid, n_valid_mtp):
    loss = cross_entropy_sum(out.logits, labels) / n_valid
    mtp = sum(cross_entropy_sum(lg, t) for lg, t in zip(out.mtp_logits, mtp_labels)) / n_valid_mtp
    return loss, loss + 0.3 * mtp + out.aux_loss


def run_reference() -> list[tuple[float, float]]:
    # Runs in the pytest process: one thread like the workers, and the caller's count restored
    # afterwards (later in-process runs compare against subprocesses started with the default).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _reference_history()
    finally:
        torch.set_num_threads(threads)


def _reference_history() -> list[tuple[float, float]]:
    model = build_model()
    opt = _optimizer(model)
    history = []
    for step in range(STEPS):
        tokens, labels = batch(step)
        mtp_labels = [shifted(labels, 0)]
        n_valid, n_valid_mtp = (labels != IGNORE_INDEX).sum(), (mtp_labels[0] != IGNORE_INDEX).sum()
        out = model(tokens, labels=labels)
        loss, objective = _objective(out, labels, mtp_labels, n_valid, n_valid_mtp)
        objective.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        update_expert_bias(moe_modules(model))
        opt.step()
        opt.zero_grad()
        history.append((loss.item(), norm.item()))
    return history


def train_layout(layout: str) -> list[tuple[float, float]]:
    """Every rank of the default process group (of the layout's world size) trains the layout."""
    from torch.distributed.tensor import DTensor

    from trainer.config import ActivationCheckpoint, Engram, Parallelism, Quantize, Training
    from trainer.parallel.grad_norm import clip_grad_norm_
    from trainer.parallel.parallel_dims import ParallelDims
    from trainer.parallel.parallelize import parallelize_stage
    from trainer.parallel.tensor_parallel import maybe_loss_parallel, replicate_partial_grads

    world, kwargs = LAYOUTS[layout]
    if dist.get_world_size() != world:
        raise ValueError(f"layout {layout} needs {world} ranks, not {dist.get_world_size()}")
    dims = ParallelDims(dp_replicate=1, world_size=world, **kwargs)
    dims.build_meshes("cpu")
    model = build_model()
    # The trainer's house order (TP -> EP -> CP -> FSDP here), on the materialized model.
    stage = parallelize_stage(
        model, dims, Parallelism(), Training(mixed_precision_param="float32"), ActivationCheckpoint(), Quantize(),
        Engram(), "cpu",
    )
    cp = stage.context_parallel
    opt = _optimizer(model)
    loss_group = dims.mesh("loss").get_group() if dims.has_mesh("loss") else None
    dp_rank, dp_size = dims.dp_rank_and_degree() if dims.has_mesh("dp") else (0, 1)

    def reduce_counts(counts):
        if loss_group is not None:
            dist.all_reduce(counts, group=loss_group)
        return counts

    history = []
    for step in range(STEPS):
        tokens, labels = batch(step)
        mtp_labels = [shifted(labels, 0)]
        n_valid, n_valid_mtp = (labels != IGNORE_INDEX).sum(), (mtp_labels[0] != IGNORE_INDEX).sum()
        per_dp = GLOBAL_BATCH // dp_size
        rows = slice(dp_rank * per_dp, (dp_rank + 1) * per_dp)
        tokens, labels = tokens[rows], labels[rows]
        if cp is not None:
            b = cp.shard_batch(tokens, labels)
            out = model(b.tokens, labels=b.labels, positions=b.positions, attn_mask=b.attn_mask)
            labels, mtp_labels = b.labels, b.mtp_labels
        else:
            out = model(tokens, labels=labels)
            mtp_labels = [shifted(labels, 0)]
        with maybe_loss_parallel(dims.tp_enabled):
            loss, objective = _objective(out, labels, mtp_labels, n_valid, n_valid_mtp)
            objective.backward()
        if isinstance(loss, DTensor):
            loss = loss.full_tensor()
        replicate_partial_grads(model.parameters())
        norm = clip_grad_norm_(list(model.parameters()), MAX_NORM)
        update_expert_bias(moe_modules(model), reduce_counts)
        opt.step()
        opt.zero_grad()
        loss = loss.detach().clone()
        if loss_group is not None:
            dist.all_reduce(loss, group=loss_group)
        history.append((loss.item(), norm.item()))
    return history
