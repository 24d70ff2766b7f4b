"""Per-head RMSNorm of query and key, then rotary embedding on the leading `rotary_dim` channels of each head
(`qk_norm_rope_fp8` writes q, k and v in e4m3 instead)."""
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from h3gen.kernels.rounding import NO_FMA


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
    """`qkv` (B, L, 3 * heads * head_dim) -> q, k, v each (B, L, heads, head_dim); v is a view. With `in_place`
    the kernel writes q and k over their own part of `qkv` (all three are views then); the reference never does.
    `rstd`, (q's, k's) statistic as torch computes it (`kernels.norm_statistic.torch_rstd`), is for the kernel."""
    q, k, v = split_qkv(qkv, heads)
    head_dim = q.shape[-1]
    q = F.rms_norm(q, (head_dim,), q_weight, eps)
    k = F.rms_norm(k, (head_dim,), k_weight, eps)
    if cos is not None:
        q, k = apply_rotary_reference(q, cos, sin), apply_rotary_reference(k, cos, sin)
    return q, k, v


@triton.jit
def _qk_norm_rope_kernel(qkv_ptr, weight_ptr, cos_ptr, sin_ptr, rstd_ptr, out_ptr,
                         seq_len, heads, qkv_row_stride, source_offset, out_row_stride, out_offset, eps,
                         HEAD_DIM: tl.constexpr, ROTARY_DIM: tl.constexpr, HEADS_BLOCK: tl.constexpr,
                         HAS_ROPE: tl.constexpr, HAS_RSTD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1) * HEADS_BLOCK + tl.arange(0, HEADS_BLOCK)
    dim = tl.arange(0, HEAD_DIM)
    mask = (head < heads)[:, None]
    src = qkv_ptr + row * qkv_row_stride + source_offset + head[:, None] * HEAD_DIM
    x = tl.load(src + dim[None, :], mask=mask, other=0.0).to(tl.float32)
    dtype = qkv_ptr.dtype.element_ty
    if HAS_RSTD:
        rstd = tl.load(rstd_ptr + row * heads + head, mask=head < heads, other=1.0)[:, None]
    else:
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / HEAD_DIM + eps)[:, None]
    out = x * rstd * tl.load(weight_ptr + dim).to(tl.float32)[None, :]
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
        _qk_norm_rope_kernel[grid](qkv, weight, cos, sin, statistic if statistic is not None else weight, out,
                                   seq_len, heads, row_stride, offset, out_row_stride, out_offset, eps,
                                   HEAD_DIM=head_dim, ROTARY_DIM=rotary_dim, HEADS_BLOCK=heads_block,
                                   HAS_ROPE=has_rope, HAS_RSTD=statistic is not None, num_warps=num_warps,
                                   **NO_FMA)
        outputs.append(view if in_place else out)
    return outputs[0], outputs[1], views[2]


def qk_norm_rope(qkv, heads, q_weight, k_weight, eps, cos=None, sin=None, in_place=False, rstd=None):
    fn = qk_norm_rope_triton if qkv.is_cuda else qk_norm_rope_reference
    return fn(qkv, heads, q_weight, k_weight, eps, cos, sin, in_place, rstd)

