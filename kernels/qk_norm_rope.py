"""Per-head RMSNorm of query and key, then rotary embedding on the leading `rotary_dim` channels of each head; with
`qk_norm_rope_fp8` the same kernel writes q, k and v in e4m3 for FlashAttention-3's FP8 forward."""
import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from h3gen.kernels.attention_fa3_fp8 import (FP8, FP8Heads, descale, norm_bound_multiplier,
                                             power_of_two_multiplier, quantize_heads)
from h3gen.kernels.head_amax import head_amax
from h3gen.kernels.rounding import NO_FMA, to_fp8


def apply_rotary_reference(x, cos, sin):
    """Rotate-half over `cos.shape[-1]` leading channels; `x` (B, L, heads, head_dim), `cos`/`sin` (L, rotary_dim)."""
    rotary_dim = cos.shape[-1]
    rotary, passed = x[..., :rotary_dim], x[..., rotary_dim:]
    # diffusers rounds the angle table to the activation dtype before rotating; keep that rounding.
    cos = cos.to(x.dtype)[None, :, None, :]
    sin = sin.to(x.dtype)[None, :, None, :]
    first, second = rotary.chunk(2, dim=-1)
    rotated = torch.cat((-second, first), dim=-1)
    return torch.cat((rotary * cos + rotated * sin, passed), dim=-1)


def split_qkv(qkv, heads):
    """q, k, v views (B, L, heads, head_dim) of a projection laid out (B, L, 3 * inner)."""
    return tuple(t.unflatten(-1, (heads, -1)) for t in qkv.chunk(3, dim=-1))


def qk_norm_rope_reference(qkv, heads, q_weight, k_weight, eps, cos=None, sin=None, in_place=False, rstd=None):
    """`qkv` (B, L, 3 * heads * head_dim) -> q, k, v each (B, L, heads, head_dim); v is a view. With `in_place` the kernel writes q and k over their own part of `qkv` (all three
    are views then); the reference never does. `rstd`, (q's, k's) statistic as torch computes it
    (`kernels.norm_statistic.torch_rstd`), is for the kernel."""
    q, k, v = split_qkv(qkv, heads)
    head_dim = q.shape[-1]
    q = F.rms_norm(q, (head_dim,), q_weight, eps)
    k = F.rms_norm(k, (head_dim,), k_weight, eps)
    if cos is not None:
        q, k = apply_rotary_reference(q, cos, sin), apply_rotary_reference(k, cos, sin)
    return q, k, v


