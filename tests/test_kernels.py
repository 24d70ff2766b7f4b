"""Each Triton kernel against its torch reference, run by Triton's CPU interpreter at tiny shapes."""
import os

import pytest
import torch

from conftest import run_parity_under_triton_interpreter
from h3gen.kernels.norm_statistic import torch_rstd

# Triton decides at import whether `@triton.jit` compiles or interprets (its own `tl` helpers included), so the
# parity tests run in a child pytest that starts with TRITON_INTERPRET=1; the parent only launches it.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
parity = pytest.mark.skipif(not INTERPRETED, reason="runs in test_triton_kernels_under_interpreter's child process")


def test_triton_kernels_under_interpreter():
    if INTERPRETED:
        pytest.skip("this is the child process")
    run_parity_under_triton_interpreter(__file__)


def interpreted(name):
    module = __import__(f"h3gen.kernels.{name}", fromlist=["_"])
    kernel = getattr(module, f"_{name}_kernel")
    assert type(kernel).__name__ == "InterpretedFunction", type(kernel)
    return module


def assert_close(actual, expected, dtype):
    # fp32: only summation order differs. bf16: the kernels round where the reference's ops round, but Triton's
    # interpreter casts fp32 -> bf16 by truncation (the GPU rounds to nearest even), so allow a few bf16 ulps here;
    # bench/dit_gpu_check.py's `kernels` phase checks bf16 parity on the GPU.
    tol = 1e-5 if dtype == torch.float32 else 1.6e-2
    err = ((actual.float() - expected.float()).abs().max() / expected.float().abs().max()).item()
    assert err < tol, f"relative error {err:.3g} >= {tol}"


def make_modulation(rows, chunks, hidden, dtype, seq_len):
    modulation = (0.5 * torch.randn(rows, chunks * hidden)).to(dtype)
    return modulation, torch.randint(0, rows, (seq_len,))


@parity
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("modulated", [True, False])
@pytest.mark.parametrize("hidden", [112, 120])  # 64 + 32 + 16: a row in three pieces; 120 takes four: one block
def test_parity_rmsnorm_modulate(dtype, modulated, hidden):
    k = interpreted("rmsnorm_modulate")
    torch.manual_seed(0)
    batch, seq_len = 2, 7
    x = torch.randn(batch, seq_len, hidden).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden)).to(dtype)
    modulation, rows = make_modulation(6, 6, hidden, dtype, seq_len) if modulated else (None, None)
    args = (x, weight, 1e-5, modulation, rows, 3, 4)
    assert_close(k.rmsnorm_modulate_triton(*args), k.rmsnorm_modulate_reference(*args), dtype)
    # Handed torch's own statistic, the kernel normalizes by it: in fp32 exactly F.rms_norm's values.
    rstd = torch_rstd(x, 1e-5)
    handed = k.rmsnorm_modulate_triton(*args, rstd=rstd)
    assert_close(handed, k.rmsnorm_modulate_reference(*args), dtype)
    if not modulated:
        assert_close(k.rmsnorm_modulate_triton(*args, rstd=2 * rstd), 2 * handed, dtype)
        if dtype == torch.float32:
            assert torch.equal(handed, k.rmsnorm_modulate_reference(*args))


@parity
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("modulated", [True, False])
def test_parity_gated_residual(dtype, modulated):
    k = interpreted("gated_residual")
    torch.manual_seed(0)
    x, y = torch.randn(2, 5, 80).to(dtype), torch.randn(2, 5, 80).to(dtype)
    modulation, rows = make_modulation(4, 6, 80, dtype, 5) if modulated else (None, None)
    args = (x, y, modulation, rows, 5)
    assert_close(k.gated_residual_triton(*args, block=32), k.gated_residual_reference(*args), dtype)


