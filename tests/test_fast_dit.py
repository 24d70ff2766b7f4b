"""FastH3Transformer against diffusers' MiniMaxH3Transformer3DModel on a tiny random checkpoint and real layouts."""
import pytest
import torch
from diffusers import MiniMaxH3Transformer3DModel
from diffusers.modular_pipelines.minimax_h3.before_denoise import (MiniMaxH3PrepareLayoutStep,
                                                                   MiniMaxH3SetTimestepsStep)

from h3gen.models.dit.transformer import FastH3Transformer
from h3gen.models.dit.blocks import EXACT_NORM_OPS

TINY = dict(num_attention_heads=2, attention_head_dim=128, hidden_size=64, num_layers=2, num_refiner_layers=1,
            ffn_dim=128, text_dim=32, freq_dim=32, time_embed_hidden_dim=64, time_embed_dim=32)
FP32_TOLERANCE = 1e-5  # max |fast - diffusers| / max |diffusers|
BF16_TOLERANCE = 2e-2
TEXT_TOKENS = 8


def relative_error(actual, expected):
    return ((actual.float() - expected.float()).abs().max() / expected.float().abs().max()).item()


def random_reference(seed=0):
    torch.manual_seed(seed)
    model = MiniMaxH3Transformer3DModel(**TINY).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.2)  # the default zero biases would hide modulation-row mix-ups
    return model


def layout_inputs(video_timestep=0.7, audio_timestep=0.4, keyframes=("first",), seed=1):
    """A t2va/fl2va packed layout from diffusers' own layout builder, with random latents."""
    text_tags = torch.ones(TEXT_TOKENS, dtype=torch.long)
    text_tags[5:] = 0  # a keyframe's vision rows inside the text are tagged video
    positions, tags, video_idx, audio_idx, text_idx, cond_video, cond_audio = (
        MiniMaxH3PrepareLayoutStep.build_packed_sequence(text_tags, 3, 4, 6, 5, (1, 2, 2), 2, 2, 0, keyframes))
    timestep, timestep_indices = MiniMaxH3SetTimestepsStep.build_row_timesteps(
        video_idx, audio_idx, cond_video, cond_audio, TEXT_TOKENS, video_timestep, audio_timestep,
        max(video_timestep, 0.9), 1.0)
    generator = torch.Generator().manual_seed(seed)
    return dict(
        hidden_states=torch.randn(1, video_idx.numel(), 96, generator=generator),
        audio_hidden_states=torch.randn(1, audio_idx.numel(), 32, generator=generator),
        encoder_hidden_states=torch.randn(1, TEXT_TOKENS, 32, generator=generator),
        timestep=timestep, timestep_indices=timestep_indices, token_tags=tags, position_ids=positions.float(),
        video_indices=video_idx, audio_indices=audio_idx, text_indices=text_idx)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("transformer")
    random_reference().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def reference(checkpoint):
    return MiniMaxH3Transformer3DModel.from_pretrained(checkpoint).eval()


def reference_outputs(model, inputs):
    with torch.no_grad():
        return model(**inputs, return_dict=False)


def assert_matches(fast, reference, inputs, tolerance=FP32_TOLERANCE):
    expected = reference_outputs(reference, inputs)
    actual = fast(**inputs)
    for a, e in zip(actual, expected):
        assert a.shape == e.shape and a.dtype == e.dtype
        assert relative_error(a, e) < tolerance


@pytest.mark.parametrize("use_triton", [False, True])
@pytest.mark.parametrize("keyframes", [(), ("first",), ("first", "last")])
def test_fp32_matches_diffusers(checkpoint, reference, use_triton, keyframes):
    fast = FastH3Transformer.from_pretrained(checkpoint, dtype=torch.float32, use_triton=use_triton)
    assert_matches(fast, reference, layout_inputs(keyframes=keyframes))


def test_fp32_matches_diffusers_with_adaln_tables(checkpoint, reference):
    schedule = [layout_inputs(video_timestep=v, audio_timestep=a) for v, a in ((1.0, 1.0), (0.7, 0.4), (0.2, 0.05))]
    timesteps = torch.cat([inputs["timestep"] for inputs in schedule])
    fast = FastH3Transformer.from_pretrained(checkpoint, dtype=torch.float32)
    params_before = sum(p.numel() for p in fast.parameters())
    fast.precompute_adaln(timesteps)
    assert all(block.adaln_proj is None for block in fast.transformer_blocks)
    assert sum(p.numel() for p in fast.parameters()) < params_before
    for inputs in schedule:
        assert_matches(fast, reference, inputs)

    built_while_loading = FastH3Transformer.from_pretrained(checkpoint, dtype=torch.float32, adaln_timesteps=timesteps)
    for inputs in schedule:
        assert_matches(built_while_loading, reference, inputs)


def test_timestep_outside_adaln_table_errors(checkpoint):
    inputs = layout_inputs()
    fast = FastH3Transformer.from_pretrained(checkpoint, dtype=torch.float32)
    fast.precompute_adaln(inputs["timestep"])
    fast(**inputs)
    with pytest.raises(ValueError, match="not in the AdaLN table"):
        fast(**{**inputs, "timestep": inputs["timestep"] + 1e-3})
    with pytest.raises(ValueError, match="already dropped"):
        fast.precompute_adaln([0.123])


