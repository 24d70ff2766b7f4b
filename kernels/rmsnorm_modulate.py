"""RMSNorm followed by AdaLN modulation, with the modulation rows gathered per packed row; for an FP8 linear that
takes the result, the same values straight to FP8 rows with one scale per row (`quantize_rows`' arithmetic), so
the bf16 rows are never written nor read again. The same kernel can first add a gated branch to the residual
(`gated_residual`'s arithmetic) and norm the sum it writes, so the sum is not read back."""
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from h3gen.kernels.gated_residual import gated_residual_reference
from h3gen.kernels.quantize_rows import fp8_multiplier, fp8_rows_launch, quantize_rows_reference, store_fp8
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


def gated_residual_rmsnorm_modulate_reference(x, y, modulation, row_index, gate_chunk, weight, eps, shift_chunk=0,
                                              scale_chunk=1, fp8=False):
    """(`gated_residual` of `x` and `y`, the modulated norm of that sum): the norm as (fp8 rows, scales) with `fp8`."""
    x = gated_residual_reference(x, y, modulation, row_index, gate_chunk)
    norm = rmsnorm_modulate_quantized_reference if fp8 else rmsnorm_modulate_reference
    return x, norm(x, weight, eps, modulation, row_index, shift_chunk, scale_chunk)


