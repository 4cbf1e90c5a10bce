"""Compiled vs eager drift in fp32: reordering noise that training amplifies, or a real difference?

    python benchmarks/compile_drift.py                      # debugmodel, 30 steps, batch 2 x 64, CPU
    python benchmarks/compile_drift.py --steps 30 --seq-len 128 --json drift.json

Three training runs of the debug model start from the same weights and see the same batches,
with the trainer's objective (cross-entropy + MTP + balance loss), gradient clipping, AdamW and
the aux-loss-free bias update, all in fp32:

* `eager`: the reference;
* `compiled`: every block compiled with inductor (`apply_compile`) and the compiled loss;
* `perturbed`: eager again, every initial weight moved by one ulp (x * (1 +- 2^-23)), the size of
  the rounding differences that a different summation order (another kernel) makes. It is the
  control: how far *any* reordering drifts under this training.

Per step it prints the loss of each run, |compiled - eager| and |perturbed - eager|, and how many
(token, expert) choices of the routers differ from eager's on that step's batch. At the probe
steps it also loads eager's weights into the compiled model and runs the same batch through
both ("identical weights and inputs"): the routing choices that differ then come from
reordering alone, and the smallest top-k margins (score gap between the k-th and (k+1)-th
expert, or between the last kept and first dropped group) say how close the routers are to a
tie. The findings are written up in docs/compile.md ("Drift over a training run").

The routing choices are read at the dispatcher boundary (`dispatch()`), which runs eagerly in
the compiled model too, so recording them does not change what is compiled.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

from models.deepseek_v3 import DeepSeekV3Model, get_flavor, mtp_loss
from models.moe import MoE
from models.moe.balance import update_expert_bias
from trainer.loss import cross_entropy_sum
from trainer.parallel.compile import apply_compile, compiled_cross_entropy_sum

MTP_LOSS_WEIGHT = 0.3  # the trainer's default `model.mtp_loss_weight`


class RoutingRecorder:
    """Wraps an MoE's dispatcher and keeps the router input and the chosen experts of the last
    forward. Both methods stay `torch.compiler.disable`d, like the dispatcher they wrap."""

    def __init__(self, inner):
        self.inner = inner
        self.tokens: torch.Tensor | None = None
        self.selected: torch.Tensor | None = None

    @torch.compiler.disable
    def dispatch(self, tokens, selected_experts, top_scores):
        self.tokens = tokens.detach().clone()
        self.selected = selected_experts.detach().sort(dim=-1).values
        return self.inner.dispatch(tokens, selected_experts, top_scores)

    @torch.compiler.disable
    def combine(self, routed_out, ctx, out_shape):
        return self.inner.combine(routed_out, ctx, out_shape)


def moes(model: torch.nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def build(args, seed: int, compiled: bool, perturb: bool = False) -> DeepSeekV3Model:
    with torch.device("meta"):
        model = DeepSeekV3Model(args)
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    model.init_weights()
    if perturb:
        g = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for p in model.parameters():
                sign = torch.randint(0, 2, p.shape, generator=g).float() * 2 - 1
                p.mul_(1 + sign * 2.0**-23)
    for moe in moes(model):
        moe.dispatcher = RoutingRecorder(moe.dispatcher)
    if compiled:
        apply_compile(model)
    return model.train()


def batches(args, n: int, batch_size: int, seq_len: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Random tokens with an EOS every 23 positions (so `block_causal` has documents to split)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        data = torch.randint(2, args.vocab_size, (batch_size, seq_len + 1), generator=g)
        data[:, 23::23] = args.eos_id
        out.append((data[:, :-1], data[:, 1:]))
    return out


def objective(model, inputs, labels, loss_fn) -> tuple[torch.Tensor, torch.Tensor]:
    out = model(inputs, labels=labels)
    loss = loss_fn(out.logits, labels) / labels.numel()
    total = loss + out.aux_loss
    if out.mtp_logits:
        mtp_sum, n_mtp = mtp_loss(out.mtp_logits, labels)
        total = total + MTP_LOSS_WEIGHT * mtp_sum / n_mtp.clamp_min(1)
    return total, loss


def selections(model) -> list[torch.Tensor]:
    return [m.dispatcher.selected for m in moes(model)]


def choice_differences(a: list[torch.Tensor], b: list[torch.Tensor]) -> list[int]:
    """Per MoE layer: (token, expert) choices in one run and not in the other (a flipped choice
    counts once: one expert in, one out)."""
    out = []
    for sa, sb in zip(a, b):
        ea = torch.zeros(sa.shape[0], int(max(sa.max(), sb.max())) + 1).scatter_(1, sa, 1.0)
        eb = torch.zeros_like(ea).scatter_(1, sb, 1.0)
        out.append(int((ea - eb).clamp_min(0).sum()))
    return out


@torch.no_grad()
def routing_margins(moe: MoE, tokens: torch.Tensor) -> torch.Tensor:
    """Per token, the smallest score gap that decides its routing (`TokenChoiceTopKRouter`'s
    rule): between the k-th and (k+1)-th biased score of its allowed experts and, with groups,
    between the last kept and the first dropped group score. [T] fp32."""
    gate = moe.gate
    scores = torch.nn.functional.linear(tokens.float(), gate.weight.float())
    scores = scores.softmax(-1) if gate.score_func == "softmax" else scores.sigmoid()
    if moe.expert_bias is not None:
        scores = scores + moe.expert_bias
    margin = torch.full(scores.shape[:1], float("inf"))
    if gate.num_limited_groups < gate.num_expert_groups:
        grouped = scores.view(scores.shape[0], gate.num_expert_groups, -1)
        group_scores = grouped.topk(2, dim=-1).values.sum(-1).sort(-1, descending=True).values
        k = gate.num_limited_groups
        margin = group_scores[:, k - 1] - group_scores[:, k]
        scores = gate._mask_unselected_groups(scores)
    top = scores.topk(gate.top_k + 1, dim=-1).values
    return torch.minimum(margin, top[:, -2] - top[:, -1])


def probe(eager, compiled, inputs, labels) -> dict:
    """Eager's weights in both models, one forward on the same batch: what reordering alone does."""
    saved_e = {k: v.clone() for k, v in eager.state_dict().items()}
    saved_c = {k: v.clone() for k, v in compiled.state_dict().items()}
    compiled.load_state_dict(saved_e)
    out_e, out_c = eager(inputs, labels=labels), compiled(inputs, labels=labels)
    diffs = choice_differences(selections(eager), selections(compiled))
    margins = torch.cat([routing_margins(m, m.dispatcher.tokens) for m in moes(eager)])
    result = {
        "choice_differences_per_layer": diffs,
        "max_logit_diff": (out_e.logits - out_c.logits).abs().max().item(),
        # Max difference of the first MoE layer's router input: the reordering noise there.
        "router_input_diff_layer0": (moes(eager)[0].dispatcher.tokens - moes(compiled)[0].dispatcher.tokens)
        .abs().max().item(),
        "min_margin": margins.min().item(),
        "margins_below_1e-6": int((margins < 1e-6).sum()),
        "margins_below_1e-4": int((margins < 1e-4).sum()),
    }
    eager.load_state_dict(saved_e)
    compiled.load_state_dict(saved_c)
    return result