@parity
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("normed", [True, False])
def test_parity_residual_rmsnorm(dtype, normed):
    k = interpreted("residual_rmsnorm")
    torch.manual_seed(0)
    hidden, branch = torch.randn(2, 5, 80), torch.randn(2, 5, 80).to(torch.bfloat16)
    scale, weight = 0.3 * torch.randn(80), (1 + 0.1 * torch.randn(80)) if normed else None
    expected_hidden = hidden.clone()
    expected = k.residual_rmsnorm_reference(expected_hidden, branch, scale, weight, 1e-5, dtype)
    actual = k.residual_rmsnorm_triton(hidden, branch, scale, weight, 1e-5, dtype)
    assert_close(hidden, expected_hidden, torch.float32)  # the residual stream, updated in place
    if normed:
        assert actual.dtype == dtype
        assert_close(actual, expected, dtype)
    else:
        assert actual is None and expected is None


@parity
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_parity_swiglu(dtype):
    k = interpreted("swiglu")
    torch.manual_seed(0)
    up_gate = torch.randn(2, 3, 2 * 72).to(dtype)
    assert_close(k.swiglu_triton(up_gate, block=32), k.swiglu_reference(up_gate), dtype)


@parity
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_parity_swiglu_quantized(dtype):
    """SwiGLU straight to FP8 rows against quantize_rows of the SwiGLU: the same FP8 values, the scales equal to an
    fp32 ulp (see test_parity_quantize_rows). Rows of magnitudes 1e-2 to 1e2."""
    k = interpreted("swiglu")
    torch.manual_seed(0)
    up_gate = (torch.randn(2, 5, 2 * 300) * torch.logspace(-2, 2, 5)[:, None]).to(dtype)
    (actual, actual_scale), (expected, expected_scale) = (k.swiglu_quantized_triton(up_gate),
                                                          k.swiglu_quantized_reference(up_gate))
    assert actual.shape == expected.shape == (10, 300) and actual_scale.shape == (10, 1)
    torch.testing.assert_close(actual_scale, expected_scale, rtol=2**-22, atol=0)
    # Compared as values: the emulated FP8 rounding in the interpreter loses the sign of a zero.
    assert torch.equal(actual.float(), expected.float())


@parity
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_parity_residual_rmsnorm_quantized(dtype):
    """The decoder's residual update with its norm straight to FP8 rows: the residual stream as the plain kernel
    leaves it, and the very bits of quantize_rows over the plain kernel's norm."""
    k, rows_kernel = interpreted("residual_rmsnorm"), interpreted("quantize_rows")
    torch.manual_seed(0)
    hidden = torch.randn(2, 5, 80) * torch.logspace(-2, 2, 5)[:, None]
    branch, scale, weight = torch.randn(2, 5, 80).to(torch.bfloat16), 0.3 * torch.randn(80), 1 + 0.1 * torch.randn(80)
    plain_hidden = hidden.clone()
    rows, row_scale = k.residual_rmsnorm_quantized_triton(hidden, branch, scale, weight, 1e-5, dtype)
    chained, chained_scale = rows_kernel.quantize_rows_triton(
        k.residual_rmsnorm_triton(plain_hidden, branch, scale, weight, 1e-5, dtype).reshape(-1, 80))
    assert torch.equal(hidden, plain_hidden) and rows.shape == (10, 80) and row_scale.shape == (10, 1)
    # Compared as values: the emulated FP8 rounding in the interpreter loses the sign of a zero.
    assert torch.equal(rows.float(), chained.float()) and torch.equal(row_scale, chained_scale)


