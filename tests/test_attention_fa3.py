"""FlashAttention-3 backends (fa3, fa3-fp8) and the QK-norm kernel's e4m3 output: CPU fallbacks, the scale bound,
interpreter parity with the torch reference, and on a GPU the kernels against fp32 attention."""
import math
import os

import pytest
import torch

from conftest import norm_relative_error, run_parity_under_triton_interpreter
from h3gen.kernels.attention import attention, backend_name, choose_backend, refusal

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
parity = pytest.mark.skipif(not INTERPRETED, reason="runs in test_fp8_kernel_under_interpreter's child process")
on_hopper_with_fa3 = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9
                                        or choose_backend("cuda", "fa3").fallback_reason is not None,
                                        reason="needs an sm90 GPU and fa3-fwd")


def test_fp8_kernel_under_interpreter():
    if INTERPRETED:
        pytest.skip("this is the child process")
    run_parity_under_triton_interpreter(__file__)


@pytest.mark.parametrize("requested", ["fa3", "fa3-fp8"])
def test_fa3_backends_fall_back_on_the_cpu_with_the_reason(requested):
    choice = choose_backend("cpu", requested, torch.bfloat16, 128)
    assert choice.name == "sdpa"
    assert choice.fallback_reason.startswith(f"{requested} not used, sdpa instead: ")
    assert choose_backend("cpu").fallback_reason is None and backend_name("cpu") == "sdpa"
    q, k, v = torch.randn(3, 1, 9, 2, 16).unbind(0)
    assert torch.equal(attention(q, k, v, requested), attention(q, k, v))  # today's bytes


@pytest.mark.parametrize("requested, why", [
    ("auto", None), ("sdpa", None), ("fa3", None), ("fa3-fp8", None), ("triton-fp8", None),
    ("sdpa-flash", None),  # SDPA's flash kernel has a CPU twin
    ("flash-attn-4", "it runs on CUDA GPUs only, and this run is on cpu"),
    ("sdpa-cudnn", "it runs on CUDA GPUs only, and this run is on cpu"),
    ("cudnn-fp8", "it runs on CUDA GPUs only, and this run is on cpu"),
])
def test_a_backend_named_outright_is_refused_where_it_cannot_run(requested, why):
    """The backends that fall back (fa3, fa3-fp8) and those with a CPU path are never refused on the CPU; the others
    are, with the reason, before anything runs them."""
    assert refusal("cpu", requested, "float32") == why
    if why is None:
        q, k, v = torch.randn(3, 1, 9, 2, 16).unbind(0)
        assert attention(q, k, v, requested).shape == q.shape


