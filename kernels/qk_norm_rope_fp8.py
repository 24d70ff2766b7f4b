"""q, k and v in e4m3 for FlashAttention-3's FP8 forward, in one pass over the fused projection: q and k
RMS-normed per head and rotated on their leading `rotary_dim` channels, each of q, k, v times its head's power of
two and rounded once to e4m3.

One program takes a block of (row, head) pairs, so a program moves tens of kilobytes even for the video decoder's
64-channel heads. A head is loaded as its rotary halves and the channels past them, so the rotation pairs values
already in registers instead of loading each channel's partner and norming it again.
"""
import os

import torch
import triton
import triton.language as tl

from h3gen.kernels.attention_fa3_fp8 import (FP8Heads, descale, norm_bound_multiplier, power_of_two_multiplier,
                                             quantize_heads)
from h3gen.kernels.head_amax import head_amax
from h3gen.kernels.qk_norm_rope import qk_norm_rope_reference, split_qkv
from h3gen.kernels.quantize_rows import store_fp8
from h3gen.kernels.rounding import NO_FMA, round_to


def fp8_multipliers(q_weight, k_weight, v, head_dim):
    """(B, heads) powers of two for q, k and v. q's and k's come from their norm's weight (a bound on any normed,
    rotated head), so the kernel that norms them can write e4m3 straight away; v's from its heads' largest values."""
    batch, _, heads, _ = v.shape
    bounds = [norm_bound_multiplier(w, head_dim).expand(batch, heads) for w in (q_weight, k_weight)]
    return [m.contiguous() for m in (*bounds, power_of_two_multiplier(head_amax(v)))]


def qk_norm_rope_fp8_reference(qkv, heads, q_weight, k_weight, eps, cos=None, sin=None) -> FP8Heads:
    """What `qk_norm_rope_reference` gives, each of q, k, v times its power of two and rounded to e4m3."""
    q, k, v = qk_norm_rope_reference(qkv, heads, q_weight, k_weight, eps, cos, sin)
    multipliers = fp8_multipliers(q_weight, k_weight, v, q.shape[-1])
    return FP8Heads(*(quantize_heads(t, m) for t, m in zip((q, k, v), multipliers)),
                    *(descale(m, *m.shape) for m in multipliers))


