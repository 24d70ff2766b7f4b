"""FP8 (e4m3) attention: Q and K quantized per block of 128 rows of a head, V per head, and the softmax
probabilities scaled into FP8's range for the P.V product; both products accumulate in fp32.

The torch reference walks the keys in the kernel's blocks with the same online softmax, so the two agree to fp32
summation order; `attention_fp8` is what the DiT calls.
"""
import math
import os

import torch
import triton
import triton.language as tl

from h3gen.kernels.rounding import to_fp8

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
# Probabilities are at most 1: scaled by FP8's largest value they keep 3 mantissa bits down to about 3.5e-5.
P_SCALE = 448.0
BLOCK = 128  # rows per Q and K scale, and the kernel's tile along both sequence axes
LOG2E = 1.4426950408889634


def quantize_blocks(x, block=BLOCK):
    """(B, L, H, D) -> fp8 (B, H, L, D), scale (B, H, ceil(L / block)): one scale per block of rows of a head."""
    b, length, h, d = x.shape
    blocks = -(-length // block)
    padded = torch.nn.functional.pad(x.transpose(1, 2).float(), (0, 0, 0, blocks * block - length))
    amax = padded.view(b, h, blocks, block, d).abs().amax(dim=(3, 4)).clamp(min=1e-12)
    scale = FP8_MAX / amax
    quantized = (padded.view(b, h, blocks, block, d) * scale[..., None, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return quantized.view(b, h, blocks * block, d)[:, :, :length], 1 / scale


def quantize_heads_transposed(v):
    """(B, L, H, D) -> fp8 (B, H, D, L), scale (B, H): the key-major layout Hopper's FP8 MMA wants for P.V."""
    amax = v.float().abs().amax(dim=(1, 3)).clamp(min=1e-12)  # (B, H)
    scale = FP8_MAX / amax
    quantized = (v.float() * scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return quantized.permute(0, 2, 3, 1).contiguous(), 1 / scale


def quantize(q, k, v):
    q8, q_scale = quantize_blocks(q)
    k8, k_scale = quantize_blocks(k)
    v8, v_scale = quantize_heads_transposed(v)
    return q8.contiguous(), q_scale.contiguous(), k8.contiguous(), k_scale.contiguous(), v8, v_scale.contiguous()


def attention_fp8_reference(q, k, v, block_n=BLOCK):
    """`q`, `k`, `v` (B, L, H, D) -> (B, L, H, D) in q's dtype: the kernel's arithmetic in torch."""
    length, d = q.shape[1], q.shape[-1]
    q8, q_scale, k8, k_scale, v8, v_scale = quantize(q, k, v)
    sm_scale = LOG2E / math.sqrt(d)
    query = q8.float() * (q_scale.repeat_interleave(BLOCK, dim=2)[..., :length, None] * sm_scale)
    row_max = torch.full(query.shape[:3], -math.inf)
    row_sum = torch.zeros(query.shape[:3])
    acc = torch.zeros(query.shape)
    for start in range(0, length, block_n):
        keys = k8[:, :, start:start + block_n].float()
        scores = (query @ keys.transpose(-1, -2)) * k_scale[:, :, start // BLOCK, None, None]
        new_max = torch.maximum(row_max, scores.amax(dim=-1))
        probs = torch.exp2(scores - new_max[..., None])
        alpha = torch.exp2(row_max - new_max)
        row_sum = row_sum * alpha + probs.sum(dim=-1)
        probs8 = (probs * P_SCALE).to(FP8).float()
        acc = acc * alpha[..., None] + probs8 @ v8[:, :, :, start:start + block_n].float().transpose(-1, -2)
        row_max = new_max
    out = acc * (v_scale[..., None, None] / P_SCALE) / row_sum[..., None]
    return out.transpose(1, 2).to(q.dtype)


@triton.jit
def _attend_block(acc, row_max, row_sum, q, qk_scale, k_ptrs, v_ptrs, k_scale_ptr, start, length, stride_kl,
                  stride_vl, MASKED: tl.constexpr, BLOCK_N: tl.constexpr, QBLOCK: tl.constexpr,
                  P_SCALE: tl.constexpr, EMULATE_ROUNDING: tl.constexpr):
    cols = start + tl.arange(0, BLOCK_N)
    if MASKED:
        keys = tl.load(k_ptrs + start * stride_kl, mask=cols[None, :] < length, other=0.0)
        values = tl.load(v_ptrs + start * stride_vl, mask=cols[:, None] < length, other=0.0)
    else:
        keys = tl.load(k_ptrs + start * stride_kl)
        values = tl.load(v_ptrs + start * stride_vl)
    # The scales multiply the exact FP8 products: folding them into Q or K first would round twice.
    scores = tl.dot(q, keys) * (qk_scale * tl.load(k_scale_ptr + start // QBLOCK))
    if MASKED:
        scores = tl.where(cols[None, :] < length, scores, -float("inf"))
    new_max = tl.maximum(row_max, tl.max(scores, 1))
    probs = tl.math.exp2(scores - new_max[:, None])
    alpha = tl.math.exp2(row_max - new_max)
    row_sum = row_sum * alpha + tl.sum(probs, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(to_fp8(probs * P_SCALE, EMULATE_ROUNDING), values, acc)
    return acc, new_max, row_sum


@triton.jit
def _attention_fp8_kernel(q_ptr, k_ptr, v_ptr, out_ptr, q_scale_ptr, k_scale_ptr, v_scale_ptr, sm_scale, length,
                          heads, blocks, stride_out_l, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, QBLOCK: tl.constexpr, P_SCALE: tl.constexpr,
                          EMULATE_ROUNDING: tl.constexpr):
    block_m = tl.program_id(0)
    batch_head = tl.program_id(1).to(tl.int64)
    rows = block_m * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM)
    # q8 and k8 are (B, H, L, D), v8 (B, H, D, L), all contiguous.
    head_offset = batch_head * length * HEAD_DIM
    q = tl.load(q_ptr + head_offset + rows[:, None] * HEAD_DIM + dims[None, :], mask=rows[:, None] < length,
                other=0.0)
    qk_scale = tl.load(q_scale_ptr + batch_head * blocks + block_m * BLOCK_M // QBLOCK) * sm_scale
    k_ptrs = k_ptr + head_offset + tl.arange(0, BLOCK_N)[None, :] * HEAD_DIM + dims[:, None]
    v_ptrs = v_ptr + head_offset + dims[None, :] * length + tl.arange(0, BLOCK_N)[:, None]
    k_scale_ptr = k_scale_ptr + batch_head * blocks
    row_max = tl.full([BLOCK_M], -float("inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    full_blocks = length // BLOCK_N
    for block_n in range(0, full_blocks):
        acc, row_max, row_sum = _attend_block(acc, row_max, row_sum, q, qk_scale, k_ptrs, v_ptrs, k_scale_ptr,
                                              block_n * BLOCK_N, length, HEAD_DIM, 1, False, BLOCK_N, QBLOCK, P_SCALE,
                                              EMULATE_ROUNDING)
    if full_blocks * BLOCK_N < length:
        acc, row_max, row_sum = _attend_block(acc, row_max, row_sum, q, qk_scale, k_ptrs, v_ptrs, k_scale_ptr,
                                              full_blocks * BLOCK_N, length, HEAD_DIM, 1, True, BLOCK_N, QBLOCK, P_SCALE,
                                              EMULATE_ROUNDING)
    out = acc * (tl.load(v_scale_ptr + batch_head) / P_SCALE) / row_sum[:, None]
    batch, head = batch_head // heads, batch_head % heads
    out_ptrs = out_ptr + (batch * length * heads + head) * HEAD_DIM + rows[:, None] * stride_out_l + dims[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=rows[:, None] < length)


def attention_fp8_triton(q, k, v, block_m=BLOCK, block_n=BLOCK, num_warps=8, num_stages=3):
    """`q`, `k`, `v` (B, L, H, D) -> (B, L, H, D) in q's dtype. The tiles divide the quantization block."""
    assert BLOCK % block_m == 0 and BLOCK % block_n == 0, (block_m, block_n)
    batch, length, heads, head_dim = q.shape
    q8, q_scale, k8, k_scale, v8, v_scale = quantize(q, k, v)
    out = torch.empty_like(q)
    grid = (triton.cdiv(length, block_m), batch * heads)
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    _attention_fp8_kernel[grid](q8, k8, v8, out, q_scale, k_scale, v_scale, LOG2E / math.sqrt(head_dim), length,
                                heads, q_scale.shape[-1], heads * head_dim, HEAD_DIM=head_dim, BLOCK_M=block_m,
                                BLOCK_N=block_n, QBLOCK=BLOCK, P_SCALE=P_SCALE, EMULATE_ROUNDING=interpreted,
                                num_warps=num_warps, num_stages=num_stages)
    return out


def attention_fp8(q, k, v):
    return attention_fp8_triton(q, k, v) if q.is_cuda else attention_fp8_reference(q, k, v)
