"""Quant stages: FP8 row-wise and int8 weight-only linears, swapped into the DiT and the text encoder at load.

Each mode is measured against the bf16 reference path on the same weights and inputs (velocity relative error and
cosine similarity). The tiny model's random block weights are redrawn at unit gain, so its blocks carry most of the
velocity and a quantization error in them shows up in the output.
"""

import re
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from conftest import norm_relative_error
from h3gen.inputs.request import Request
from h3gen.errors import UsageError
from h3gen.plugins.manager import registry
from h3gen.config.preset import resolve
from h3gen.bench.velocity_error import compare, make_probe, velocity, weight_bytes
from h3gen.stages.quant import FP8Rowwise, Int8WeightOnly
from h3gen.models.quant_linear import FP8RowwiseLinear, Int8WeightOnlyLinear

FP32_MODULES = ("proj_in", "audio_proj_in", "time_embedder.linear_1", "time_embedder.linear_2", "proj_out",
                "audio_proj_out")
REQUEST = Request(index=0, prompt="probe", seed=1, width=32, height=32, frames=124)


def tiny_dit(tiny_model, dtype=torch.bfloat16, fast=False):
    """diffusers' DiT (or h3gen's, with `fast`) on the tiny checkpoint, block weights redrawn at unit gain."""
    if fast:
        from h3gen.models.dit.transformer import FastH3Transformer

        dit = FastH3Transformer.from_pretrained(tiny_model / "transformer", dtype=dtype, use_triton=False)
    else:
        from diffusers import MiniMaxH3Transformer3DModel

        dit = MiniMaxH3Transformer3DModel.from_pretrained(tiny_model / "transformer", torch_dtype=dtype).eval()
    generator = torch.Generator().manual_seed(0)
    for name, module in dit.named_modules():
        if isinstance(module, nn.Linear) and name.startswith(("transformer_blocks", "token_refiner")):
            weight = torch.randn(module.weight.shape, generator=generator) / module.in_features ** 0.5
            module.weight.data.copy_(weight)
    return dit


def quant_stage(name, tiny_model, **knobs):
    preset = resolve("tiny", registry(), [f"quant.use={name}"] + [f"quant.{k}={v}" for k, v in knobs.items()])
    stage = registry().stage("quant", name)(preset.stages["quant"][1], SimpleNamespace(device="cpu"))
    stage.load(SimpleNamespace(root=tiny_model))
    return stage


@pytest.fixture(scope="module")
def reference(tiny_model):
    """The bf16 reference path: velocities of the unquantized DiT on one probe."""
    dit = tiny_dit(tiny_model)
    probe = make_probe(dit.config, REQUEST, text_tokens=8, sigma=0.5)
    return probe, velocity(dit, probe, "cpu", torch.bfloat16), weight_bytes(dit)


def test_fp8_scales_each_output_channel_and_each_activation_row():
    torch.manual_seed(0)
    linear = nn.Linear(64, 48)
    with torch.no_grad():
        linear.weight[0] *= 1e5  # one loud output channel must not wash out the others
    x = torch.randn(5, 64)
    x[0] *= 1e5  # nor one loud row the other rows
    fp8 = FP8RowwiseLinear.from_linear(linear, matmul="reference")
    out, ref = fp8(x), linear(x)
    assert fp8.weight_bits.view(torch.float8_e4m3fn).dtype == torch.float8_e4m3fn and fp8.weight_scale.shape == (48,)
    for row in range(5):
        assert norm_relative_error(out[row, 1:], ref[row, 1:]) < 0.1, row
    assert norm_relative_error(out[:, 0], ref[:, 0]) < 0.1


def test_fp8_scaled_mm_path_matches_the_dequantizing_reference():
    """The Hopper path's layout and scale shapes, checked with the CPU build of torch._scaled_mm."""
    torch.manual_seed(1)
    linear = nn.Linear(64, 96, bias=True).to(torch.bfloat16)
    x = torch.randn(3, 7, 64, dtype=torch.bfloat16)
    scaled = FP8RowwiseLinear.from_linear(linear, matmul="scaled_mm")
    reference = FP8RowwiseLinear.from_linear(linear, matmul="reference")
    assert scaled.matmul == "scaled_mm"
    out = scaled(x)
    assert out.shape == (3, 7, 96) and out.dtype == torch.bfloat16
    assert norm_relative_error(out, reference(x)) < 5e-3
    assert norm_relative_error(out, linear(x)) < 0.08


