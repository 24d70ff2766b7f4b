"""The fast video decode against diffusers' AutoencoderKLMiniMaxH3 decode, in float32 on the CPU (tiny model).

Tolerances: the tile layout, the blends and the uint8 frames of `exact = true` with one tile per forward are
diffusers' bit for bit; batching tiles changes only the GEMMs' shapes, so the frames move by float32 rounding
(measured 9.5e-7 on values up to 2.8 in the VAE's normalized pixel space; bound 1e-5); the fast decoder (fused
QKV, addcmul, one rms_norm for Q and K) likewise (measured 1.1e-6; bound 2e-5); its uint8 frames differ by <= 1.
"""

import copy
from types import SimpleNamespace

import pytest
import torch

from conftest import norm_relative_error
from h3gen.models.vae.tiles import ChunkJoiner, DecodePlan, plan_decode, split_tiles, stitch

EXACT_FLOAT, FAST_FLOAT = 1e-5, 2e-5


@pytest.fixture(scope="module")
def vae():
    """A tiny AutoencoderKLMiniMaxH3 whose decoder blocks do something: diffusers initializes their residual scales
    and register tokens to zero, which would leave attention and the MLP out of every comparison."""
    from diffusers import AutoencoderKLMiniMaxH3

    torch.manual_seed(0)
    model = AutoencoderKLMiniMaxH3(block_out_channels=(8,) * 6, layers_per_block=1, norm_num_groups=4,
                                   decoder_num_layers=2, decoder_num_attention_heads=2, decoder_attention_head_dim=16,
                                   latents_mean=(torch.randn(24) * 0.1).tolist(),
                                   latents_std=(1 + torch.rand(24) * 0.5).tolist()).eval()
    randomize_decoder(model)
    return model


def randomize_decoder(model):
    with torch.no_grad():
        for name, param in model.decoder.named_parameters():
            if "scale" in name or "register" in name:
                param.normal_(0, 0.5)


def bf16_decoder_on(vae, device):
    """A bf16 copy of `vae` on `device`, its checkpoint's float32 islands kept, as loading keeps them."""
    bf16 = copy.deepcopy(vae)
    keep = set(bf16._keep_in_fp32_modules)
    for name, param in bf16.named_parameters():
        if not keep & set(name.split(".")):
            param.data = param.data.to(torch.bfloat16)
    return bf16.to(device)


def test_split_tiles_is_diffusers(vae):
    for length in range(16, 1600, 16):
        for tile, overlap in ((256, 64), (192, 32), (64, 16), (320, 48)):
            starts, size, overlaps = split_tiles(length, tile, overlap, 16)
            theirs = vae._split_tiles(length, tile, overlap)
            assert (starts, [size] * len(starts), overlaps) == theirs, (length, tile, overlap)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stitch_is_diffusers_bit_for_bit(vae, dtype):
    plan = DecodePlan(16, 4, 5, 7, 1, 0, 3, 5, True, (0, 48, 80), (0, 40, 96), 64, 64, (16, 32), (24, 8), 22)
    tiles = [[torch.randn(3, 4, 64, 64).to(dtype) for _ in range(3)] for _ in range(3)]
    expected = vae._stitch_tiles([[t[None] for t in row] for row in tiles], list(plan.row_overlaps),
                                 list(plan.col_overlaps))
    assert torch.equal(stitch(tiles, plan), expected[0])


@pytest.mark.parametrize("latent_frames", [7, 12, 9, 10])
def test_plan_frame_count(vae, latent_frames):
    plan = plan_decode(vae, (1, 24, latent_frames, 2, 2), 256, 256, 64, 64)
    with torch.inference_mode():
        expected = vae.decode(torch.randn(1, 24, latent_frames, 2, 2)).sample.shape[2]
    assert plan.frames == expected
    if latent_frames % 5 == 2:  # 17n+5 frames, the only lengths h3gen asks for
        assert plan.frames == (latent_frames - 2) // 5 * 17 + 5