@triton.jit
def _gated_sum(x, y_row, sum_row, cols, mask, table_row_ptr, gate_offset, dtype: tl.constexpr,
               HAS_MODULATION: tl.constexpr):
    """x + gate * y stored at `sum_row`, rounded as `gated_residual` rounds it, and returned as the norm reads it."""
    y = tl.load(y_row + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_MODULATION:
        gate = tl.load(table_row_ptr + gate_offset + cols, mask=mask, other=0.0).to(tl.float32)
        y = (gate * y).to(dtype).to(tl.float32)
    total = (x + y).to(dtype)
    tl.store(sum_row + cols, total, mask=mask)
    return total.to(tl.float32)


@triton.jit
def _modulated(x, cols, mask, rstd, weight_ptr, table_row_ptr, shift_offset, scale_offset, dtype: tl.constexpr,
               HAS_MODULATION: tl.constexpr):
    out = x * rstd * tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_MODULATION:
        # Round where the reference's separate ops round (norm output, 1 + scale, product): tracking diffusers'
        # bf16 result matters more than being more precise than it.
        shift = tl.load(table_row_ptr + shift_offset + cols, mask=mask, other=0.0).to(tl.float32)
        scale = tl.load(table_row_ptr + scale_offset + cols, mask=mask, other=0.0).to(tl.float32)
        out = out.to(dtype).to(tl.float32) * (1.0 + scale).to(dtype).to(tl.float32)
        out = out.to(dtype).to(tl.float32) + shift
    return out.to(dtype).to(tl.float32)


@triton.jit
def _rmsnorm_modulate_kernel(x_ptr, weight_ptr, modulation_ptr, row_index_ptr, rstd_ptr, out_ptr,
                             seq_len, hidden, modulation_stride, shift_offset, scale_offset, eps,
                             HAS_MODULATION: tl.constexpr, HAS_RSTD: tl.constexpr, PIECE0: tl.constexpr,
                             PIECE1: tl.constexpr, PIECE2: tl.constexpr, scale_ptr=None, dtype_max=0.0,
                             FP8_OUT: tl.constexpr = False, EMULATE: tl.constexpr = False, y_ptr=None, sum_ptr=None,
                             gate_offset=0, HAS_RESIDUAL: tl.constexpr = False):
    """A row as up to three power-of-two pieces side by side (5,376 = 4,096 + 1,024 + 256), so no lane of a block
    idles past the row's end; PIECE1 and PIECE2 are 0 when absent. With HAS_RESIDUAL the row normed is x + gate * y,
    written to `sum_ptr` on the way."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * hidden
    dtype = x_ptr.dtype.element_ty
    table_row_ptr = modulation_ptr
    if HAS_MODULATION:
        table_row_ptr = modulation_ptr + tl.load(row_index_ptr + row % seq_len).to(tl.int64) * modulation_stride
    if HAS_RESIDUAL:
        y_row, sum_row = y_ptr + row * hidden, sum_ptr + row * hidden
    cols0 = tl.arange(0, PIECE0)
    mask0 = cols0 < hidden
    x0 = tl.load(x_row + cols0, mask=mask0, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x0 = _gated_sum(x0, y_row, sum_row, cols0, mask0, table_row_ptr, gate_offset, dtype, HAS_MODULATION)
    squares = tl.sum(x0 * x0, axis=0)
    if PIECE1 > 0:
        cols1 = PIECE0 + tl.arange(0, PIECE1)
        mask1 = cols1 < hidden
        x1 = tl.load(x_row + cols1, mask=mask1, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            x1 = _gated_sum(x1, y_row, sum_row, cols1, mask1, table_row_ptr, gate_offset, dtype, HAS_MODULATION)
        squares += tl.sum(x1 * x1, axis=0)
    if PIECE2 > 0:
        cols2 = PIECE0 + PIECE1 + tl.arange(0, PIECE2)
        mask2 = cols2 < hidden
        x2 = tl.load(x_row + cols2, mask=mask2, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            x2 = _gated_sum(x2, y_row, sum_row, cols2, mask2, table_row_ptr, gate_offset, dtype, HAS_MODULATION)
        squares += tl.sum(x2 * x2, axis=0)
    if HAS_RSTD:
        rstd = tl.load(rstd_ptr + row)
    else:
        rstd = tl.rsqrt(squares / hidden + eps)
    out0 = _modulated(x0, cols0, mask0, rstd, weight_ptr, table_row_ptr, shift_offset, scale_offset, dtype,
                      HAS_MODULATION)
    if PIECE1 > 0:
        out1 = _modulated(x1, cols1, mask1, rstd, weight_ptr, table_row_ptr, shift_offset, scale_offset, dtype,
                          HAS_MODULATION)
    if PIECE2 > 0:
        out2 = _modulated(x2, cols2, mask2, rstd, weight_ptr, table_row_ptr, shift_offset, scale_offset, dtype,
                          HAS_MODULATION)
    out_row = out_ptr + row * hidden
    if FP8_OUT:  # the values the bf16 kernel stores, then quantize_rows' arithmetic on them
        amax = tl.max(tl.abs(out0), axis=0)
        if PIECE1 > 0:
            amax = tl.maximum(amax, tl.max(tl.abs(out1), axis=0))
        if PIECE2 > 0:
            amax = tl.maximum(amax, tl.max(tl.abs(out2), axis=0))
        multiplier = fp8_multiplier(amax, dtype, dtype_max, EMULATE)
        store_fp8(out0, multiplier, out_row + cols0, mask0, dtype, EMULATE)
        if PIECE1 > 0:
            store_fp8(out1, multiplier, out_row + cols1, mask1, dtype, EMULATE)
        if PIECE2 > 0:
            store_fp8(out2, multiplier, out_row + cols2, mask2, dtype, EMULATE)
        tl.store(scale_ptr + row, tl.math.div_rn(tl.full([], 1.0, tl.float32), multiplier))
    else:
        tl.store(out_row + cols0, out0.to(dtype), mask=mask0)
        if PIECE1 > 0:
            tl.store(out_row + cols1, out1.to(dtype), mask=mask1)
        if PIECE2 > 0:
            tl.store(out_row + cols2, out2.to(dtype), mask=mask2)


def row_pieces(hidden: int) -> dict:
    """`hidden` as at most three powers of two, largest first; one masked power of two where it takes more."""
    pieces = [1 << bit for bit in reversed(range(hidden.bit_length())) if hidden >> bit & 1]
    if len(pieces) > 3:
        pieces = [triton.next_power_of_2(hidden)]
    pieces += [0] * (3 - len(pieces))
    return dict(PIECE0=pieces[0], PIECE1=pieces[1], PIECE2=pieces[2])


def launch_options(hidden: int, num_warps=None) -> dict:
    """The row in pieces on a warp per 1,024 lanes, at most 4: the DiT's 5,376-channel rows in 0.43 ms a call in bf16
    and 0.46 ms to FP8 rows, against 0.46 and 0.54 ms as one masked block of 8,192 lanes on 8 warps, the fastest
    shape before (H200, bench/results/2026-12-03T0604-triton-rates-norm-pieces.json). The warps set the order a row's
    squares are summed in, so both forms launch alike and stay bit-equal."""
    warps = min(4, max(1, triton.next_power_of_2(hidden) // 1024))
    return dict(num_warps=num_warps or warps, **row_pieces(hidden), **NO_FMA)


def _launch(x, weight, eps, modulation, row_index, shift_chunk, scale_chunk, num_warps, fp8=False, rstd=None,
            residual=None):
    """The norm kernel over `x`'s rows: (the norm, or (fp8 rows, fp32 scales (M, 1)) with `fp8`; the sum it wrote
    with `residual` = (y, gate_chunk), else None)."""
    x = x.contiguous()
    hidden, seq_len = x.shape[-1], x.shape[-2]
    count = x.numel() // hidden
    has_modulation = modulation is not None
    if not has_modulation:
        modulation, row_index = weight, weight  # never read
    else:
        assert modulation.stride(-1) == 1 and row_index.numel() == seq_len
    if rstd is not None:
        assert rstd.dtype == torch.float32 and rstd.numel() == count
        rstd = rstd.contiguous()
    options = {}
    if fp8:
        out, scale, _, rows_options = fp8_rows_launch(count, hidden, x.device)
        options.update(scale_ptr=scale, dtype_max=torch.finfo(x.dtype).max, FP8_OUT=True,
                       EMULATE=rows_options["EMULATE"])
    else:
        out = torch.empty_like(x)
    total = None
    if residual is not None:
        y, gate_chunk = residual
        y, total = y.contiguous(), torch.empty_like(x)
        assert y.shape == x.shape and y.dtype == x.dtype
        options.update(y_ptr=y, sum_ptr=total, gate_offset=gate_chunk * hidden, HAS_RESIDUAL=True)
    _rmsnorm_modulate_kernel[(count,)](
        x, weight, modulation, row_index, rstd if rstd is not None else weight, out, seq_len, hidden,
        modulation.stride(0), shift_chunk * hidden, scale_chunk * hidden, eps, HAS_MODULATION=has_modulation,
        HAS_RSTD=rstd is not None, **options, **launch_options(hidden, num_warps))
    return ((out, scale) if fp8 else out), total


def rmsnorm_modulate_triton(x, weight, eps, modulation=None, row_index=None, shift_chunk=0, scale_chunk=1,
                            rstd=None, num_warps=None):
    return _launch(x, weight, eps, modulation, row_index, shift_chunk, scale_chunk, num_warps, rstd=rstd)[0]


def rmsnorm_modulate_quantized_triton(x, weight, eps, modulation=None, row_index=None, shift_chunk=0,
                                      scale_chunk=1, num_warps=None):
    return _launch(x, weight, eps, modulation, row_index, shift_chunk, scale_chunk, num_warps, fp8=True)[0]


def gated_residual_rmsnorm_modulate_triton(x, y, modulation, row_index, gate_chunk, weight, eps, shift_chunk=0,
                                           scale_chunk=1, fp8=False, num_warps=None):
    normed, total = _launch(x, weight, eps, modulation, row_index, shift_chunk, scale_chunk, num_warps, fp8=fp8,
                            residual=(y, gate_chunk))
    return total, normed


def rmsnorm_modulate(x, weight, eps, modulation=None, row_index=None, shift_chunk=0, scale_chunk=1, rstd=None):
    fn = rmsnorm_modulate_triton if x.is_cuda else rmsnorm_modulate_reference
    return fn(x, weight, eps, modulation, row_index, shift_chunk, scale_chunk, rstd)


def rmsnorm_modulate_quantized(x, weight, eps, modulation=None, row_index=None, shift_chunk=0, scale_chunk=1):
    """(fp8 rows, fp32 scale (M, 1)) of `rmsnorm_modulate`'s output: what `quantize_rows` makes of it, in one
    pass; the Triton kernel on a GPU."""
    if x.is_cuda and x.dtype in (torch.bfloat16, torch.float32):
        return rmsnorm_modulate_quantized_triton(x, weight, eps, modulation, row_index, shift_chunk, scale_chunk)
    return rmsnorm_modulate_quantized_reference(x, weight, eps, modulation, row_index, shift_chunk, scale_chunk)


def gated_residual_rmsnorm_modulate(x, y, modulation, row_index, gate_chunk, weight, eps, shift_chunk=0, scale_chunk=1,
                                    fp8=False):
    """(`gated_residual(x, y, ...)`, `rmsnorm_modulate` of that sum): with `fp8`, the norm as
    `rmsnorm_modulate_quantized` gives it. One Triton kernel on a GPU: the same values as the two kernels, the sum
    written once and never read back."""
    triton_ok = x.is_cuda and (not fp8 or x.dtype in (torch.bfloat16, torch.float32))
    fn = gated_residual_rmsnorm_modulate_triton if triton_ok else gated_residual_rmsnorm_modulate_reference
    return fn(x, y, modulation, row_index, gate_chunk, weight, eps, shift_chunk, scale_chunk, fp8)