def test_fp8_fast_accumulation_and_prequantized_swiglu():
    """`fast_accum` reaches torch._scaled_mm (checked on the CPU build); an FP8 down projection fed the SwiGLU as FP8
    rows from the fused path equals the plain path, quantizing the SwiGLU's output, exactly."""
    from h3gen.kernels.swiglu import swiglu_reference
    from h3gen.models.quant_linear import swiglu_linear

    torch.manual_seed(3)
    linear = nn.Linear(64, 32, bias=True).to(torch.bfloat16)
    up_gate = torch.randn(2, 5, 128, dtype=torch.bfloat16)
    for matmul, fast_accum in (("reference", False), ("scaled_mm", False), ("scaled_mm", True)):
        fp8 = FP8RowwiseLinear.from_linear(linear, matmul=matmul, fast_accum=fast_accum)
        expected = fp8(swiglu_reference(up_gate))
        assert torch.equal(swiglu_linear(fp8, up_gate, swiglu_reference), expected)
        assert norm_relative_error(expected, linear(swiglu_reference(up_gate))) < 0.08
    assert "fast_accum" in repr(fp8)
    assert torch.equal(swiglu_linear(linear, up_gate, swiglu_reference), linear(swiglu_reference(up_gate)))


def test_int8_weight_only_linear():
    torch.manual_seed(2)
    linear = nn.Linear(64, 32)
    x = torch.randn(4, 64)
    int8 = Int8WeightOnlyLinear.from_linear(linear)
    assert int8.weight_int8.dtype == torch.int8 and int8.weight_int8.abs().max() == 127
    assert 0 < norm_relative_error(int8(x), linear(x)) < 0.01


def test_casting_the_model_leaves_fp8_weights_alone():
    linear = nn.Linear(32, 16)
    x = torch.randn(2, 32)
    model = nn.Sequential(FP8RowwiseLinear.from_linear(linear, matmul="reference"))
    before = model(x)
    model.to(torch.bfloat16).to(torch.float32)
    assert model[0].weight_bits.dtype == torch.uint8
    assert norm_relative_error(model(x), before) < 1e-2


@pytest.mark.parametrize("name, knobs, max_error, quantized", [
    ("fp8-rowwise", {}, 0.03, 18),
    ("fp8-rowwise", {"skip": "[]"}, 0.03, 20),  # adaln_proj too
    ("int8-weight-only", {}, 0.01, 18),
])
def test_dit_modes_against_the_bf16_reference(tiny_model, reference, name, knobs, max_error, quantized):
    probe, ref_velocity, ref_bytes = reference
    stage = quant_stage(name, tiny_model, **knobs)
    dit = stage.transform("dit", tiny_dit(tiny_model))
    swapped = {n for n, m in dit.named_modules() if isinstance(m, (FP8RowwiseLinear, Int8WeightOnlyLinear))}
    assert swapped == set(stage.quantized["dit"]) and len(swapped) == quantized
    assert all(n.startswith(("transformer_blocks.", "token_refiner.")) for n in swapped)
    assert ("adaln_proj" in " ".join(swapped)) == (knobs.get("skip") == "[]")
    for fp32 in FP32_MODULES:  # the checkpoint's fp32 islands and the norms stay as loaded
        assert type(dit.get_submodule(fp32)) is nn.Linear and dit.get_submodule(fp32).weight.dtype == torch.float32
    assert all(m.weight.dtype == torch.bfloat16 for m in dit.modules() if isinstance(m, nn.RMSNorm))
    assert weight_bytes(dit) < 0.75 * ref_bytes
    error = compare(ref_velocity, velocity(dit, probe, "cpu", torch.bfloat16))
    print(name, knobs, error)
    assert 1e-3 < error["all_rel_err"] < max_error
    assert error["video_cosine"] > 0.999 and error["audio_cosine"] > 0.999


def test_fp8_on_h3gens_fast_dit(tiny_model):
    """The fast DiT's fused QKV and gate/up projections are plain Linears: they quantize the same way."""
    reference_dit = tiny_dit(tiny_model, fast=True)
    probe = make_probe(reference_dit.config, REQUEST, text_tokens=8, sigma=0.5)
    reference = velocity(reference_dit, probe, "cpu", torch.bfloat16)
    stage = quant_stage("fp8-rowwise", tiny_model)
    dit = stage.transform("dit", tiny_dit(tiny_model, fast=True))
    kinds = {re.sub(r"^.*blocks\.\d+\.", "", name) for name in stage.quantized["dit"]}
    assert kinds == {"attn.to_qkv", "attn.to_out", "ff.up_gate", "ff.down"}
    assert len(stage.quantized["dit"]) == 4 * 3
    error = compare(reference, velocity(dit, probe, "cpu", torch.bfloat16))
    assert 1e-3 < error["all_rel_err"] < 0.03 and error["all_cosine"] > 0.999