def stage(vae, **config):
    from h3gen.run.render import Runtime
    from h3gen.stages.vae import FastVAE, FastVAEConfig
    from h3gen.models.vae.vit import FastViTDecoder
    from h3gen.run.timing import StageTimer

    fast = FastVAE(FastVAEConfig(**config), Runtime("cpu", torch.float32, StageTimer("cpu")))
    fast.vae = vae
    exact = fast.config.exact
    fast.decoder = (lambda tiles: vae.decoder(vae.post_quant_conv(tiles))) if exact else FastViTDecoder(vae)
    return fast


def decoded(fast, latents):
    chunks = []
    with torch.inference_mode():
        fast.decode(latents, chunks.append)
    return torch.cat(chunks, dim=1)


def diffusers_decode(vae, latents, tile=256, overlap=64):
    """What the reference stage asks of diffusers: denormalized latents through `decode`."""
    vae.enable_tiling(tile, tile, overlap, overlap)
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    with torch.inference_mode():
        video = vae.decode(latents * std + mean).sample[0]
    vae.enable_tiling(256, 256, 64, 64)
    return video


# 12 latent frames = 39 frames in 2 chunks; 20x22 latents = 320x352 px, 2x2 tiles at diffusers' default.
LATENTS = (1, 24, 12, 20, 22)


def test_exact_one_tile_per_forward_is_diffusers_bit_for_bit(vae):
    latents = torch.randn(LATENTS)
    fast = stage(vae, exact=True, tile_batch=1)
    assert fast.plan(LATENTS).items == 2 * 4
    assert torch.equal(decoded(fast, latents), diffusers_decode(vae, latents))


@pytest.mark.parametrize("tile_batch", [3, 8])
def test_exact_batched(vae, tile_batch):
    latents = torch.randn(LATENTS)
    error = (decoded(stage(vae, exact=True, tile_batch=tile_batch), latents) - diffusers_decode(vae, latents)).abs()
    assert error.max() < EXACT_FLOAT, error.max()


@pytest.mark.parametrize("tile, overlap, tile_batch", [(256, 64, 5), (128, 32, 7), (192, 48, 4)])
def test_fast_decoder(vae, tile, overlap, tile_batch):
    """Smaller tiles than diffusers' (the tile knobs) against diffusers tiled the same way."""
    latents = torch.randn(LATENTS)
    fast = stage(vae, tile_height=tile, tile_width=tile, overlap=overlap, tile_batch=tile_batch)
    error = (decoded(fast, latents) - diffusers_decode(vae, latents, tile, overlap)).abs()
    assert error.max() < FAST_FLOAT, error.max()


def test_joiner_takes_tiles_in_any_order(vae):
    """Ranks hand tiles over in whatever order they finish: the frames do not depend on it."""
    latents = torch.randn(LATENTS)
    fast = stage(vae, exact=True, tile_batch=1)
    tiles, decoder = [], fast.decoder
    fast.decoder = lambda batch: tiles.append(decoder(batch)[0]) or tiles[-1][None]
    in_order = decoded(fast, latents)
    plan = fast.plan(LATENTS)
    chunks = []
    joiner = ChunkJoiner(plan, chunks.append)
    for item in reversed(range(plan.items)):
        joiner.add(item, tiles[item])
    assert joiner.done and torch.equal(torch.cat(chunks, dim=1), in_order)


