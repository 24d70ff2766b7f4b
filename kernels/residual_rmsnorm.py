"""The video VAE decoder's float32 residual stream in one pass: `hidden += branch * scale`, then the next RMSNorm of
it rounded to the compute dtype, as diffusers' `MiniMaxH3VideoTransformerBlock` does in separate ops (product and
sum each rounded to float32, the norm in float32, one rounding to the compute dtype). For an FP8 linear that takes
the norm, the same values go straight to FP8 rows with one scale per row (`quantize_rows`' arithmetic)."""
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from h3gen.kernels.quantize_rows import fp8_rows_launch, quantize_rows_reference, store_fp8_row
from h3gen.kernels.rounding import NO_FMA


def residual_rmsnorm_reference(hidden, branch, scale, norm_weight=None, eps=1e-5, dtype=torch.bfloat16):
    """`hidden` (..., dim) float32, updated in place; returns RMSNorm(hidden) in `dtype`, or None without a norm."""
    hidden += branch * scale
    if norm_weight is None:
        return None
    return F.rms_norm(hidden, (hidden.shape[-1],), norm_weight, eps).to(dtype)


def residual_rmsnorm_quantized_reference(hidden, branch, scale, norm_weight, eps=1e-5, dtype=torch.bfloat16):
    """`residual_rmsnorm_reference`'s update of `hidden`, and quantize_rows of its norm: (fp8 (M, dim), fp32 scale
    (M, 1)) over the flattened leading dims."""
    out = residual_rmsnorm_reference(hidden, branch, scale, norm_weight, eps, dtype)
    return quantize_rows_reference(out.reshape(-1, out.shape[-1]))


@triton.jit
def _residual_rmsnorm_kernel(hidden_ptr, branch_ptr, scale_ptr, weight_ptr, out_ptr, dim, eps,
                             HAS_NORM: tl.constexpr, BLOCK: tl.constexpr, row_scale_ptr=None, dtype_max=0.0,
                             DTYPE: tl.constexpr = None, FP8_OUT: tl.constexpr = False,
                             EMULATE: tl.constexpr = False):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < dim
    hidden = tl.load(hidden_ptr + row * dim + cols, mask=mask, other=0.0)
    branch = tl.load(branch_ptr + row * dim + cols, mask=mask, other=0.0).to(tl.float32)
    hidden = hidden + branch * tl.load(scale_ptr + cols, mask=mask, other=0.0)
    tl.store(hidden_ptr + row * dim + cols, hidden, mask=mask)
    if HAS_NORM:
        rstd = tl.rsqrt(tl.sum(hidden * hidden, axis=0) / dim + eps)
        out = hidden * rstd * tl.load(weight_ptr + cols, mask=mask, other=0.0)
        if FP8_OUT:  # the value the compute-dtype output holds, then quantize_rows' arithmetic on it
            store_fp8_row(out.to(DTYPE).to(tl.float32), out_ptr + row * dim + cols, row_scale_ptr + row, mask, DTYPE,
                          dtype_max, EMULATE)
        else:
            tl.store(out_ptr + row * dim + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def residual_rmsnorm_triton(hidden, branch, scale, norm_weight=None, eps=1e-5, dtype=torch.bfloat16):
    assert hidden.dtype == torch.float32 and hidden.is_contiguous()
    dim = hidden.shape[-1]
    branch = branch.contiguous()
    has_norm = norm_weight is not None
    out = torch.empty(hidden.shape, dtype=dtype, device=hidden.device) if has_norm else hidden
    block = triton.next_power_of_2(dim)
    _residual_rmsnorm_kernel[(hidden.numel() // dim,)](
        hidden, branch, scale.float().contiguous(), (norm_weight if has_norm else scale).float().contiguous(), out,
        dim, eps, HAS_NORM=has_norm, BLOCK=block, num_warps=min(16, max(1, block // 256)), **NO_FMA)
    return out if has_norm else None


def residual_rmsnorm_quantized_triton(hidden, branch, scale, norm_weight, eps=1e-5, dtype=torch.bfloat16):
    assert hidden.dtype == torch.float32 and hidden.is_contiguous()
    dim = hidden.shape[-1]
    out, row_scale, block, options = fp8_rows_launch(hidden.numel() // dim, dim, hidden.device)
    _residual_rmsnorm_kernel[(out.shape[0],)](
        hidden, branch.contiguous(), scale.float().contiguous(), norm_weight.float().contiguous(), out, dim, eps,
        HAS_NORM=True, BLOCK=block, row_scale_ptr=row_scale, dtype_max=torch.finfo(dtype).max,
        DTYPE=tl.bfloat16 if dtype == torch.bfloat16 else tl.float32, FP8_OUT=True, EMULATE=options["EMULATE"],
        num_warps=min(16, max(1, block // 256)), **NO_FMA)
    return out, row_scale


def residual_rmsnorm_quantized(hidden, branch, scale, norm_weight, eps=1e-5, dtype=torch.bfloat16):
    """`residual_rmsnorm`, its norm as (fp8 rows, fp32 scale (M, 1)) for an FP8 linear: what `quantize_rows` makes
    of the `dtype` norm, in the same pass; the Triton kernel on a GPU."""
    if hidden.is_cuda and dtype in (torch.bfloat16, torch.float32):
        return residual_rmsnorm_quantized_triton(hidden, branch, scale, norm_weight, eps, dtype)
    return residual_rmsnorm_quantized_reference(hidden, branch, scale, norm_weight, eps, dtype)


def residual_rmsnorm(hidden, branch, scale, norm_weight=None, eps=1e-5, dtype=torch.bfloat16):
    fn = residual_rmsnorm_triton if hidden.is_cuda else residual_rmsnorm_reference
    return fn(hidden, branch, scale, norm_weight, eps, dtype)
