"""Which kernels this CPU's torch takes, seen through their bits (docs/numerics.md).

    python benchmarks/kernel_bits.py
    MKL_ENABLE_INSTRUCTIONS=SSE4_2 ATEN_CPU_CAPABILITY=default python benchmarks/kernel_bits.py

Prints one line for the process's settings:
- ATen's CPU capability, and a digest of one fp32 GEMM's bits (257 x 129 x 263): another digest
  under other settings means other kernels;
- whether a plain contiguous `torch.bmm` gives a small matrix the same bits at every position of
  its batch (`6 x 7 x 9` by its transpose): MKL's AVX2 GEMM does not, as the output of a matrix at
  an odd position starts off a 16-byte boundary;
- whether `trainer.optim.muon.batched_newton_schulz`, which lays its intermediates 64 bytes apart, does.
One thread, as run_train.sh runs on CPU. Not a timing: a numerics probe.
"""

from __future__ import annotations

import hashlib

import torch

from trainer.optim.muon import batched_newton_schulz


def _same_at_every_position(fn, stack: torch.Tensor) -> bool:
    """Whether `fn` of each matrix alone (a fresh, aligned batch of one) equals its slice of `fn`
    of the whole stack."""
    whole = fn(stack)
    return all(torch.equal(fn(stack[i : i + 1].clone())[0], whole[i]) for i in range(stack.shape[0]))


def main() -> None:
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(257, 129, generator=gen), torch.randn(129, 263, generator=gen)
    digest = hashlib.sha256(torch.mm(a, b).numpy().tobytes()).hexdigest()[:12]
    stack = torch.randn(6, 7, 9, generator=gen)
    gram = _same_at_every_position(lambda s: torch.bmm(s, s.mT), stack)
    ns = _same_at_every_position(lambda s: batched_newton_schulz(s, 5, torch.float32), stack)
    print(f"ATen {torch.backends.cpu.get_cpu_capability()} | fp32 GEMM bits {digest} | "
          f"contiguous bmm position-independent: {gram} | batched_newton_schulz position-independent: {ns}")


if __name__ == "__main__":
    main()