def test_stage_frames_equal_the_reference_stage(tiny_model, tmp_path):
    """The registered stage on the tiny model: uint8 frames and audio as the reference stage makes them."""
    from h3gen.inputs.request import Request
    from h3gen.stages.clip import Clip
    from h3gen.plugins.manager import registry as load_registry
    from h3gen.run.render import Runtime
    from h3gen.models.repo import ModelRepo
    from h3gen.run.timing import StageTimer

    registry, repo = load_registry(), ModelRepo(tiny_model)
    runtime = Runtime("cpu", torch.float32, StageTimer("cpu"))
    request = Request(index=0, prompt="p", seed=1, width=352, height=320, frames=39)
    results = {}
    for name, config in (("reference", {}), ("fast", {"exact": True, "tile_batch": 1}), ("fast", {"tile_batch": 3})):
        cls = registry.stage("vae", name)
        vae = cls(cls.Config(**config), runtime)
        vae.load(repo)
        torch.manual_seed(5)  # the same decoder and latents for every stage
        randomize_decoder(vae.vae)
        clip = Clip(request=request, path=tmp_path / "clip.mp4", video_latents=torch.randn(request.video_latent_shape),
                    audio_latents=torch.randn(request.audio_latent_shape))
        results[name, bool(config.get("exact"))] = vae(clip, report=False)
    reference = results["reference", False]
    assert reference.frames.shape == (39, 320, 352, 3)
    for key in (("fast", True), ("fast", False)):
        clip = results[key]
        assert clip.frames.dtype == reference.frames.dtype and clip.frames.shape == reference.frames.shape
        assert (clip.audio == reference.audio).all() and clip.sample_rate == reference.sample_rate
        assert {"vae_video", "vae_audio", "transfer"} <= set(clip.seconds)
    assert (results["fast", True].frames == reference.frames).all()
    difference = abs(results["fast", False].frames.astype(int) - reference.frames.astype(int))
    assert difference.max() <= 1


def test_config_checks():
    from h3gen.errors import UsageError
    from h3gen.run.render import Runtime
    from h3gen.stages.vae import FastVAE, FastVAEConfig
    from h3gen.run.timing import StageTimer

    runtime = Runtime("cpu", torch.float32, StageTimer("cpu"))
    for bad in ({"exact": True, "tile_height": 320}, {"overlap": 256}, {"tile_width": 100}, {"tile_batch": -1},
                {"compile": True}):
        with pytest.raises(UsageError):
            FastVAE(FastVAEConfig(**bad), runtime)
    FastVAE(FastVAEConfig(compile=True, exact_norms=False), runtime)


def test_compiled_block(vae):
    """`compile = true`: the block through torch.compile (one graph for every block) gives the eager decoder's tiles."""
    from h3gen.models.vae.vit import FastViTDecoder

    tiles = torch.randn(3, 24, 7, 4, 5)
    with torch.inference_mode():
        expected = vae.decoder(vae.post_quant_conv(tiles))
        compiled = FastViTDecoder(vae, compile=True)(tiles)
    assert (compiled - expected).abs().max() < FAST_FLOAT


def test_fused_block_rounds_as_the_unfused_one(vae):
    """The eager decoder's fused chain against `block_forward`'s separate ops, bf16 with the float32 islands: on the CPU
    the chain runs the kernels' torch references, which round as the separate ops do, so the tiles are equal (the
    kernels' parity with their references is test_kernels.py's)."""
    from h3gen.models.vae.vit import FastViTDecoder, block_forward

    bf16 = bf16_decoder_on(vae, "cpu")
    tiles = torch.randn(2, 24, 7, 4, 5)
    unfused = FastViTDecoder(bf16)
    unfused.block = block_forward
    with torch.inference_mode():
        expected = unfused(tiles)
        for exact_norms in (False, True):
            assert torch.equal(FastViTDecoder(bf16, exact_norms=exact_norms)(tiles), expected)


def fp8_vae(vae, matmul):
    """A copy of `vae` whose decoder blocks the fp8-rowwise quant stage quantized, as a preset with
    `quant.roles = ["vae"]` loads it."""
    from h3gen.stages.quant import FP8Rowwise, FP8RowwiseConfig

    quant = FP8Rowwise(FP8RowwiseConfig(roles=["vae"], matmul=matmul), SimpleNamespace(device="cpu"))
    quant.load(None)
    quantized = quant.transform("vae", copy.deepcopy(vae))
    assert len(quant.quantized["vae"]) == 6 * 2  # q, k, v, out, up/gate, down in both blocks
    return quantized


