"""RMSNorm followed by AdaLN modulation, with the modulation rows gathered per packed row; for an FP8 linear that
takes the result, the same values straight to FP8 rows with one scale per row (`quantize_rows`' arithmetic), so
the bf16 rows are never written nor read again."""
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from h3gen.kernels.quantize_rows import fp8_rows_launch, quantize_rows_reference, store_fp8_row
from h3gen.kernels.rounding import NO_FMA


def rmsnorm_modulate_reference(x, weight, eps, modulation=None, row_index=None, shift_chunk=0, scale_chunk=1,
                               rstd=None):
    """`x` (..., seq_len, hidden); `modulation` (rows, n_chunks * hidden); `row_index` (seq_len,) into it. `rstd`
    (torch's own statistic, `kernels.norm_statistic.torch_rstd`) is for the kernel: torch recomputes the same."""
    hidden = x.shape[-1]
    out = F.rms_norm(x, (hidden,), weight, eps)
    if modulation is None:
        return out
    shift = modulation[:, shift_chunk * hidden:(shift_chunk + 1) * hidden].index_select(0, row_index)
    scale = modulation[:, scale_chunk * hidden:(scale_chunk + 1) * hidden].index_select(0, row_index)
    return out * (1.0 + scale) + shift


def rmsnorm_modulate_quantized_reference(x, weight, eps, modulation=None, row_index=None, shift_chunk=0,
                                         scale_chunk=1):
    """quantize_rows of the modulated norm: (fp8 (M, hidden), fp32 scale (M, 1)) over the flattened leading dims."""
    out = rmsnorm_modulate_reference(x, weight, eps, modulation, row_index, shift_chunk, scale_chunk)
    return quantize_rows_reference(out.reshape(-1, out.shape[-1]))


@triton.jit
def _rmsnorm_modulate_kernel(x_ptr, weight_ptr, modulation_ptr, row_index_ptr, rstd_ptr, out_ptr,
                             seq_len, hidden, modulation_stride, shift_offset, scale_offset, eps,
                             HAS_MODULATION: tl.constexpr, HAS_RSTD: tl.constexpr, BLOCK: tl.constexpr,
                             scale_ptr=None, dtype_max=0.0, FP8_OUT: tl.constexpr = False,
                             EMULATE: tl.constexpr = False):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * hidden + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RSTD:
        rstd = tl.load(rstd_ptr + row)
    else:
        rstd = tl.rsqrt(tl.sum(x * x, axis=0) / hidden + eps)
    out = x * rstd * tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dtype = x_ptr.dtype.element_ty
    if HAS_MODULATION:
        # Round where the reference's separate ops round (norm output, 1 + scale, product): tracking diffusers'
        # bf16 result matters more than being more precise than it.
        table_row = tl.load(row_index_ptr + row % seq_len).to(tl.int64)
        base = modulation_ptr + table_row * modulation_stride
        shift = tl.load(base + shift_offset + cols, mask=mask, other=0.0).to(tl.float32)
        scale = tl.load(base + scale_offset + cols, mask=mask, other=0.0).to(tl.float32)
        out = out.to(dtype).to(tl.float32) * (1.0 + scale).to(dtype).to(tl.float32)
        out = out.to(dtype).to(tl.float32) + shift
    if FP8_OUT:  # the value the bf16 kernel stores, then quantize_rows' arithmetic on it
        store_fp8_row(out.to(dtype).to(tl.float32), out_ptr + row * hidden + cols, scale_ptr + row, mask, dtype,
                      dtype_max, EMULATE)
    else:
        tl.store(out_ptr + row * hidden + cols, out.to(dtype), mask=mask)


def launch_options(block: int, num_warps=None) -> dict:
    """A warp per 512 channels, at most 8: the DiT's 5,376-channel rows take 8 warps, 0.47 ms a call in bf16 and
    0.54 ms to FP8 rows against 0.52 and 0.65 on 16 (H200, bench/results/2026-12-02T2210-kernel-launch-defaults.json).
    The warps set the order a row's squares are summed in, so both forms launch alike and stay bit-equal."""
    return dict(num_warps=num_warps or min(8, max(1, block // 512)), **NO_FMA)


def rmsnorm_modulate_triton(x, weight, eps, modulation=None, row_index=None, shift_chunk=0, scale_chunk=1,
                            rstd=None, num_warps=None):
    x = x.contiguous()
    hidden, seq_len = x.shape[-1], x.shape[-2]
    out = torch.empty_like(x)
    has_modulation = modulation is not None
    if not has_modulation:
        modulation, row_index = weight, weight  # never read
    else:
        assert modulation.stride(-1) == 1 and row_index.numel() == seq_len
    if rstd is not None:
        assert rstd.dtype == torch.float32 and rstd.numel() == x.numel() // hidden
        rstd = rstd.contiguous()
    block = triton.next_power_of_2(hidden)
    _rmsnorm_modulate_kernel[(x.numel() // hidden,)](
        x, weight, modulation, row_index, rstd if rstd is not None else weight, out,
        seq_len, hidden, modulation.stride(0), shift_chunk * hidden, scale_chunk * hidden, eps,
        HAS_MODULATION=has_modulation, HAS_RSTD=rstd is not None, BLOCK=block, **launch_options(block, num_warps))
    return out


def rmsnorm_modulate_quantized_triton(x, weight, eps, modulation=None, row_index=None, shift_chunk=0,
                                      scale_chunk=1, num_warps=None):
    x = x.contiguous()
    hidden, seq_len = x.shape[-1], x.shape[-2]
    has_modulation = modulation is not None
    if not has_modulation:
        modulation, row_index = weight, weight  # never read
    else:
        assert modulation.stride(-1) == 1 and row_index.numel() == seq_len
    out, scale, block, options = fp8_rows_launch(x.numel() // hidden, hidden, x.device)
    _rmsnorm_modulate_kernel[(out.shape[0],)](
        x, weight, modulation, row_index, weight, out, seq_len, hidden, modulation.stride(0), shift_chunk * hidden,
        scale_chunk * hidden, eps, HAS_MODULATION=has_modulation, HAS_RSTD=False, BLOCK=block,
        scale_ptr=scale, dtype_max=torch.finfo(x.dtype).max, FP8_OUT=True, EMULATE=options["EMULATE"],
        **launch_options(block, num_warps))
    return out, scale


def rmsnorm_modulate(x, weight, eps, modulation=None, row_index=None, shift_chunk=0, scale_chunk=1, rstd=None):
    fn = rmsnorm_modulate_triton if x.is_cuda else rmsnorm_modulate_reference
    return fn(x, weight, eps, modulation, row_index, shift_chunk, scale_chunk, rstd)


def rmsnorm_modulate_quantized(x, weight, eps, modulation=None, row_index=None, shift_chunk=0, scale_chunk=1):
    """(fp8 rows, fp32 scale (M, 1)) of `rmsnorm_modulate`'s output: what `quantize_rows` makes of it, in one
    pass; the Triton kernel on a GPU."""
    if x.is_cuda and x.dtype in (torch.bfloat16, torch.float32):
        return rmsnorm_modulate_quantized_triton(x, weight, eps, modulation, row_index, shift_chunk, scale_chunk)
    return rmsnorm_modulate_quantized_reference(x, weight, eps, modulation, row_index, shift_chunk, scale_chunk)
