"""FlashAttention-3's FP8 forward (fa3-fwd, optional): q, k and v in e4m3 with one descale per (batch, head), the
softmax probabilities quantized inside the kernel, both products accumulated in fp32, the output in bf16.

Every multiplier is a power of two, so scaling is exact and e4m3's rounding is the only one. e4m3 keeps 3 mantissa
bits whatever the scale, so a finer scale buys range only (fewer values below its smallest normal, 2^-6 of the
scale): on an H200, per head against per tensor moved the error by under 1 %, and taking the key's mean out by as
little (bench/results/2026-12-01T2134-fa3-probe.json). `FP8Heads` is what the DiT's QK-norm kernel writes directly
(`h3gen.kernels.qk_norm_rope_fp8`); `attention_fa3_fp8` quantizes bf16 inputs itself.
"""
import math
from typing import NamedTuple

import torch

from h3gen.kernels.head_amax import head_amax

FP8, FP8_MAX = torch.float8_e4m3fn, 448.0


class FP8Heads(NamedTuple):
    """q, k, v (B, L, heads, head_dim) in e4m3 and their fp32 descales (B, heads): x ~= x8 * descale."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    q_descale: torch.Tensor
    k_descale: torch.Tensor
    v_descale: torch.Tensor


def power_of_two_multiplier(amax):
    """2^n with amax * 2^n in (224, 448], e4m3's top binade, for each element of `amax` (fp32)."""
    return torch.exp2(torch.floor(torch.log2(FP8_MAX / amax.float().clamp(min=1e-30))))


def norm_bound_multiplier(weight, head_dim):
    """A multiplier for RMS-normed (and rotated) heads, from the norm's weight alone: no channel of a normed head
    exceeds sqrt(head_dim) times its weight, and a rotation mixes a pair of channels without growing the pair's
    norm. 2^-6 covers the bf16 roundings of the norm, the products and their sum (each 2^-9 at most)."""
    bound = math.sqrt(head_dim) * weight.detach().float().abs().amax() * (1 + 2 ** -6)
    return power_of_two_multiplier(bound)


def quantize_heads(x, multiplier):
    """`x` (B, L, heads, head_dim) times its (B, heads) power-of-two `multiplier` in e4m3: the product is exact in
    x's dtype, so e4m3's round-to-nearest-even is the one rounding."""
    return (x * multiplier.to(x.dtype)[:, None, :, None]).to(FP8)


def descale(multiplier, batch, heads):
    return multiplier.reciprocal().float().expand(batch, heads).contiguous()


def quantize(q, k, v) -> FP8Heads:
    """Each of q, k, v per (batch, head) from its own largest magnitude: one read for the amax, one pass to scale."""
    batch, _, heads, _ = q.shape
    multipliers = [power_of_two_multiplier(head_amax(t)) for t in (q, k, v)]
    quantized = [quantize_heads(t, m) for t, m in zip((q, k, v), multipliers)]
    return FP8Heads(*quantized, *(descale(m, batch, heads) for m in multipliers))


def attend_fp8(heads: FP8Heads):
    """(B, L, heads, head_dim) bf16 output of FlashAttention-3's e4m3 forward, softmax scale 1/sqrt(head_dim)."""
    from h3gen.kernels.attention import _fa3

    return _fa3()(heads.q, heads.k, heads.v, q_descale=heads.q_descale, k_descale=heads.k_descale,
                  v_descale=heads.v_descale)


def attend_fp8_reference(heads: FP8Heads):
    """What `attend_fp8` computes, in fp32 from the dequantized inputs (the kernel also rounds its probabilities)."""
    q, k, v = (t.float() * s[:, None, :, None] for t, s in zip(heads[:3], heads[3:]))
    out = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)))
    return out.transpose(1, 2)


def attention_fa3_fp8(q, k, v):
    """`q`, `k`, `v` (B, L, H, D) bf16 CUDA tensors -> (B, L, H, D) bf16."""
    return attend_fp8(quantize(q, k, v))
