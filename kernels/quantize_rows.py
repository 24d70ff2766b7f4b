"""Activation rows to FP8 e4m3 with one scale per row, in one pass: what FP8 linears feed `torch._scaled_mm`.

The multiplier 448 / amax is rounded to the activation's dtype and the scale is its exact inverse, so scaling never
makes an fp32 copy of the activation and dequantizing undoes exactly what was applied; the product is rounded to
the activation's dtype before FP8, as the torch reference's ops round.
"""
import os

import torch
import triton
import triton.language as tl

from h3gen.kernels.rounding import round_to, to_fp8

FP8, FP8_MAX = torch.float8_e4m3fn, 448.0


def quantize_rows_reference(rows):
    """(fp8 rows, fp32 scale of shape (M, 1)) with rows ~= fp8 * scale."""
    amax = rows.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12)
    multiplier = (FP8_MAX / amax).clamp(max=torch.finfo(rows.dtype).max).to(rows.dtype)
    quantized = (rows * multiplier).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return quantized, multiplier.float().reciprocal()


@triton.jit
def fp8_multiplier(amax, dtype: tl.constexpr, dtype_max, EMULATE: tl.constexpr):
    """448 / amax in the reference's arithmetic: rounded to `dtype`, never above its largest value."""
    amax = tl.maximum(amax, 1e-12)
    # div_rn: IEEE division as torch's (Triton's `/` on fp32 is an approximate division on the GPU)
    return round_to(tl.minimum(tl.math.div_rn(tl.full([], 448.0, tl.float32), amax), dtype_max), dtype, EMULATE)


@triton.jit
def store_fp8(x, multiplier, out_ptrs, mask, dtype: tl.constexpr, EMULATE: tl.constexpr):
    """`x` (fp32 holding values of `dtype`) times `multiplier`, rounded to `dtype`, then to FP8 at `out_ptrs`."""
    scaled = tl.minimum(tl.maximum(round_to(x * multiplier, dtype, EMULATE), -448.0), 448.0)
    tl.store(out_ptrs, to_fp8(scaled, EMULATE), mask=mask)


@triton.jit
def store_fp8_row(x, out_ptrs, scale_ptr, mask, dtype: tl.constexpr, dtype_max, EMULATE: tl.constexpr):
    """One row `x` (fp32 holding values of `dtype`) stored as FP8 at `out_ptrs` with its scale at `scale_ptr`, in
    the reference's arithmetic."""
    multiplier = fp8_multiplier(tl.max(tl.abs(x), axis=0), dtype, dtype_max, EMULATE)
    store_fp8(x, multiplier, out_ptrs, mask, dtype, EMULATE)
    tl.store(scale_ptr, tl.math.div_rn(tl.full([], 1.0, tl.float32), multiplier))


def fp8_rows_launch(count, cols, device):
    """For a kernel that quantizes one row per program: its outputs (fp8 rows (count, cols), fp32 scales (count,
    1)), the power-of-two block that holds a row, and the launch options."""
    block = triton.next_power_of_2(cols)
    out = torch.empty((count, cols), dtype=FP8, device=device)
    scale = torch.empty((count, 1), dtype=torch.float32, device=device)
    options = dict(EMULATE=os.environ.get("TRITON_INTERPRET") == "1", num_warps=min(32, max(4, block // 1024)))
    return out, scale, block, options


@triton.jit
def _quantize_rows_kernel(rows_ptr, out_ptr, scale_ptr, cols, dtype_max, BLOCK: tl.constexpr,
                          EMULATE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offsets = tl.arange(0, BLOCK)
    mask = offsets < cols
    x = tl.load(rows_ptr + row * cols + offsets, mask=mask, other=0.0).to(tl.float32)
    store_fp8_row(x, out_ptr + row * cols + offsets, scale_ptr + row, mask, rows_ptr.dtype.element_ty, dtype_max,
                  EMULATE)


def quantize_rows_triton(rows):
    rows = rows.contiguous()
    count, cols = rows.shape
    out, scale, block, options = fp8_rows_launch(count, cols, rows.device)
    _quantize_rows_kernel[(count,)](rows, out, scale, cols, torch.finfo(rows.dtype).max, BLOCK=block, **options)
    return out, scale


def quantize_rows(rows):
    """(M, K) bf16 or fp32 rows -> (fp8 rows, fp32 scale (M, 1)); the Triton kernel on a GPU."""
    if rows.is_cuda and rows.dtype in (torch.bfloat16, torch.float32):
        return quantize_rows_triton(rows)
    return quantize_rows_reference(rows)