def test_timestep_outside_table_uses_weights_when_kept(checkpoint, reference):
    fast = FastH3Transformer.from_pretrained(checkpoint, dtype=torch.float32)
    fast.precompute_adaln([0.5], drop_weights=False)
    assert_matches(fast, reference, layout_inputs())


def test_from_reference_empties_source_and_matches(checkpoint, reference):
    inputs = layout_inputs(keyframes=("first", "last"))
    expected = reference_outputs(reference, inputs)
    source = MiniMaxH3Transformer3DModel.from_pretrained(checkpoint).eval()
    fast = FastH3Transformer.from_reference(source)
    assert sum(p.numel() for p in source.parameters()) == 0
    for a, e in zip(fast(**inputs), expected):
        assert relative_error(a, e) < FP32_TOLERANCE


def test_sharded_checkpoint_loads(tmp_path, reference):
    random_reference().save_pretrained(tmp_path, max_shard_size="100KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    assert list(tmp_path.glob("*.index.json"))
    fast = FastH3Transformer.from_pretrained(tmp_path, dtype=torch.float32)
    assert_matches(fast, reference, layout_inputs())


def test_bf16_keeps_fp32_modules_and_tracks_diffusers(checkpoint):
    fast = FastH3Transformer.from_pretrained(checkpoint, dtype=torch.bfloat16)
    fp32 = {name for name, p in fast.named_parameters() if p.dtype == torch.float32}
    assert fp32 == {f"{m}.{w}" for m in ("proj_in", "audio_proj_in", "proj_out", "audio_proj_out",
                                         "time_embedder.linear_1", "time_embedder.linear_2") for w in ("weight", "bias")}
    reference = MiniMaxH3Transformer3DModel.from_pretrained(checkpoint, torch_dtype=torch.bfloat16).eval()
    assert_matches(fast, reference, layout_inputs(), tolerance=BF16_TOLERANCE)


@pytest.mark.parametrize("table, exact_norms", [(False, False), (True, False), (True, True)])
def test_bf16_t2va_equals_diffusers_bit_for_bit(checkpoint, table, exact_norms):
    """The kernels' torch references (what runs off CUDA) round where diffusers rounds, the fused projections give
    its numbers, and a table group built for the forward's own timesteps gives its modulation rows: no tolerance.
    With `exact_norms` the ops hand torch's norm statistics to the kernels (which on CUDA read them)."""
    inputs = layout_inputs(keyframes=())
    fast = FastH3Transformer.from_pretrained(checkpoint, dtype=torch.bfloat16, exact_norms=exact_norms,
                                             adaln_timesteps=(inputs["timestep"].tolist(),) if table else None)
    assert (fast.transformer_blocks[0].adaln_proj is None) == table
    assert (fast.transformer_blocks[0].ops is EXACT_NORM_OPS) == exact_norms
    reference = MiniMaxH3Transformer3DModel.from_pretrained(checkpoint, torch_dtype=torch.bfloat16).eval()
    for actual, expected in zip(fast(**inputs), reference_outputs(reference, inputs)):
        assert torch.equal(actual, expected)


def test_unknown_checkpoint_tensor_errors(tmp_path):
    from safetensors.torch import save_file

    model = random_reference()
    model.save_pretrained(tmp_path)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    state["transformer_blocks.0.attn.to_extra.weight"] = torch.zeros(1)
    save_file(state, str(tmp_path / "diffusion_pytorch_model.safetensors"))
    with pytest.raises(ValueError, match="does not use"):
        FastH3Transformer.from_pretrained(tmp_path, dtype=torch.float32)


def test_forward_reads_the_adaln_group_built_for_its_timesteps(checkpoint, reference):
    """A group holding exactly one forward's timesteps was projected in that forward's batch shape, so the forward
    reads its rows there even when another group holds the same values (a GEMM may round by its row count)."""
    inputs = layout_inputs(video_timestep=0.7, audio_timestep=0.4, keyframes=())
    fast = FastH3Transformer.from_pretrained(checkpoint, dtype=torch.float32)
    fast.precompute_adaln(([0.4, 0.7, 0.9], [0.4, 0.7]))
    assert fast.adaln_groups == {(0.4000000059604645, 0.699999988079071, 0.8999999761581421): 0,
                                 (0.4000000059604645, 0.699999988079071): 3}
    index, from_table = fast.adaln_index(inputs["timestep"], inputs["timestep_indices"], inputs["token_tags"])
    assert from_table
    assert torch.equal(index, (3 + inputs["timestep_indices"]) * 3 + inputs["token_tags"])
    assert_matches(fast, reference, inputs)
    # A forward no group matches finds each of its values by value.
    index, _ = fast.adaln_index(torch.tensor([0.9]), torch.zeros_like(inputs["timestep_indices"]), inputs["token_tags"])
    assert torch.equal(index, 2 * 3 + inputs["token_tags"])


def test_feed_forward_over_row_chunks_matches_diffusers(checkpoint, reference):
    inputs = layout_inputs()
    fast = FastH3Transformer.from_pretrained(checkpoint, dtype=torch.float32, ffn_chunk_rows=7)
    assert inputs["position_ids"].shape[0] > 2 * 7 and all(b.ff.chunk_rows == 7 for b in fast.transformer_blocks)
    assert_matches(fast, reference, inputs)
    with pytest.raises(ValueError, match="ffn_chunk_rows must be 0"):
        fast.configure(ffn_chunk_rows=-1)