@triton.jit
def _normed_rotated(src, weight_ptr, cos_ptrs, sin_ptrs, half, rest, rest_dim, half_mask, rest_mask, eps,
                    HEAD_DIM: tl.constexpr, HALF: tl.constexpr, REST: tl.constexpr, HAS_ROPE: tl.constexpr,
                    DTYPE: tl.constexpr, EMULATE: tl.constexpr):
    """One head per pair: its first rotary half, second half and the channels past them, normed and rotated,
    each rounded where the reference's separate ops round (norm output, each product, the sum)."""
    a = tl.load(src + half[None, :], mask=half_mask, other=0.0).to(tl.float32)
    b = tl.load(src + HALF + half[None, :], mask=half_mask, other=0.0).to(tl.float32)
    c = tl.load(src + rest_dim[None, :], mask=rest_mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt((tl.sum(a * a, axis=1) + tl.sum(b * b, axis=1) + tl.sum(c * c, axis=1)) / HEAD_DIM + eps)[:, None]
    w_a = tl.load(weight_ptr + half, mask=half < HALF, other=0.0).to(tl.float32)[None, :]
    w_b = tl.load(weight_ptr + HALF + half, mask=half < HALF, other=0.0).to(tl.float32)[None, :]
    w_c = tl.load(weight_ptr + rest_dim, mask=rest < REST, other=0.0).to(tl.float32)[None, :]
    a = round_to(a * rstd * w_a, DTYPE, EMULATE)
    b = round_to(b * rstd * w_b, DTYPE, EMULATE)
    c = c * rstd * w_c
    if HAS_ROPE:
        cos_a = round_to(tl.load(cos_ptrs, mask=half_mask, other=1.0), DTYPE, EMULATE)
        sin_a = round_to(tl.load(sin_ptrs, mask=half_mask, other=0.0), DTYPE, EMULATE)
        cos_b = round_to(tl.load(cos_ptrs + HALF, mask=half_mask, other=1.0), DTYPE, EMULATE)
        sin_b = round_to(tl.load(sin_ptrs + HALF, mask=half_mask, other=0.0), DTYPE, EMULATE)
        # rotate-half: (a, b) -> (a cos - b sin, b cos + a sin)
        rotated_a = round_to(a * cos_a, DTYPE, EMULATE) + round_to(-b * sin_a, DTYPE, EMULATE)
        rotated_b = round_to(b * cos_b, DTYPE, EMULATE) + round_to(a * sin_b, DTYPE, EMULATE)
        a, b = rotated_a, rotated_b
    return a, b, c


@triton.jit
def _qk_norm_rope_fp8_kernel(qkv_ptr, q_weight_ptr, k_weight_ptr, cos_ptr, sin_ptr, q_out_ptr, k_out_ptr, v_out_ptr,
                             multiplier_ptr, rows, seq_len, heads, row_stride, inner, eps,
                             HEAD_DIM: tl.constexpr, HALF: tl.constexpr, HALF_BLOCK: tl.constexpr,
                             REST: tl.constexpr, REST_BLOCK: tl.constexpr, ROWS: tl.constexpr,
                             HEADS_BLOCK: tl.constexpr, HAS_ROPE: tl.constexpr, DTYPE: tl.constexpr,
                             EMULATE: tl.constexpr):
    pair = tl.arange(0, ROWS * HEADS_BLOCK)
    row = tl.program_id(0).to(tl.int64) * ROWS + pair // HEADS_BLOCK
    head = tl.program_id(1) * HEADS_BLOCK + pair % HEADS_BLOCK
    pair_ok = (row < rows) & (head < heads)
    pair_mask = pair_ok[:, None]
    half = tl.arange(0, HALF_BLOCK)
    rest = tl.arange(0, REST_BLOCK)
    rest_dim = 2 * HALF + rest
    src = qkv_ptr + (row * row_stride + head * HEAD_DIM)[:, None]
    dst = (row * inner + head * HEAD_DIM)[:, None]
    angle = ((row % seq_len) * (2 * HALF))[:, None] + half[None, :]
    cos_ptrs, sin_ptrs = cos_ptr + angle, sin_ptr + angle
    half_mask = pair_mask & (half < HALF)[None, :]
    rest_mask = pair_mask & (rest < REST)[None, :]
    # (B, heads) multipliers for q, k, v, stacked; the batch of a row is row // seq_len. Each is a power of two, so
    # quantize_rows' store (scale, round to DTYPE, e4m3) rounds to DTYPE exactly where the reference does.
    scale_index = (row // seq_len) * heads + head
    batch_heads = (rows // seq_len) * heads
    for part in tl.static_range(2):  # q, then k
        a, b, c = _normed_rotated(src + part * inner, q_weight_ptr if part == 0 else k_weight_ptr, cos_ptrs, sin_ptrs,
                                  half, rest, rest_dim, half_mask, rest_mask, eps, HEAD_DIM, HALF, REST, HAS_ROPE,
                                  DTYPE, EMULATE)
        out = (q_out_ptr if part == 0 else k_out_ptr) + dst
        multiplier = tl.load(multiplier_ptr + part * batch_heads + scale_index, mask=pair_ok, other=1.0)[:, None]
        store_fp8(a, multiplier, out + half[None, :], half_mask, DTYPE, EMULATE)
        store_fp8(b, multiplier, out + HALF + half[None, :], half_mask, DTYPE, EMULATE)
        store_fp8(c, multiplier, out + rest_dim[None, :], rest_mask, DTYPE, EMULATE)
    # v, only scaled
    multiplier = tl.load(multiplier_ptr + 2 * batch_heads + scale_index, mask=pair_ok, other=1.0)[:, None]
    v = src + 2 * inner
    out = v_out_ptr + dst
    store_fp8(tl.load(v + half[None, :], mask=half_mask, other=0.0).to(tl.float32), multiplier, out + half[None, :],
              half_mask, DTYPE, EMULATE)
    store_fp8(tl.load(v + HALF + half[None, :], mask=half_mask, other=0.0).to(tl.float32), multiplier,
              out + HALF + half[None, :], half_mask, DTYPE, EMULATE)
    store_fp8(tl.load(v + rest_dim[None, :], mask=rest_mask, other=0.0).to(tl.float32), multiplier,
              out + rest_dim[None, :], rest_mask, DTYPE, EMULATE)


def launch_shape(head_dim: int) -> tuple[int, int, int]:
    """(rows, heads, warps) a program, the fastest of a sweep on an H200 (bench/triton_rates.py,
    bench/results/2026-12-03T0533-triton-rates.json): the DiT's q, k, v with v's scale in 2.02 ms a block (the
    kernel that took one row a program and loaded each channel's rotary partner: 1.94 ms), the video decoder's 16
    tiles in 0.30 ms (that kernel: 0.42 ms)."""
    return (1, 32, 4) if head_dim >= 128 else (2, 32, 8)


# (rows, heads, warps) a program that the launch-shape sweeps try (bench/triton_rates.py, bench/dit_gpu_check.py)
SWEPT_LAUNCH_SHAPES = tuple((rows, heads, warps) for rows in (1, 2, 4, 8) for heads in (8, 16, 32)
                            for warps in (2, 4, 8))


def bytes_moved(qkv) -> int:
    """What one call must move: the projection read in bf16 and v once more for its scale, q, k and v written in
    e4m3."""
    return qkv.numel() * (2 + 1) + qkv.numel() // 3 * 2


def qk_norm_rope_fp8_triton(qkv, heads, q_weight, k_weight, eps, cos=None, sin=None, rows_block=None,
                            heads_block=None, num_warps=None) -> FP8Heads:
    qkv = qkv.contiguous()
    inner = qkv.shape[-1] // 3
    head_dim, seq_len = inner // heads, qkv.shape[-2]
    rows = qkv.numel() // qkv.shape[-1]
    has_rope = cos is not None
    rotary_dim = cos.shape[-1] if has_rope else 0
    cos, sin = (cos.contiguous(), sin.contiguous()) if has_rope else (q_weight, q_weight)  # never read without
    default = launch_shape(head_dim)
    rows_block, heads_block, num_warps = (rows_block or default[0], heads_block or default[1],
                                          num_warps or default[2])
    q, k, v = split_qkv(qkv, heads)
    multipliers = fp8_multipliers(q_weight, k_weight, v, head_dim)
    outputs = [qkv.new_empty(q.shape, dtype=torch.float8_e4m3fn) for _ in range(3)]
    half, rest = rotary_dim // 2, head_dim - rotary_dim
    grid = (triton.cdiv(rows, rows_block), triton.cdiv(heads, heads_block))
    _qk_norm_rope_fp8_kernel[grid](
        qkv, q_weight, k_weight, cos, sin, *outputs, torch.stack(multipliers), rows, seq_len, heads, qkv.shape[-1],
        inner, eps, HEAD_DIM=head_dim, HALF=half, HALF_BLOCK=triton.next_power_of_2(max(half, 1)), REST=rest,
        REST_BLOCK=triton.next_power_of_2(max(rest, 1)), ROWS=rows_block, HEADS_BLOCK=heads_block,
        HAS_ROPE=has_rope, DTYPE=tl.bfloat16 if qkv.dtype == torch.bfloat16 else tl.float32,
        EMULATE=os.environ.get("TRITON_INTERPRET") == "1", num_warps=num_warps, **NO_FMA)
    return FP8Heads(*outputs, *(descale(m, *m.shape) for m in multipliers))


def qk_norm_rope_fp8(qkv, heads, q_weight, k_weight, eps, cos=None, sin=None) -> FP8Heads:
    fn = qk_norm_rope_fp8_triton if qkv.is_cuda else qk_norm_rope_fp8_reference
    return fn(qkv, heads, q_weight, k_weight, eps, cos, sin)