@pytest.mark.cuda
def test_half_precision_backends_refuse_fp32_on_the_gpu():
    assert refusal("cuda", "sdpa-flash", torch.float32).startswith("on a GPU it takes bf16 or fp16 inputs")
    assert refusal("cuda", "sdpa-flash", torch.bfloat16) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_bound_multiplier_covers_any_normed_rotated_head(dtype):
    # The worst case: all of a head's energy in the channel with the largest weight, at rotation angles 0 and pi/2
    # (the rotated partner lands at full size too). Scaled, no value may pass 448, and the bound is tight to 2x.
    from h3gen.kernels.attention_fa3_fp8 import norm_bound_multiplier
    from h3gen.kernels.qk_norm_rope import qk_norm_rope_reference

    heads, head_dim, rotary_dim = 4, 128, 96
    weight = (1 + 0.1 * torch.randn(head_dim)).to(dtype)
    weight[[5, 5 + rotary_dim // 2, 100]] = torch.tensor([-3.0, 2.0, 2.5], dtype=dtype)
    qkv = torch.zeros(1, 4, 3 * heads * head_dim)
    for row, channel in enumerate((5, 5, 100, 53)):
        qkv[0, row, channel::head_dim][:heads] = torch.tensor([1.0, -2.0, 7.0, -0.5])
    angles = torch.tensor([0.0, math.pi / 2, 0.3, 1.0])[:, None].expand(4, rotary_dim)
    q, _, _ = qk_norm_rope_reference(qkv.to(dtype), heads, weight, weight, 1e-6, angles.cos(), angles.sin())
    scaled = q.float().abs().amax() * norm_bound_multiplier(weight, head_dim)
    assert 448 / 2 < scaled <= 448, scaled


@parity
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rope", [True, False])
def test_parity_qk_norm_rope_fp8(dtype, rope):
    from test_kernels import QK_SHAPE, interpreted, qk_norm_rope_args

    kernel = interpreted("qk_norm_rope_fp8")
    batch, seq_len, heads, head_dim, _ = QK_SHAPE
    args = qk_norm_rope_args(dtype, rope, 0.3)
    expected = kernel.qk_norm_rope_fp8_reference(*args)
    actual = kernel.qk_norm_rope_fp8_triton(*args, rows_block=2, heads_block=2)
    for a, e in zip(actual[3:], expected[3:]):
        assert a.shape == (batch, heads) and torch.equal(a, e)
    for a, e in zip(actual[:3], expected[:3]):
        assert a.dtype == e.dtype == torch.float8_e4m3fn and a.shape == (batch, seq_len, heads, head_dim)
        if dtype == torch.float32:
            assert torch.equal(a.view(torch.uint8), e.view(torch.uint8))
        else:
            # The interpreter truncates fp32 -> bf16 where the GPU rounds to nearest: test_kernels.py's bf16
            # tolerance (1.6e-2 of the largest value) plus one e4m3 step (2^-3 relative). On a GPU:
            # test_fa3_fp8_fused_and_unfused_against_fp32_attention_on_the_gpu.
            apart = (a.float() - e.float()).abs()
            assert (apart <= 1.6e-2 * e.float().abs().max() + e.float().abs() * 2 ** -3).all()


def fp32_attention(q, k, v):
    out = torch.nn.functional.scaled_dot_product_attention(*(t.float().transpose(1, 2) for t in (q, k, v)))
    return out.transpose(1, 2)


@pytest.mark.cuda
@on_hopper_with_fa3
def test_fa3_against_fp32_attention_on_the_gpu():
    # bf16 inputs and output: about 2.3e-3 on an H200 at every shape tried (bench/results/...-fa3-probe.json).
    assert backend_name("cuda") == "fa3"
    for length, heads, head_dim in ((4096, 56, 128), (1797, 7, 128), (73, 32, 64)):
        q, k, v = torch.randn(3, 1, length, heads, head_dim, device="cuda", dtype=torch.bfloat16).unbind(0)
        assert norm_relative_error(attention(q, k, v, "fa3"), fp32_attention(q, k, v)) < 5e-3


@pytest.mark.cuda
@on_hopper_with_fa3
def test_fa3_fp8_fused_and_unfused_against_fp32_attention_on_the_gpu():
    # Logits ~N(0, 1): e4m3 inputs and probabilities give about 5.4e-2 (the probe, per head or per tensor alike).
    from h3gen.kernels.attention_fa3_fp8 import attend_fp8
    from h3gen.kernels.qk_norm_rope import qk_norm_rope
    from h3gen.kernels.qk_norm_rope_fp8 import qk_norm_rope_fp8, qk_norm_rope_fp8_reference

    heads, head_dim = 28, 128
    qkv = torch.randn(1, 4096, 3 * heads * head_dim, device="cuda", dtype=torch.bfloat16)
    weights = (1 + 0.1 * torch.randn(2, head_dim, device="cuda")).to(torch.bfloat16)
    angles = torch.randn(4096, 96, device="cuda")
    args = (qkv, heads, *weights, 1e-6, angles.cos(), angles.sin())
    q, k, v = qk_norm_rope(*args)
    reference = fp32_attention(q, k, v)
    fused = qk_norm_rope_fp8(*args)
    expected = qk_norm_rope_fp8_reference(*args)
    for a, e in zip(fused[:3], expected[:3]):  # the GPU rounds as torch does: the same bytes bar the odd tie
        assert (a.view(torch.uint8) != e.view(torch.uint8)).float().mean() < 1e-3
    assert norm_relative_error(attend_fp8(fused), reference) < 8e-2
    assert norm_relative_error(attention(q, k, v, "fa3-fp8"), reference) < 8e-2