def test_fused_linears_compute_their_parts():
    from h3gen.models.quant_linear import FP8RowwiseLinear
    from h3gen.models.vae.vit import fuse_linears

    torch.manual_seed(3)
    x = torch.randn(5, 32)
    for make in (lambda l: l, lambda l: FP8RowwiseLinear.from_linear(l, "reference")):
        parts = [make(torch.nn.Linear(32, n)) for n in (16, 16, 48)]
        with torch.inference_mode():
            expected = torch.cat([part(x) for part in parts], dim=-1)
            fused = fuse_linears(parts)
            assert type(fused) is type(parts[0]) and fused.out_features == 80
            # FP8: one row scale serves all three parts, so they see the same fp8 rows; float32 GEMMs of other
            # widths may sum in another order.
            assert (fused(x) - expected).abs().max() < 1e-6
            assert torch.equal(torch.cat([part(x) for part in parts], dim=-1), expected)
        tensors = dict(fused.named_parameters(), **dict(fused.named_buffers()))
        for name, tensor in tensors.items():  # the parts are views of the fused tensors
            assert getattr(parts[1], name).untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr()


@pytest.mark.parametrize("matmul", ["reference", "scaled_mm"])
def test_fp8_decoder(vae, matmul):
    """FP8 linears in the decoder blocks: the fast decoder rounds as diffusers' decoder on the same quantized
    linears (measured equal; bound 1e-4, as an activation a float32 ulp away can land on the other side of an FP8
    rounding), and both stay within 5 % of the unquantized decode (measured 1.7 % on this tiny decoder)."""
    from h3gen.models.vae.vit import FastViTDecoder

    tiles = torch.randn(3, 24, 7, 4, 5)
    quantized = fp8_vae(vae, matmul)
    with torch.inference_mode():
        expected = vae.decoder(vae.post_quant_conv(tiles))
        reference = quantized.decoder(quantized.post_quant_conv(tiles))
        fast = FastViTDecoder(quantized)(tiles)
    assert (fast - reference).abs().max() < 1e-4
    assert 1e-3 < float((reference - expected).norm() / expected.norm()) < 5e-2


def test_fp8_presets_load_the_decoder_quantized(tiny_model):
    """An FP8 preset's quant stage quantizes the decoder blocks as the VAE stage loads them, and the fast decoder
    runs the fused FP8 projections (their fast accumulation only changes the Hopper GEMM)."""
    from h3gen.plugins.manager import registry as load_registry
    from h3gen.config.preset import resolve
    from h3gen.run.render import Runtime
    from h3gen.models.repo import ModelRepo
    from h3gen.models.quant_linear import FP8RowwiseLinear
    from h3gen.run.timing import StageTimer

    found = load_registry()
    preset = resolve("h3-base-fp8", found, ["runtime.device=cpu"])
    (quant_name, quant_config), (vae_name, vae_config) = preset.stages["quant"], preset.stages["vae"]
    assert quant_config.roles == ["dit", "text_encoder", "vae"] and quant_config.fast_accum
    runtime = Runtime("cpu", torch.float32, StageTimer("cpu"))
    runtime.quant = found.stage("quant", quant_name)(quant_config, runtime)
    runtime.quant.load(ModelRepo(tiny_model))
    vae = found.stage("vae", vae_name)(vae_config, runtime)
    vae.load(ModelRepo(tiny_model))
    assert len(runtime.quant.quantized["vae"]) == 6 * len(vae.vae.decoder.transformer_blocks)
    weights = vae.decoder.weights[0]
    assert all(isinstance(linear, FP8RowwiseLinear) and linear.fast_accum
               for linear in (weights.qkv, weights.out, weights.up_gate, weights.down))
    assert weights.qkv.out_features == 3 * vae.vae.decoder.transformer_blocks[0].attn.to_q.out_features
    # The preset asks for FlashAttention-3's FP8 forward in the decoder; here the run says what runs instead, and why.
    assert vae.load_note().startswith("decoder attention sdpa (fa3-fp8 not used, sdpa instead: ")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_fp8_decoder_blocks_take_their_norms_as_fp8_rows_bit_for_bit(vae, monkeypatch, device):
    """With FP8 linears the residual kernel writes each norm straight as FP8 rows for the projection after it: the
    tiles equal those of quantizing the norm in the linear (on the CPU, the kernels' torch references; on a GPU,
    the Triton kernels)."""
    from h3gen.models.vae import vit

    quantized = fp8_vae(vae, "reference").to(device)
    tiles = torch.randn(2, 24, 7, 4, 5, device=device)
    calls = []
    fused_norm = vit.residual_rmsnorm_quantized
    monkeypatch.setattr(vit, "residual_rmsnorm_quantized", lambda *args: calls.append(1) or fused_norm(*args))
    with torch.inference_mode():
        fused = vit.FastViTDecoder(quantized)(tiles)
        assert len(calls) == 3  # the second norm of each block, and the first of the next
        monkeypatch.setattr(vit, "FP8RowwiseLinear", type("NotFP8", (), {}))
        assert torch.equal(vit.FastViTDecoder(quantized)(tiles), fused) and len(calls) == 3


