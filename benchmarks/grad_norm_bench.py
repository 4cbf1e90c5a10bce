"""The gradient norm of a whole model: time and accuracy of the trainer's ``grad_norm`` against the
two ways it could be done per tensor.

Gradients are random, with a flavor's parameter shapes (``--model-override`` as in
step_bench.py; the default is proxy_1b cut to 4 layers, ~0.9 B parameters). Variants, each timed
over ``--repeats`` calls (median):

- ``fp64_per_tensor``: ``torch.linalg.vector_norm(g, dtype=float64)`` per gradient, the
  trainer's CPU norm before trainer/parallel/grad_norm.py;
- ``fp32_foreach``: ``torch._foreach_norm`` in fp32, one call for every gradient;
- ``grad_norm``: ``trainer.parallel.grad_norm.grad_norm`` (on CPU fp32 row norms, fp64 sum).

Error: relative to an fp64 norm of the whole gradient, computed once.

    python benchmarks/grad_norm_bench.py                          # proxy_1b, 4 layers
    python benchmarks/grad_norm_bench.py --flavor debugmodel --model-override n_layers=2
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from models.deepseek_v3 import DeepSeekV3Model, get_flavor
from trainer.diagnostics import apply_overrides
from trainer.parallel.grad_norm import grad_norm


def fp64_per_tensor(params: list[torch.Tensor]) -> torch.Tensor:
    norms = torch.stack([torch.linalg.vector_norm(p.grad, dtype=torch.float64) for p in params])
    return norms.square().sum().sqrt()


def fp32_foreach(params: list[torch.Tensor]) -> torch.Tensor:
    norms = torch.stack(torch._foreach_norm([p.grad for p in params], 2.0)).double()
    return norms.square().sum().sqrt()


VARIANTS = {"fp64_per_tensor": fp64_per_tensor, "fp32_foreach": fp32_foreach, "grad_norm": grad_norm}


def build_params(flavor: str, overrides: list[str], device: torch.device, seed: int) -> list[torch.Tensor]:
    """The model's parameters with random gradients of a gradient's typical spread (a few 1e-4)."""
    args = apply_overrides(get_flavor(flavor), overrides)
    with torch.device("meta"):
        model = DeepSeekV3Model(args)
    gen = torch.Generator(device=device).manual_seed(seed)
    params = []
    for p in model.parameters():
        q = torch.empty(p.shape, device=device)
        q.grad = torch.randn(p.shape, device=device, generator=gen).mul_(3e-4).add_(1e-5)
        params.append(q)
    return params


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flavor", default="proxy_1b")
    p.add_argument("--model-override", action="append", default=None, metavar="KEY=VALUE",
                   help="a DeepSeekV3ModelArgs field (default: n_layers=4)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    overrides = a.model_override if a.model_override is not None else ["n_layers=4"]
    device = torch.device(a.device)
    params = build_params(a.flavor, overrides, device, a.seed)
    exact = sum(p.grad.double().square().sum() for p in params).sqrt()  # one fp64 copy at a time
    n_params = sum(p.numel() for p in params)
    results = {}
    for name, fn in VARIANTS.items():
        fn(params)  # warm-up
        times = []
        for _ in range(a.repeats):
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            norm = fn(params)
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        error = abs(float(norm.double()) - float(exact)) / float(exact)
        results[name] = {"seconds": statistics.median(times), "relative_error": error}
    # JSON first (benchmarks/run_all.py reads it), then the table.
    print(json.dumps(results))
    print(f"\n{a.flavor} {overrides}: {len(params)} gradients, {n_params / 1e6:.0f} M values, "
          f"{torch.get_num_threads()} threads, {device}, median of {a.repeats} calls\n")
    print("| variant | seconds | relative error |\n|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['seconds']:.3f} | {r['relative_error']:.1e} |")


if __name__ == "__main__":
    main()