@parity
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("modulated", [True, False])
def test_parity_rmsnorm_modulate_quantized(dtype, modulated):
    """The modulated norm straight to FP8 rows: the very bits of quantize_rows over the norm kernel's output, and the
    reference's values (their scales to an fp32 ulp, see test_parity_quantize_rows). Rows of magnitudes 1e-2 to 1e2."""
    k, rows_kernel = interpreted("rmsnorm_modulate"), interpreted("quantize_rows")
    torch.manual_seed(0)
    batch, seq_len, hidden = 2, 7, 112  # 64 + 32 + 16: three pieces
    x = (torch.randn(batch, seq_len, hidden) * torch.logspace(-2, 2, seq_len)[:, None]).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden)).to(dtype)
    modulation, rows = make_modulation(6, 6, hidden, dtype, seq_len) if modulated else (None, None)
    args = (x, weight, 1e-5, modulation, rows, 3, 4)
    fused, fused_scale = k.rmsnorm_modulate_quantized_triton(*args)
    chained, chained_scale = rows_kernel.quantize_rows_triton(k.rmsnorm_modulate_triton(*args).reshape(-1, hidden))
    assert fused.shape == (batch * seq_len, hidden) and fused_scale.shape == (batch * seq_len, 1)
    # Compared as values: the emulated FP8 rounding in the interpreter loses the sign of a zero.
    assert torch.equal(fused.float(), chained.float()) and torch.equal(fused_scale, chained_scale)
    expected, expected_scale = k.rmsnorm_modulate_quantized_reference(*args)
    torch.testing.assert_close(fused_scale, expected_scale, rtol=2**-22 if dtype == torch.float32 else 2e-2, atol=0)
    # bf16: the interpreter truncates the norm's output where torch rounds it, which can move a value across an
    # e4m3 rounding boundary: one e4m3 step then separates them, at most 32 / 448 of its row's largest (each row is
    # scaled to 448, whose binade steps by 32).
    dequantized, reference = fused.float() * fused_scale, expected.float() * expected_scale
    err = ((dequantized - reference).abs().max() / reference.abs().max()).item()
    assert err < (1e-5 if dtype == torch.float32 else 32 / 448 * (1 + 2e-2)), err


@parity
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("modulated", [True, False])
@pytest.mark.parametrize("fp8", [False, True])
def test_parity_gated_residual_rmsnorm_modulate(dtype, modulated, fp8):
    """The gated residual add and the modulated norm of its sum in one kernel: the very sum the residual kernel
    writes, and the very norm (or FP8 rows and scales) the norm kernel makes of that sum. Rows of magnitudes 1e-2 to
    1e2, 112 channels in three pieces."""
    k, residual = interpreted("rmsnorm_modulate"), interpreted("gated_residual")
    torch.manual_seed(0)
    batch, seq_len, hidden = 2, 7, 112
    x = (torch.randn(batch, seq_len, hidden) * torch.logspace(-2, 2, seq_len)[:, None]).to(dtype)
    y = torch.randn(batch, seq_len, hidden).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden)).to(dtype)
    modulation, rows = make_modulation(6, 6, hidden, dtype, seq_len) if modulated else (None, None)
    total, normed = k.gated_residual_rmsnorm_modulate_triton(x, y, modulation, rows, 5, weight, 1e-5, 3, 4, fp8=fp8)
    expected_total = residual.gated_residual_triton(x, y, modulation, rows, 5)
    norm = k.rmsnorm_modulate_quantized_triton if fp8 else k.rmsnorm_modulate_triton
    expected = norm(expected_total, weight, 1e-5, modulation, rows, 3, 4)
    assert torch.equal(total, expected_total)
    # Compared as values: the emulated FP8 rounding in the interpreter loses the sign of a zero.
    for actual, chained in zip(normed if fp8 else (normed,), expected if fp8 else (expected,)):
        assert actual.shape == chained.shape and torch.equal(actual.float(), chained.float())
    reference_total, _ = k.gated_residual_rmsnorm_modulate_reference(x, y, modulation, rows, 5, weight, 1e-5, 3, 4)
    assert_close(total, reference_total, dtype)


@parity
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_parity_head_amax(dtype):
    """Each (batch, head)'s largest magnitude of v, a strided view of the fused projection, over rows that do not
    fill the last block: exactly torch's."""
    k = interpreted("head_amax")
    torch.manual_seed(0)
    batch, rows, heads, head_dim = 2, 37, 3, 16
    qkv = (torch.randn(batch, rows, 3 * heads * head_dim) * torch.logspace(-2, 2, heads).repeat(3).repeat_interleave(
        head_dim)).to(dtype)
    v = qkv[..., 2 * heads * head_dim:].unflatten(-1, (heads, head_dim))
    assert torch.equal(k.head_amax_triton(v, rows=8, heads_block=2), k.head_amax_reference(v))