def train_step(model, opt, inputs, labels, loss_fn) -> float:
    total, loss = objective(model, inputs, labels, loss_fn)
    total.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    update_expert_bias(moes(model))
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def run(steps: int = 30, batch_size: int = 2, seq_len: int = 64, lr: float = 6e-3, seed: int = 0,
        probe_steps: tuple[int, ...] = (0, 10, 20, 29), control: bool = True, log=print) -> dict:
    """The three runs side by side; returns per-step records and the probes (see the docstring)."""
    args = dataclasses.replace(get_flavor("debugmodel"), max_seq_len=seq_len, attn_mask_type="block_causal", eos_id=1)
    data = batches(args, steps + 1, batch_size, seq_len, seed + 100)
    names = ["eager", "compiled"] + (["perturbed"] if control else [])
    models = {
        "eager": build(args, seed, compiled=False),
        "compiled": build(args, seed, compiled=True),
        **({"perturbed": build(args, seed, compiled=False, perturb=True)} if control else {}),
    }
    loss_fns = {n: compiled_cross_entropy_sum() if n == "compiled" else cross_entropy_sum for n in names}
    opts = {n: torch.optim.AdamW(m.parameters(), lr=lr, weight_decay=0.1) for n, m in models.items()}
    records, probes = [], {}
    start = time.perf_counter()
    for step in range(steps):
        inputs, labels = data[step]
        if step in probe_steps:
            probes[step] = probe(models["eager"], models["compiled"], inputs, labels)
            log(f"probe step {step}: {json.dumps(probes[step])}")
        losses = {n: train_step(models[n], opts[n], inputs, labels, loss_fns[n]) for n in names}
        rec = {"step": step, **{f"loss_{n}": v for n, v in losses.items()}}
        rec["diff_compiled"] = abs(losses["compiled"] - losses["eager"])
        rec["choices_compiled"] = sum(choice_differences(selections(models["eager"]), selections(models["compiled"])))
        if control:
            rec["diff_perturbed"] = abs(losses["perturbed"] - losses["eager"])
            rec["choices_perturbed"] = sum(
                choice_differences(selections(models["eager"]), selections(models["perturbed"]))
            )
        records.append(rec)
        log(" ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in rec.items()))
    inputs, labels = data[steps]
    # The held-out loss of the final weights, through the graphs the run trained with: this model
    # gives the same logits in training mode (no dropout; training only adds router statistics),
    # and an eval-mode no-grad pass would compile a second set of graphs for this one number.
    final = {n: (cross_entropy_sum(models[n](inputs).logits.detach(), labels) / labels.numel()).item() for n in names}
    return {
        "config": {"steps": steps, "batch_size": batch_size, "seq_len": seq_len, "lr": lr, "seed": seed,
                   "torch": torch.__version__},
        "records": records,
        "probes": probes,
        "final_eval_loss": final,
        "seconds": time.perf_counter() - start,
    }


def amplifier_runs(steps: int = 30, batch_size: int = 2, seq_len: int = 64, lr: float = 6e-3, seed: int = 0,
                   log=print) -> dict[str, list[float]]:
    """Where the amplification comes from: eager vs one-ulp-perturbed eager (no compile) for the
    MoE model, the MoE model without the bias update (`load_balance_coeff=None`: only top-k
    flips are discrete), and the same shape with dense FFNs everywhere (no routing at all).
    Returns |loss diff| per step for each."""
    base = dataclasses.replace(get_flavor("debugmodel"), max_seq_len=seq_len, attn_mask_type="block_causal", eos_id=1)
    variants = {
        "moe": base,
        "moe_no_bias_update": dataclasses.replace(base, moe=dataclasses.replace(base.moe, load_balance_coeff=None)),
        "dense": dataclasses.replace(base, n_dense_layers=base.n_layers, mtp_depth=0),
    }
    out = {}
    for name, args in variants.items():
        data = batches(args, steps, batch_size, seq_len, seed + 100)
        pair = [build(args, seed, compiled=False), build(args, seed, compiled=False, perturb=True)]
        opts = [torch.optim.AdamW(m.parameters(), lr=lr, weight_decay=0.1) for m in pair]
        diffs = []
        for inputs, labels in data:
            a, b = (train_step(m, o, inputs, labels, cross_entropy_sum) for m, o in zip(pair, opts))
            diffs.append(abs(a - b))
        out[name] = diffs
        log(f"{name}: |loss diff| per step " + " ".join(f"{d:.1e}" for d in diffs))
    return out


def summary(result: dict) -> str:
    recs = result["records"]
    control = "diff_perturbed" in recs[0]

    def first(key):
        return next((r["step"] for r in recs if r[key] > 0), None)

    lines = [
        "| | compiled vs eager | perturbed (1 ulp) vs eager |",
        "|---|---|---|",
        f"| first step with a different routing choice | {first('choices_compiled')} | "
        f"{first('choices_perturbed') if control else '-'} |",
    ]
    for s in sorted({0, 4, 9, 14, 19, 24, len(recs) - 1} & set(range(len(recs)))):
        r = recs[s]
        lines.append(
            f"| step {s}: abs loss diff (choices differing) | {r['diff_compiled']:.2e} ({r['choices_compiled']}) | "
            + (f"{r['diff_perturbed']:.2e} ({r['choices_perturbed']}) |" if control else "- |")
        )
    final = result["final_eval_loss"]
    lines.append(
        f"| final eval loss diff | {abs(final['compiled'] - final['eager']):.2e} | "
        + (f"{abs(final['perturbed'] - final['eager']):.2e} |" if control else "- |")
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--lr", type=float, default=6e-3, help="AdamW lr (train_configs/debug_model.toml's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--probe-steps", type=int, nargs="*", default=[0, 10, 20, 29])
    p.add_argument("--no-control", action="store_true", help="skip the one-ulp-perturbed eager run")
    p.add_argument("--amplifier", action="store_true",
                   help="also run the eager perturbation control for MoE, MoE without bias update and dense FFNs")
    p.add_argument("--json", type=Path, default=None, help="also write the records here")
    a = p.parse_args(argv)
    result = run(a.steps, a.batch_size, a.seq_len, a.lr, a.seed, tuple(a.probe_steps), not a.no_control)
    print(json.dumps(result["final_eval_loss"]))
    print(summary(result))
    if a.amplifier:
        result["amplifier"] = amplifier_runs(a.steps, a.batch_size, a.seq_len, a.lr, a.seed)
        print("| model (eager, 1-ulp perturbed weights) | max abs loss diff, steps 0-9 | 10-19 | 20-29 |")
        print("|---|---|---|---|")
        for name, diffs in result["amplifier"].items():
            blocks = [max(diffs[i:i + 10], default=0.0) for i in range(0, len(diffs), 10)]
            print(f"| {name} | " + " | ".join(f"{b:.1e}" for b in blocks) + " |")
    if a.json:
        a.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