def test_text_encoder_language_layers_are_quantized_and_the_rest_kept(tiny_model):
    from transformers import Qwen3VLForConditionalGeneration

    def encoder():
        return Qwen3VLForConditionalGeneration.from_pretrained(tiny_model / "text_encoder",
                                                               dtype=torch.bfloat16).eval()

    tokens = torch.randint(0, 300, (1, 12), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        ref = encoder()(input_ids=tokens, output_hidden_states=True).hidden_states
    model = quant_stage("fp8-rowwise", tiny_model).transform("text_encoder", encoder())
    linears = {n: type(m) for n, m in model.named_modules() if isinstance(m, (nn.Linear, FP8RowwiseLinear))}
    assert all((kind is FP8RowwiseLinear) == (".language_model.layers." in n) for n, kind in linears.items())
    assert sum(kind is FP8RowwiseLinear for kind in linears.values()) == 51 * 7
    with torch.inference_mode():
        out = model(input_ids=tokens, output_hidden_states=True).hidden_states
    # One layer costs a few percent; 50 random layers compound it (bf16 alone, against fp32, is 2% at layer 50).
    assert 1e-3 < norm_relative_error(out[1], ref[1]) < 0.04
    assert norm_relative_error(out[50], ref[50]) < 0.2
    assert torch.nn.functional.cosine_similarity(out[50].float().flatten(), ref[50].float().flatten(), dim=0) > 0.98

    kept = quant_stage("fp8-rowwise", tiny_model, roles='["dit"]').transform("text_encoder", encoder())
    assert not any(isinstance(m, FP8RowwiseLinear) for m in kept.modules())


@pytest.mark.parametrize("override, message", [
    ('quant.roles=["audio_vae"]', "unknown role 'audio_vae'"),
    ("quant.matmul=fast", "--set quant.matmul: unknown matmul 'fast'"),
])
def test_bad_quant_knobs(override, message):
    with pytest.raises(UsageError, match=message):
        resolve("h3-base-fp8", registry(), [override])


def test_fp8_presets_say_so_and_pick_the_fp8_stage():
    found = registry()
    for name in ("h3-base-fp8", "fasth3-fp8"):
        assert resolve(name, found).stages["quant"][0] == "fp8-rowwise" and "FP8" in resolve(name, found).description
    assert resolve("fasth3-fp8", found).adapter.paths == resolve("fasth3", found).adapter.paths
    assert {stage for kind, stage in found.stages if kind == "quant"} >= {"none", FP8Rowwise.name, Int8WeightOnly.name}


def test_quantized_weights_are_parameters_so_offloading_moves_them():
    """Group offloading with a side stream sends a module's parameters back to host memory, not its buffers."""
    linear = nn.Linear(32, 16, bias=False)
    for quantized in (FP8RowwiseLinear.from_linear(linear, matmul="reference"),
                      Int8WeightOnlyLinear.from_linear(linear)):
        assert not list(quantized.buffers())
        assert all(not p.requires_grad for p in quantized.parameters()) and len(list(quantized.parameters())) == 2


@pytest.mark.parametrize("device,chunk_rows", [("cpu", 0), ("cpu", 5), pytest.param("cuda", 0, marks=pytest.mark.cuda),
                                              pytest.param("cuda", 5, marks=pytest.mark.cuda)])
def test_fp8_linears_take_the_norm_as_fp8_rows_bit_for_bit(tiny_model, device, chunk_rows):
    """Attention's projection and the feed-forward's gate/up take their input as FP8 rows from the norm itself
    (`rmsnorm_modulate_fp8`): the velocities equal those of quantizing the bf16 norm's output, with the feed-forward
    unchunked or over row chunks (parts of the whole sequence's FP8 rows). On a GPU the Triton kernels run, the
    fused ones included: the feed-forward's rows come from the kernel that also adds attention's gated residual."""
    import copy

    from h3gen.models.dit import blocks

    probe, outputs = None, []
    for fused in (False, True):
        dit = quant_stage("fp8-rowwise", tiny_model).transform("dit", tiny_dit(tiny_model, fast=True).to(device))
        dit.configure(use_triton=True, ffn_chunk_rows=chunk_rows)
        ops = copy.copy(blocks.TRITON_OPS)  # on the CPU each Triton op runs its torch reference
        calls = []

        def residual_norm(*args, fp8):
            calls.extend([1] if fp8 else [])
            return blocks.gated_residual_rmsnorm_modulate(*args, fp8=fp8)

        ops.gated_residual_norm = residual_norm
        if fused:
            ops.rmsnorm_modulate_fp8 = lambda *args: calls.append(1) or blocks.rmsnorm_modulate_quantized(*args)
        else:
            ops.rmsnorm_modulate_fp8 = None
        for block in dit.transformer_blocks:
            block.ops = ops
        probe = probe or make_probe(dit.config, REQUEST, text_tokens=8, sigma=0.5)
        outputs.append(velocity(dit, probe, device, torch.bfloat16))
        assert len(calls) == (2 if fused else 0) * len(dit.transformer_blocks)
    assert all(torch.equal(a, b) for a, b in zip(outputs[0], outputs[1]))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("quantized", [False, True])
def test_gated_residual_and_norm_in_one_pass_give_the_velocities_of_two(tiny_model, device, quantized):
    """Attention's gated residual add and the feed-forward's norm of the sum, in one pass (`gated_residual_norm`)
    and as the two ops: the same velocities bit for bit, in bf16 and with FP8 linears taking FP8 rows. On a GPU the
    one-pass Triton kernel runs against the two Triton kernels; on the CPU both are the torch references."""
    import copy

    from h3gen.models.dit import blocks

    probe, outputs = None, []
    for one_pass in (False, True):
        dit = tiny_dit(tiny_model, fast=True).to(device)
        if quantized:
            dit = quant_stage("fp8-rowwise", tiny_model).transform("dit", dit)
        dit.configure(use_triton=True)
        ops = copy.copy(blocks.TRITON_OPS)
        if not one_pass:
            ops.gated_residual_norm = None
        for block in dit.transformer_blocks:
            block.ops = ops
        probe = probe or make_probe(dit.config, REQUEST, text_tokens=8, sigma=0.5)
        outputs.append(velocity(dit, probe, device, torch.bfloat16))
    assert all(torch.equal(a, b) for a, b in zip(outputs[0], outputs[1]))


def test_fp8_linears_need_fp8_tensor_cores_and_on_ada_a_row_wise_kernel(monkeypatch):
    """Hopper runs them; Ampere is refused by name; Ada is tried with one small product, refused if torch has no
    row-wise kernel for it."""
    from h3gen.stages.quant import scaled_mm_refusal

    capability = {}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: capability["value"])
    for value, refused in (((9, 0), ""), ((8, 6), "this GPU is sm86")):
        capability["value"] = value
        assert refused in scaled_mm_refusal("cuda") and bool(refused) == bool(scaled_mm_refusal("cuda"))
    capability["value"] = (8, 9)
    monkeypatch.setattr(torch, "ones", lambda *shape, device=None: torch.zeros(*shape))  # the CPU stands in
    tried = []

    def refuse(*args, **kwargs):
        tried.append(1)
        raise RuntimeError("no kernel")

    monkeypatch.setattr(torch, "_scaled_mm", refuse)
    assert "no row-wise torch._scaled_mm for sm89 (no kernel)" in scaled_mm_refusal("cuda") and tried
    monkeypatch.setattr(torch, "_scaled_mm", lambda *args, **kwargs: None)
    assert scaled_mm_refusal("cuda") == ""