def test_fa3_fp8_decoder_attends_on_the_norm_kernels_e4m3_heads(vae, monkeypatch):
    """With fa3-fp8 the QK-norm kernel writes q, k and v in e4m3 once per block and attention takes them as they
    are. On the CPU, where fa3-fwd is absent, the decoder falls back and gives `auto`'s tiles; with the backend
    forced and the kernel replaced by its fp32 reference, the tiles stay within e4m3's error of bf16 attention's
    (measured 5.8e-3 here; bound 5e-2)."""
    from h3gen.kernels.attention import Choice
    from h3gen.kernels.attention_fa3_fp8 import attend_fp8_reference
    from h3gen.models.vae import vit

    bf16 = bf16_decoder_on(vae, "cpu")
    tiles = torch.randn(2, 24, 7, 4, 5)
    with torch.inference_mode():
        plain = vit.FastViTDecoder(bf16)(tiles)
        assert torch.equal(vit.FastViTDecoder(bf16, backend="fa3-fp8")(tiles), plain)
        calls = []
        fused_norm = vit.qk_norm_rope_fp8
        monkeypatch.setattr(vit, "choose_backend", lambda *args: Choice("fa3-fp8"))
        monkeypatch.setattr(vit, "attend_fp8", lambda heads: attend_fp8_reference(heads).to(torch.bfloat16))
        monkeypatch.setattr(vit, "qk_norm_rope_fp8", lambda *args: calls.append(1) or fused_norm(*args))
        fp8 = vit.FastViTDecoder(bf16, backend="fa3-fp8")(tiles)
    assert len(calls) == len(bf16.decoder.transformer_blocks)
    assert 1e-4 < norm_relative_error(fp8, plain) < 5e-2


@pytest.mark.cuda
def test_fa3_fp8_decoder_on_the_gpu_is_as_close_as_quantizing_bf16_heads(vae, monkeypatch):
    """On Hopper with fa3-fwd: the decoder's tiles with q, k, v in e4m3 from the norm kernel are as close to bf16
    FA3's as those of attention quantizing the bf16 heads itself (scales from each head's largest value)."""
    from h3gen.kernels.attention import choose_backend
    from h3gen.models.vae import vit

    if choose_backend("cuda", "fa3-fp8", torch.bfloat16, 16).fallback_reason:
        pytest.skip("needs an sm90 GPU and fa3-fwd")
    bf16 = bf16_decoder_on(vae, "cuda")
    tiles = torch.randn(4, 24, 7, 8, 8, device="cuda")
    with torch.inference_mode():
        reference = vit.FastViTDecoder(bf16, backend="fa3")(tiles)
        fused = vit.FastViTDecoder(bf16, backend="fa3-fp8")(tiles)
        monkeypatch.setattr(vit, "choose_backend", lambda *args: choose_backend(args[0], "fa3"))
        quantized_in_attention = vit.FastViTDecoder(bf16, backend="fa3-fp8")(tiles)
    fused_error, unfused_error = norm_relative_error(fused, reference), norm_relative_error(quantized_in_attention, reference)
    assert 0 < fused_error < 5e-2 and 0 < unfused_error < 5e-2
    assert fused_error < 1.25 * unfused_error, (fused_error, unfused_error)