QK_SHAPE = (2, 5, 3, 128, 96)  # batch, rows, heads, head_dim, rotary channels


def qk_norm_rope_args(dtype, rope: bool, weight_spread: float):
    """(qkv, heads, q_weight, k_weight, eps, cos, sin) for the QK-norm + RoPE kernels: 2 x 5 rows, 3 heads of 128,
    rotary on the first 96 channels (None without `rope`), norm weights 1 +- `weight_spread`."""
    torch.manual_seed(0)
    batch, seq_len, heads, head_dim, rotary_dim = QK_SHAPE
    qkv = torch.randn(batch, seq_len, 3 * heads * head_dim).to(dtype)
    q_weight, k_weight = (1 + weight_spread * torch.randn(2, head_dim)).to(dtype)
    angles = 7.0 * torch.randn(seq_len, rotary_dim)
    cos, sin = (angles.cos(), angles.sin()) if rope else (None, None)
    return qkv, heads, q_weight, k_weight, 1e-5, cos, sin


@parity
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rope", [True, False])
def test_parity_qk_norm_rope(dtype, rope):
    k = interpreted("qk_norm_rope")
    batch, seq_len, heads, head_dim, _ = QK_SHAPE
    args = qk_norm_rope_args(dtype, rope, 0.1)
    qkv = args[0]
    expected = k.qk_norm_rope_reference(*args)
    for actual, e in zip(k.qk_norm_rope_triton(*args, heads_block=2), expected):
        assert actual.shape == e.shape == (batch, seq_len, heads, head_dim)
        assert_close(actual, e, dtype)
    # In place: q and k overwrite their columns of qkv and come back as views of it, v untouched.
    in_place = k.qk_norm_rope_triton(qkv.clone(), *args[1:], in_place=True, heads_block=2)
    assert len({t.untyped_storage().data_ptr() for t in in_place}) == 1
    for actual, e in zip(in_place, expected):
        assert_close(actual, e, dtype)
    # Handed torch's statistics of q and k, the kernel normalizes by them: in fp32 without RoPE exactly F.rms_norm.
    q, k_rows = (t.unflatten(-1, (heads, -1)) for t in qkv.chunk(3, dim=-1)[:2])
    handed = k.qk_norm_rope_triton(*args, rstd=(torch_rstd(q, 1e-5), torch_rstd(k_rows, 1e-5)), heads_block=2)
    for actual, e in zip(handed, expected):
        if dtype == torch.float32 and not rope:
            assert torch.equal(actual, e)
        assert_close(actual, e, dtype)


def test_rotary_matches_diffusers():
    from diffusers.models.transformers.transformer_minimax_h3 import _apply_rotary_emb

    from h3gen.kernels.qk_norm_rope import apply_rotary_reference

    torch.manual_seed(0)
    x = torch.randn(1, 6, 2, 128)
    angles = torch.randn(6, 96)
    assert torch.equal(apply_rotary_reference(x, angles.cos(), angles.sin()),
                       _apply_rotary_emb(x, angles.cos(), angles.sin()))


def test_attention_backend_on_cpu():
    from h3gen.kernels.attention import attention, backend_name

    assert backend_name("cpu") == "sdpa"
    q, k, v = torch.randn(3, 1, 9, 2, 16).unbind(0)
    expected = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)))
    torch.testing.assert_close(attention(q, k, v), expected.transpose(1, 2))
    with pytest.raises(ValueError, match="unknown attention backend"):
        backend_name("cpu", "bogus")


