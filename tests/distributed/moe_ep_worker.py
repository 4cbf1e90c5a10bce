"""Worker of tests/distributed/test_moe_ep.py: one gloo rank of a 2-layer expert-parallel MoE.

Every rank also runs the single-process MoE stack on its own tokens and compares outputs, input
gradients and router/shared gradients with it; the routed experts' gradients are compared with
the reference gradients summed over ranks (each rank's tokens reach every rank's experts).
Host reads of device values are counted during the expert-parallel forward and backward.
"""

import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from models.deepseek_v3 import DeepSeekV3ModelArgs
from models.moe import MoE
from trainer.diagnostics import HostReadCounter, init_local_gloo
from trainer.distributed import local_tensor

N_LAYERS, B, S = 2, 2, 16


def build_layers() -> nn.ModuleList:
    args = DeepSeekV3ModelArgs()
    torch.manual_seed(0)
    layers = nn.ModuleList(MoE(args.dim, args.moe_inter_dim, args.moe) for _ in range(N_LAYERS))
    for layer in layers:
        layer.init_weights(init_std=0.02)
    return layers.train()


def forward_backward(layers: nn.ModuleList, x: torch.Tensor, grad_out: torch.Tensor):
    x = x.clone().requires_grad_()
    h = x
    for layer in layers:
        h = h + layer(h)[0]
    (h * grad_out).sum().backward()
    return h.detach(), x.grad


def run(rank: int, world: int, port: int, queue) -> None:
    from trainer.parallel.expert_parallel import apply_expert_parallel

    torch.set_num_threads(1)
    init_local_gloo(rank, world, port)
    try:
        reference = build_layers()
        layers = copy.deepcopy(reference)
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
        apply_expert_parallel(layers, mesh)

        g = torch.Generator().manual_seed(10 + rank)
        dim = reference[0].gate.weight.shape[1]
        x, grad_out = torch.randn(B, S, dim, generator=g), torch.randn(B, S, dim, generator=g)
        with HostReadCounter("cpu") as counter:
            out, dx = forward_backward(layers, x, grad_out)
        ref_out, ref_dx = forward_backward(reference, x, grad_out)
        tight = {"rtol": 1e-5, "atol": 1e-6}
        torch.testing.assert_close(out, ref_out, **tight)
        torch.testing.assert_close(dx, ref_dx, **tight)

        ref_params = dict(reference.named_parameters())
        for name, param in layers.named_parameters():
            expected = ref_params[name].grad
            if ".experts." in name:
                dist.all_reduce(expected)
                per_rank = expected.shape[0] // world
                expected = expected[rank * per_rank : (rank + 1) * per_rank]
            torch.testing.assert_close(local_tensor(param.grad), expected, **tight, msg=name)
        queue.put((rank, {"reads": counter.reads}))
    except Exception as exc:  # reported to the parent test, which fails with it
        queue.put((rank, f"{type(exc).__name__}: {exc}"))
    finally:
        dist.destroy_process_group()