@triton.jit
def _qk_norm_rope_kernel(qkv_ptr, weight_ptr, cos_ptr, sin_ptr, rstd_ptr, out_ptr, multiplier_ptr,
                         seq_len, heads, qkv_row_stride, source_offset, out_row_stride, out_offset, eps,
                         HEAD_DIM: tl.constexpr, ROTARY_DIM: tl.constexpr, HEADS_BLOCK: tl.constexpr,
                         HAS_ROPE: tl.constexpr, HAS_RSTD: tl.constexpr, NORM: tl.constexpr = True,
                         FP8_OUT: tl.constexpr = False, EMULATE_ROUNDING: tl.constexpr = False):
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1) * HEADS_BLOCK + tl.arange(0, HEADS_BLOCK)
    dim = tl.arange(0, HEAD_DIM)
    mask = (head < heads)[:, None]
    src = qkv_ptr + row * qkv_row_stride + source_offset + head[:, None] * HEAD_DIM
    x = tl.load(src + dim[None, :], mask=mask, other=0.0).to(tl.float32)
    dtype = qkv_ptr.dtype.element_ty
    if NORM:
        if HAS_RSTD:
            rstd = tl.load(rstd_ptr + row * heads + head, mask=head < heads, other=1.0)[:, None]
        else:
            rstd = tl.rsqrt(tl.sum(x * x, axis=1) / HEAD_DIM + eps)[:, None]
        out = x * rstd * tl.load(weight_ptr + dim).to(tl.float32)[None, :]
    else:
        out = x
    if HAS_ROPE:
        # Rounded wherever the reference's separate ops round: norm output, each product, the sum.
        out = out.to(dtype).to(tl.float32)
        half: tl.constexpr = ROTARY_DIM // 2
        partner = tl.where(dim < half, dim + half, tl.where(dim < ROTARY_DIM, dim - half, dim))
        x_partner = tl.load(src + partner[None, :], mask=mask, other=0.0).to(tl.float32)
        partner_out = (x_partner * rstd * tl.load(weight_ptr + partner).to(tl.float32)[None, :]).to(dtype)
        sign = tl.where(dim < half, -1.0, 1.0)
        rotary = dim < ROTARY_DIM
        angle = (row % seq_len) * ROTARY_DIM + dim
        cos = tl.load(cos_ptr + angle, mask=rotary, other=1.0)
        sin = tl.load(sin_ptr + angle, mask=rotary, other=0.0)
        cos = cos.to(dtype).to(tl.float32)
        sin = sin.to(dtype).to(tl.float32)
        rotated = (partner_out.to(tl.float32) * (sign * sin)[None, :]).to(dtype).to(tl.float32)
        out = (out * cos[None, :]).to(dtype).to(tl.float32) + rotated
    # In place, this program overwrites only the head rows it loaded (both rotary halves) before it stores.
    dst = out_ptr + row * out_row_stride + out_offset + head[:, None] * HEAD_DIM + dim[None, :]
    if FP8_OUT:
        # The value the bf16 path stores, times its head's power of two (exact), rounded once to e4m3.
        multiplier = tl.load(multiplier_ptr + (row // seq_len) * heads + head, mask=head < heads, other=1.0)
        out = out.to(dtype).to(tl.float32) * multiplier[:, None]
        tl.store(dst, to_fp8(tl.minimum(tl.maximum(out, -448.0), 448.0), EMULATE_ROUNDING), mask=mask)
    else:
        tl.store(dst, out.to(dtype), mask=mask)


def qk_norm_rope_triton(qkv, heads, q_weight, k_weight, eps, cos=None, sin=None, in_place=False, rstd=None,
                        heads_block=8, num_warps=None):
    qkv = qkv.contiguous()
    inner = qkv.shape[-1] // 3
    head_dim = inner // heads
    seq_len = qkv.shape[-2]
    rows = qkv.numel() // qkv.shape[-1]
    # q's and k's rows sit side by side in each row of the projection.
    row_stride, offsets = qkv.shape[-1], (0, inner)
    has_rope = cos is not None
    if has_rope:
        cos, sin = cos.contiguous(), sin.contiguous()
        assert cos.shape == (seq_len, cos.shape[-1]) and cos.shape[-1] % 2 == 0
    else:
        cos = sin = q_weight  # never read
    rotary_dim = cos.shape[-1] if has_rope else 0
    # The launch shape sets the order a head's squares are summed in. 8 heads on 4 warps sums 64-channel float32 heads
    # as torch does (the video decoder relies on it); 128-channel heads give the same values on 2 warps, 16 % faster
    # (bench/dit_gpu_check.py's kernels phase on an H200).
    num_warps = num_warps or (2 if head_dim >= 128 else 4)
    grid = (rows, triton.cdiv(heads, heads_block))
    outputs = []
    q_rstd, k_rstd = rstd if rstd is not None else (None, None)
    views = split_qkv(qkv, heads)
    for offset, weight, statistic, view in zip(offsets, (q_weight, k_weight), (q_rstd, k_rstd), views):
        if statistic is not None:
            assert statistic.dtype == torch.float32 and statistic.numel() == rows * heads
            statistic = statistic.contiguous()
        if in_place:
            out, out_row_stride, out_offset = qkv, row_stride, offset
        else:
            out, out_row_stride, out_offset = qkv.new_empty(view.shape), inner, 0
        _qk_norm_rope_kernel[grid](qkv, weight, cos, sin, statistic if statistic is not None else weight, out, weight,
                                   seq_len, heads, row_stride, offset, out_row_stride, out_offset, eps,
                                   HEAD_DIM=head_dim, ROTARY_DIM=rotary_dim, HEADS_BLOCK=heads_block,
                                   HAS_ROPE=has_rope, HAS_RSTD=statistic is not None, num_warps=num_warps,
                                   **NO_FMA)
        outputs.append(view if in_place else out)
    return outputs[0], outputs[1], views[2]


def qk_norm_rope(qkv, heads, q_weight, k_weight, eps, cos=None, sin=None, in_place=False, rstd=None):
    fn = qk_norm_rope_triton if qkv.is_cuda else qk_norm_rope_reference
    return fn(qkv, heads, q_weight, k_weight, eps, cos, sin, in_place, rstd)


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


def qk_norm_rope_fp8_triton(qkv, heads, q_weight, k_weight, eps, cos=None, sin=None, heads_block=None,
                            num_warps=None) -> FP8Heads:
    qkv = qkv.contiguous()
    inner = qkv.shape[-1] // 3
    head_dim, seq_len = inner // heads, qkv.shape[-2]
    # 32 heads of 128 channels a program on 2 warps: 1.98-2.03 ms for the DiT's q, k and v against 2.22-2.31 ms with
    # 8 heads, the same values (H200, bench/results/2026-12-02T2210-kernel-launch-defaults.json and the runs before
    # it). The decoder's 64-channel heads keep 8 on 4 warps: no shape was clearly faster there (0.51-0.53 ms).
    wide = head_dim >= 128
    heads_block = heads_block or (min(32, triton.next_power_of_2(heads)) if wide else 8)
    num_warps = num_warps or (2 if wide else 4)
    rows, row_stride, offsets = qkv.numel() // qkv.shape[-1], qkv.shape[-1], (0, inner, 2 * inner)
    has_rope = cos is not None
    cos, sin = (cos.contiguous(), sin.contiguous()) if has_rope else (q_weight, q_weight)  # never read without
    views = split_qkv(qkv, heads)
    multipliers = fp8_multipliers(q_weight, k_weight, views[2], head_dim)
    grid = (rows, triton.cdiv(heads, heads_block))
    outputs = [qkv.new_empty(views[0].shape, dtype=FP8) for _ in range(3)]
    # q and k normed (and rotated), v only scaled: three launches of one kernel, each writing e4m3 once.
    for offset, weight, multiplier, out, norm in zip(offsets, (q_weight, k_weight, q_weight), multipliers, outputs,
                                                     (True, True, False)):
        _qk_norm_rope_kernel[grid](qkv, weight, cos, sin, weight, out, multiplier, seq_len, heads, row_stride, offset,
                                   inner, 0, eps, HEAD_DIM=head_dim, ROTARY_DIM=cos.shape[-1] if has_rope else 0,
                                   HEADS_BLOCK=heads_block, HAS_ROPE=has_rope and norm, HAS_RSTD=False, NORM=norm,
                                   FP8_OUT=True, EMULATE_ROUNDING=os.environ.get("TRITON_INTERPRET") == "1",
                                   num_warps=num_warps, **NO_FMA)
    return FP8Heads(*outputs, *(descale(m, *m.shape) for m in multipliers))


def qk_norm_rope_fp8(qkv, heads, q_weight, k_weight, eps, cos=None, sin=None) -> FP8Heads:
    fn = qk_norm_rope_fp8_triton if qkv.is_cuda else qk_norm_rope_fp8_reference
    return fn(qkv, heads, q_weight, k_weight, eps, cos, sin)