@parity
@pytest.mark.parametrize("length,heads,head_dim,block_m,block_n", [(300, 2, 64, 128, 128), (256, 1, 128, 128, 128),
                                                                   (200, 1, 64, 64, 64)])
def test_parity_attention_fp8(length, heads, head_dim, block_m, block_n):
    # The kernel and its reference share the quantization and the block order: only fp32 summation order differs,
    # and through it the odd probability that sits on an FP8 rounding boundary rounds the other way (measured
    # 3.5e-7 and 7.4e-5).
    k = interpreted("attention_fp8")
    torch.manual_seed(0)
    q, key, v = torch.randn(3, 1, length, heads, head_dim).unbind(0)
    actual = k.attention_fp8_triton(q, key, v, block_m=block_m, block_n=block_n)
    expected = k.attention_fp8_reference(q, key, v, block_n=block_n)
    assert actual.shape == expected.shape == q.shape
    err = ((actual - expected).norm() / expected.norm()).item()
    assert err < 5e-4, f"relative error {err:.3g}"


@parity
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_parity_quantize_rows(dtype):
    # The same roundings in the same order: FP8 values exact. The scale may differ by one fp32 ulp here: the
    # interpreter's division can round twice, the GPU's div_rn does not. Rows of different magnitudes, one all
    # zeros, values on rounding ties.
    k = interpreted("quantize_rows")
    torch.manual_seed(0)
    rows = (torch.randn(6, 300) * torch.logspace(-3, 3, 6)[:, None]).to(dtype)
    rows[2] = 0
    rows[3, :8] = torch.tensor([1.0, 1.0625, 1.125, 0.017, 3e-4, -7.8775, 448.0, -2.0]).to(dtype)
    (actual, actual_scale), (expected, expected_scale) = k.quantize_rows_triton(rows), k.quantize_rows_reference(rows)
    assert torch.equal(actual.view(torch.uint8), expected.view(torch.uint8))
    torch.testing.assert_close(actual_scale, expected_scale, rtol=2**-22, atol=0)  # an ulp is 2^-23..2^-22


def test_attention_fp8_error_against_exact():
    """What FP8 costs: Q, K, V and the probabilities each lose all but 3 mantissa bits. On unit Gaussians that is
    5.3e-2 relative error (cosine 0.9986) against exact attention; bf16 inputs give 3.7e-3."""
    from h3gen.kernels.attention import attention

    torch.manual_seed(0)
    q, k, v = torch.randn(3, 1, 600, 2, 128).unbind(0)
    exact = attention(q, k, v, "sdpa")
    fp8 = attention(q, k, v, "triton-fp8")  # the torch reference on the CPU
    err = ((fp8 - exact).norm() / exact.norm()).item()
    cosine = torch.nn.functional.cosine_similarity(fp8.flatten(), exact.flatten(), dim=0).item()
    assert 1e-2 < err < 7e-2 and cosine > 0.998, (err, cosine)


def test_qk_norm_rope_keeps_the_launch_shapes_measured_on_an_h200(monkeypatch):
    """The launch shape sets the order Triton sums a head's squares in. At 8 heads and 4 warps the video decoder's
    64-channel Q/K norms equal torch's on an H200 (bench/results/2026-11-29T1457-kernel-launch-shapes.json), which
    its exact decode relies on; the DiT's 128-channel heads give the same values on 2 warps, faster."""
    from h3gen.kernels import qk_norm_rope as module

    launches = []

    class Kernel:
        def __getitem__(self, grid):
            return lambda *args, **options: launches.append((grid[1], options["HEADS_BLOCK"], options["num_warps"]))

    monkeypatch.setattr(module, "_qk_norm_rope_kernel", Kernel())
    for heads, head_dim in ((32, 64), (56, 128)):
        qkv, weight = torch.zeros(1, 3, 3 * heads * head_dim), torch.ones(head_dim)
        module.qk_norm_rope_triton(qkv, heads, weight, weight, 1e-5)
    assert launches == [(4, 8, 4)] * 2 + [(7, 8, 2)] * 2
