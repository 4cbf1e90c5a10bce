"""Rotary position embedding with YaRN context extension, in DeepSeek's interleaved convention.

DeepSeek rotates *adjacent pairs* `(x0, x1), (x2, x3), ...` of the rope sub-vector (its reference
code views them as complex numbers). HF `transformers` DeepseekV3 with `rope_interleave=True` rotates
the same pairs and then writes them out de-interleaved (`[evens, odds]`); because q and k go through
the same permutation, the q.k scores are identical, so DeepSeek/HF checkpoints need NO weight
permutation with this module.

The table is real-valued (cos and sin, fp32) rather than complex: complex buffers are awkward under
DTensor sharding and `torch.compile`, and a real table keeps `model.to(dtype)` from silently
changing the rotation precision of the fp32 math in `apply_rotary_emb`.
"""

import math

import torch

# "default": plain RoPE; "yarn": YaRN (DeepSeek-V2/V3's released weights). Names as in HF `rope_type`.
ROPE_TYPES = ("default", "yarn")


def _find_correction_dim(num_rotations: float, dim: int, base: float, max_seq_len: int) -> float:
    """The (fractional) rope dim index whose wavelength makes `num_rotations` turns over
    `max_seq_len` positions (YaRN paper, eq. 17)."""
    return dim * math.log(max_seq_len / (num_rotations * 2 * math.pi)) / (2 * math.log(base))


def _find_correction_range(
    beta_fast: float, beta_slow: float, dim: int, base: float, max_seq_len: int
) -> tuple[int, int]:
    low = math.floor(_find_correction_dim(beta_fast, dim, base, max_seq_len))
    high = math.ceil(_find_correction_dim(beta_slow, dim, base, max_seq_len))
    return max(low, 0), min(high, dim - 1)


def _linear_ramp(low: float, high: float, n: int) -> torch.Tensor:
    if low == high:
        high += 0.001  # avoid a division by zero, as DeepSeek's reference does
    return ((torch.arange(n, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)


def yarn_mscale(rope_factor: float, mscale: float) -> float:
    """YaRN attention temperature `0.1 * mscale * ln(factor) + 1` (1 when not extending)."""
    if rope_factor <= 1:
        return 1.0
    return 0.1 * mscale * math.log(rope_factor) + 1.0


def yarn_softmax_factor(rope_factor: float, mscale_all_dim: float) -> float:
    """Multiplier of the plain softmax scale `qk_head_dim ** -0.5` under YaRN:
    `yarn_mscale(factor, mscale_all_dim) ** 2`, or 1 when `mscale_all_dim` is 0 (absent).

    The rule of DeepSeek's reference `MLA.__init__` and of `transformers`' DeepseekV2/V3
    attention (`yarn_get_mscale(factor, mscale_all_dim) ** 2`). DeepSeek-V3: factor 40,
    mscale_all_dim 1.0 -> 1.8739, so the scale is 0.13523 for qk_head_dim 192 (not 0.07217).
    """
    if not mscale_all_dim:
        return 1.0
    return yarn_mscale(rope_factor, mscale_all_dim) ** 2


def yarn_rope_attention_factor(rope_factor: float, mscale: float, mscale_all_dim: float) -> float:
    """Multiplier of the rope cos/sin table under YaRN, `transformers`' `attention_factor` rule
    (`_compute_yarn_parameters`): `yarn_mscale(f, mscale) / yarn_mscale(f, mscale_all_dim)` when both
    are set, else `yarn_mscale(f, 1)`. 1 for every DeepSeek release (mscale == mscale_all_dim), whose
    whole temperature correction is in the softmax scale (`yarn_softmax_factor`) instead.
    """
    if mscale and mscale_all_dim:
        return yarn_mscale(rope_factor, mscale) / yarn_mscale(rope_factor, mscale_all_dim)
    return yarn_mscale(rope_factor, 1.0)


def precompute_freqs_cis(
    rope_dim: int,
    max_seq_len: int,
    rope_theta: float,
    rope_factor: float = 1.0,
    original_seq_len: int = 4096,
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
    attention_factor: float = 1.0,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Rotation table of shape `(max_seq_len, rope_dim)`: `cat(cos, sin)` over the last dim, each
    half `rope_dim // 2` wide (one angle per rotated pair), fp32, both scaled by `attention_factor`.

    `rope_factor != 1` applies YaRN's frequency correction (DeepSeek's reference
    `precompute_freqs_cis`, `transformers`' `_compute_yarn_parameters` with `truncate=True`): dims
    that rotate fewer than `beta_slow` times over `original_seq_len` positions are interpolated by
    `rope_factor`, those above `beta_fast` rotations are kept, with a linear ramp in between.
    The correction is a property of the model, so it is applied whatever `max_seq_len` (the table
    length) is: a model trained with YaRN computes the same function on a short sequence.
    The softmax-scale correction lives in the attention module (`yarn_softmax_factor`).
    """
    freqs = 1.0 / (rope_theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32, device=device) / rope_dim))
    if rope_factor != 1.0:
        low, high = _find_correction_range(beta_fast, beta_slow, rope_dim, rope_theta, original_seq_len)
        smooth = 1 - _linear_ramp(low, high, rope_dim // 2).to(freqs.device)
        freqs = freqs / rope_factor * (1 - smooth) + freqs * smooth
    positions = torch.arange(max_seq_len, dtype=torch.float32, device=device)
    angles = torch.outer(positions, freqs)  # (max_seq_len, rope_dim // 2)
    table = torch.cat([angles.cos(), angles.sin()], dim=-1)
    return table * attention_factor if attention_factor != 1.0 else table


def apply_rotary_emb(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs of the last dim of `x` (`[B, S, H, rope_dim]`) by the angles of
    `freqs_cis` (`[S, rope_dim]`, from `precompute_freqs_cis`). Math in fp32, result in x's dtype."""
    cos, sin = freqs_cis.float().chunk(2, dim=-1)  # each (S, rope_dim // 2)
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]  # (1, S, 1, rope_dim // 2)
    pairs = x.float().unflatten(-1, (-1, 2))  # (B, S, H, rope_dim // 2, 2)
    x_even, x_odd = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack([x_even * cos - x_odd * sin, x_even * sin + x_odd * cos], dim=-1)
    return rotated.flatten(-2).type_as(x)  # (B, S, H, rope_dim), interleaved again
