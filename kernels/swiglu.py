"""SwiGLU on a fused projection laid out [up | gate], as diffusers' `SwiGLU` chunks it; and SwiGLU straight into
the FP8 rows (one scale per row) an FP8 down projection reads, without writing the bf16 activation in between."""
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from h3gen.kernels.quantize_rows import fp8_rows_launch, quantize_rows_reference, store_fp8_row
from h3gen.kernels.rounding import NO_FMA, round_to


def swiglu_reference(up_gate):
    up, gate = up_gate.chunk(2, dim=-1)
    return up * F.silu(gate)


@triton.jit
def _swiglu_kernel(up_gate_ptr, out_ptr, inner, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inner
    src = up_gate_ptr + row * 2 * inner + cols
    up = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    gate = tl.load(src + inner, mask=mask, other=0.0).to(tl.float32)
    # silu as torch computes it, rounded before the product like the reference's two ops.
    silu = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    out = up * silu
    tl.store(out_ptr + row * inner + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def swiglu_triton(up_gate, block=1024):
    up_gate = up_gate.contiguous()
    inner = up_gate.shape[-1] // 2
    out = up_gate.new_empty((*up_gate.shape[:-1], inner))
    grid = (out.numel() // inner, triton.cdiv(inner, block))
    _swiglu_kernel[grid](up_gate, out, inner, BLOCK=block, num_warps=4, **NO_FMA)
    return out


def swiglu(up_gate):
    return swiglu_triton(up_gate) if up_gate.is_cuda else swiglu_reference(up_gate)


def swiglu_quantized_reference(up_gate):
    """quantize_rows of the SwiGLU: (fp8 (M, inner), fp32 scale (M, 1)) over the flattened leading dims."""
    out = swiglu_reference(up_gate)
    return quantize_rows_reference(out.reshape(-1, out.shape[-1]))


@triton.jit
def _swiglu_quantize_kernel(up_gate_ptr, out_ptr, scale_ptr, inner, dtype_max, BLOCK: tl.constexpr,
                            EMULATE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < inner
    src = up_gate_ptr + row * 2 * inner + cols
    dtype = up_gate_ptr.dtype.element_ty
    up = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    gate = tl.load(src + inner, mask=mask, other=0.0).to(tl.float32)
    # The SwiGLU kernel's values, rounded as it rounds; then quantize_rows' arithmetic on them.
    silu = round_to(gate / (1.0 + tl.exp(-gate)), dtype, EMULATE)
    x = round_to(up * silu, dtype, EMULATE)
    store_fp8_row(x, out_ptr + row * inner + cols, scale_ptr + row, mask, dtype, dtype_max, EMULATE)


def swiglu_quantized_triton(up_gate):
    up_gate = up_gate.contiguous()
    inner = up_gate.shape[-1] // 2
    out, scale, block, options = fp8_rows_launch(up_gate.numel() // (2 * inner), inner, up_gate.device)
    _swiglu_quantize_kernel[(out.shape[0],)](up_gate, out, scale, inner, torch.finfo(up_gate.dtype).max,
                                             BLOCK=block, **options, **NO_FMA)
    return out, scale


def swiglu_quantized(up_gate):
    """(fp8 rows, fp32 scale (M, 1)) of the SwiGLU of `up_gate` (..., 2 * inner); the Triton kernel on a GPU."""
    if up_gate.is_cuda and up_gate.dtype in (torch.bfloat16, torch.float32):
        return swiglu_quantized_triton(up_gate)
    return swiglu_quantized_reference(up_gate)
