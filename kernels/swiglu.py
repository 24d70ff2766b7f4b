"""SwiGLU on a fused projection laid out [up | gate], as diffusers' `SwiGLU` chunks it."""
import torch.nn.functional as F
import triton
import triton.language as tl

from h3gen.kernels.rounding import NO_FMA


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