def test_a_part_of_fp8_rows_is_that_part_quantized():
    """A chunked feed-forward takes parts of the whole sequence's FP8 rows: each row keeps its scale, so a part
    equals quantizing the same rows of the bf16 tensor, for every batch item."""
    from h3gen.kernels.quantize_rows import quantize_rows_reference
    from h3gen.models.quant_linear import FP8Rows

    x = torch.randn(2, 11, 16, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    rows, scale = quantize_rows_reference(x.reshape(-1, 16))
    whole = FP8Rows(rows, scale, x.shape, x.dtype)
    for start, stop in ((0, 5), (5, 10), (10, 15)):
        part = whole.part(start, stop)
        expected_rows, expected_scale = quantize_rows_reference(x[..., start:stop, :].reshape(-1, 16))
        assert part.shape == x[..., start:stop, :].shape and part.dtype == x.dtype
        assert torch.equal(part.rows.float(), expected_rows.float()) and torch.equal(part.scale, expected_scale)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_swiglu_linear_writes_into_the_rows_it_is_given(device):
    """The chunked feed-forward hands the down projection its rows of the block's output: contiguous (one batch
    item) the GEMM writes them itself, strided (several) they are copied; either way the values of a fresh result."""
    from h3gen.kernels.swiglu import swiglu
    from h3gen.models.quant_linear import swiglu_linear

    torch.manual_seed(0)
    matmul = "scaled_mm" if device == "cuda" else "reference"
    down = FP8RowwiseLinear.from_linear(nn.Linear(32, 16, bias=False), matmul).to(device)
    for batch in (1, 2):
        up_gate = torch.randn(batch, 12, 64, device=device).to(torch.bfloat16)
        expected = swiglu_linear(down, up_gate, swiglu)
        out = torch.zeros(batch, 20, 16, device=device, dtype=torch.bfloat16)
        rows = out[:, 4:16, :]
        assert swiglu_linear(down, up_gate, swiglu, out=rows) is rows
        assert torch.equal(rows, expected) and not out[:, :4].any() and not out[:, 16:].any()
