"""Ulysses sequence parallelism: the DiT forward and a sampler run over 2 and 4 gloo ranks equal one process.

The ranks are processes of their own (torch.multiprocessing spawn, gloo on the CPU); each writes what it computed
and the test compares it with the single-process result here. Packed lengths are odd, so the row slices are uneven.
Measured on this CPU in fp32: bit-equal (relative error 0) at k = 2 and 4 in every variant; the tolerance leaves room
for a GEMM over fewer rows rounding differently on other machines.
"""

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import leave_group
from test_attention_fa3 import on_hopper_with_fa3
from h3gen.errors import UsageError
from h3gen.parallel.ulysses import apply_ulysses, row_counts

# The tiny model has 2 heads; the forward test's DiT has 4 so that k = 4 divides them.
FOUR_HEADS = dict(num_attention_heads=4, attention_head_dim=128, hidden_size=64, num_layers=2, num_refiner_layers=1,
                  ffn_dim=128, text_dim=32, freq_dim=32, time_embed_hidden_dim=64, time_embed_dim=32)
TOLERANCE = 1e-5  # max |ulysses - single| / max |single|, fp32
VARIANTS = ("table", "on-the-fly", "fp8")  # AdaLN table, modulation rows from adaln_proj, fp8-rowwise linears


def relative_error(actual, expected):
    return ((actual - expected).abs().max() / expected.abs().max()).item()


def spawn(worker, ranks, *args):
    mp.spawn(worker, args=(ranks, *args), nprocs=ranks, join=True)


def join_group(rank, ranks, folder):
    torch.set_num_threads(1)  # several ranks share two cores
    dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=rank, world_size=ranks)


def forward_inputs():
    """An fl2va layout from diffusers' builder: 7 text, 6 keyframe, 10 audio and 18 video rows, 41 in all."""
    from diffusers.modular_pipelines.minimax_h3.before_denoise import (MiniMaxH3PrepareLayoutStep,
                                                                       MiniMaxH3SetTimestepsStep)

    text_tags = torch.ones(7, dtype=torch.long)
    positions, tags, video, audio, text, held_video, held_audio = MiniMaxH3PrepareLayoutStep.build_packed_sequence(
        text_tags, 3, 4, 6, 5, (1, 2, 2), 2, 2, 0, ("first",))
    timestep, timestep_indices = MiniMaxH3SetTimestepsStep.build_row_timesteps(
        video, audio, held_video, held_audio, 7, 0.7, 0.4, 0.999, 1.0)
    generator = torch.Generator().manual_seed(1)
    return dict(hidden_states=torch.randn(1, video.numel(), 96, generator=generator),
                audio_hidden_states=torch.randn(1, audio.numel(), 32, generator=generator),
                encoder_hidden_states=torch.randn(1, 7, 32, generator=generator), timestep=timestep,
                timestep_indices=timestep_indices, token_tags=tags, position_ids=positions.float(),
                video_indices=video, audio_indices=audio, text_indices=text)


def load_dit(checkpoint, variant, inputs):
    from h3gen.models.dit.transformer import FastH3Transformer
    from h3gen.stages.quant import SCOPES
    from h3gen.models.quant_linear import FP8RowwiseLinear, swap_linears

    table = variant != "on-the-fly"
    dit = FastH3Transformer.from_pretrained(checkpoint, dtype=torch.float32, use_triton=False, adaln_table=table,
                                            adaln_timesteps=inputs["timestep"] if table else None)
    if variant == "fp8":
        swap_linears(dit, lambda linear: FP8RowwiseLinear.from_linear(linear, matmul="reference"), SCOPES["dit"], ())
    return dit


def forward_worker(rank, ranks, folder):
    """Every variant at k = 2 (ranks 0 and 1) and k = 4; ranks 0-2 also check that k = 3 is refused."""
    join_group(rank, ranks, folder)
    groups = {2: dist.new_group([0, 1]), 3: dist.new_group([0, 1, 2]), 4: dist.group.WORLD}
    inputs = torch.load(f"{folder}/inputs.pt")
    if rank < 3:
        with pytest.raises(UsageError) as refused:
            apply_ulysses(load_dit(f"{folder}/transformer", "table", inputs), groups[3])
        torch.save(str(refused.value), f"{folder}/refused-{rank}.pt")
        del refused  # its traceback holds the group
    for k in (2, 4):
        for variant in VARIANTS:
            if rank < k:
                dit = apply_ulysses(load_dit(f"{folder}/transformer", variant, inputs), groups[k])
                torch.save(dit(**inputs), f"{folder}/{variant}-k{k}-rank{rank}.pt")
                del dit
    del groups
    leave_group()


def save_four_head_dit(folder):
    """diffusers' DiT with FOUR_HEADS, random weights, in `folder`/transformer; the forward's inputs in inputs.pt."""
    from diffusers import MiniMaxH3Transformer3DModel

    torch.manual_seed(0)
    reference = MiniMaxH3Transformer3DModel(**FOUR_HEADS).eval()
    with torch.no_grad():
        for param in reference.parameters():
            param.normal_(0.0, 0.2)  # default zero biases would hide a row's modulation going to another row
    reference.save_pretrained(folder / "transformer")
    inputs = forward_inputs()
    torch.save(inputs, folder / "inputs.pt")
    return inputs


@pytest.fixture(scope="module")
def forward_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ulysses-forward")
    inputs = save_four_head_dit(folder)
    spawn(forward_worker, 4, str(folder))
    return folder, inputs


def test_packed_length_splits_unevenly(forward_run):
    _, inputs = forward_run
    rows = inputs["position_ids"].shape[0]
    assert rows % 2 and rows % 4
    assert row_counts(rows, 4) == [11, 10, 10, 10]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("k", [2, 4])
def test_forward_equals_single_process(forward_run, variant, k):
    folder, inputs = forward_run
    expected = load_dit(folder / "transformer", variant, inputs)(**inputs)
    per_rank = [torch.load(folder / f"{variant}-k{k}-rank{rank}.pt") for rank in range(k)]
    for outputs in per_rank:
        for actual, single in zip(outputs, expected):
            assert actual.shape == single.shape
            assert relative_error(actual, single) < TOLERANCE
    for outputs in per_rank[1:]:  # every rank returns the same velocities, bit for bit
        assert all(torch.equal(a, b) for a, b in zip(outputs, per_rank[0]))


def test_a_group_size_that_does_not_divide_the_heads_is_refused(forward_run):
    folder, _ = forward_run
    for rank in range(3):
        message = torch.load(folder / f"refused-{rank}.pt")
        assert "3 ranks" in message and "4 attention heads" in message and "1, 2, 4" in message


def sampler_for(tiny_model, dit="h3gen"):
    from h3gen.run.render import Runtime
    from h3gen.models.repo import ModelRepo
    from h3gen.stages.quant import NoQuant
    from h3gen.stages.sampler import EulerConfig, EulerSampler
    from h3gen.run.timing import StageTimer

    runtime = Runtime("cpu", torch.float32, StageTimer("cpu"))
    runtime.quant = NoQuant(None, runtime)
    runtime.quant.load(SimpleNamespace(root=None))
    sampler = EulerSampler(EulerConfig(steps=3, dit=dit), runtime)
    sampler.load(ModelRepo(tiny_model))
    return sampler


def t2va_clip(folder):
    from h3gen.inputs.request import Request
    from h3gen.stages.clip import Clip

    clip = Clip(Request(index=0, prompt="probe", seed=5, width=32, height=32, frames=124), folder / "x.mp4")
    clip.prompt_embeds = torch.randn(1, 7, 32, generator=torch.Generator().manual_seed(2))
    clip.text_token_tags = torch.ones(7, dtype=torch.long)
    return clip


def sample(sampler, clip, partition):
    """The sampler's run on `partition`'s DiT: the loop is the same for either partition."""
    sampler.use_partition(partition)
    with torch.inference_mode():
        layout = sampler.layout(clip)
        video_rows, audio_rows = sampler.denoise(clip, layout, *sampler.noise(clip, layout))
        return sampler.unpack(layout, video_rows, audio_rows)


def sampler_worker(rank, ranks, folder, tiny_model):
    join_group(rank, ranks, folder)
    sampler = sampler_for(tiny_model)
    sampler.parallelize(dist.group.WORLD)
    clip = t2va_clip(folder)
    for partition in ("transformer", "transformer_ref"):  # the second is reloaded and made parallel again
        latents = sample(sampler, clip, partition)
        assert sampler.dit.ulysses_slices is not None
        torch.save(latents, f"{folder}/{partition}-rank{rank}.pt")
    del sampler
    leave_group()


def test_sampler_on_two_ranks_gives_the_latents_of_one(tiny_model, tmp_path):
    spawn(sampler_worker, 2, tmp_path, tiny_model)
    sampler, clip = sampler_for(tiny_model), t2va_clip(tmp_path)
    for partition in ("transformer", "transformer_ref"):
        expected = sample(sampler, clip, partition)
        for rank in range(2):
            for actual, single in zip(torch.load(tmp_path / f"{partition}-rank{rank}.pt"), expected):
                assert relative_error(actual, single) < TOLERANCE


def test_the_reference_dit_refuses_ulysses(tiny_model):
    with pytest.raises(UsageError, match='needs sampler.dit = "h3gen"'):
        sampler_for(tiny_model, dit="diffusers").parallelize(group=None)


# FlashAttention-3 on a head slice: two gloo ranks share one GPU (NCCL refuses two ranks on one device; gloo stages
# the all-to-all through host memory), each attending over all rows for 2 of the 4 heads, as 8 ranks attend over 7 of
# the full model's 56. (attention backend, FP8 linears): the presets' bf16 and FP8 DiTs.
GPU_VARIANTS = (("fa3", False), ("fa3-fp8", False), ("fa3-fp8", True))


def gpu_dit(checkpoint, backend, fp8_linears, inputs):
    from h3gen.models.dit.transformer import FastH3Transformer
    from h3gen.models.quant_linear import FP8RowwiseLinear, swap_linears
    from h3gen.stages.quant import SCOPES

    dit = FastH3Transformer.from_pretrained(checkpoint, dtype=torch.bfloat16, device="cuda", use_triton=True,
                                            adaln_timesteps=inputs["timestep"], attention_backend=backend)
    if fp8_linears:
        swap_linears(dit, lambda linear: FP8RowwiseLinear.from_linear(linear, "scaled_mm", fast_accum=True),
                     SCOPES["dit"], ())
    return dit


def gpu_forward(dit, inputs):
    with torch.inference_mode():
        return [output.float().cpu() for output in dit(**inputs)]


def gpu_forward_worker(rank, ranks, folder):
    torch.cuda.set_device(0)
    join_group(rank, ranks, folder)
    inputs = {name: value.cuda() for name, value in torch.load(f"{folder}/inputs.pt").items()}
    for backend, fp8_linears in GPU_VARIANTS:
        dit = apply_ulysses(gpu_dit(f"{folder}/transformer", backend, fp8_linears, inputs), dist.group.WORLD)
        torch.save(gpu_forward(dit, inputs), f"{folder}/{backend}-{fp8_linears}-rank{rank}.pt")
        del dit
    leave_group()


@pytest.mark.cuda
@on_hopper_with_fa3
def test_ulysses_with_fa3_backends_on_one_gpu(tmp_path):
    inputs = save_four_head_dit(tmp_path)
    spawn(gpu_forward_worker, 2, str(tmp_path))
    inputs = {name: value.cuda() for name, value in inputs.items()}
    single = {variant: gpu_forward(gpu_dit(tmp_path / "transformer", *variant, inputs), inputs)
              for variant in GPU_VARIANTS}
    bf16 = single[("fa3", False)]
    for variant in GPU_VARIANTS:
        ranks = [torch.load(tmp_path / f"{variant[0]}-{variant[1]}-rank{rank}.pt") for rank in range(2)]
        assert all(torch.equal(a, b) for a, b in zip(*ranks))  # both ranks return the same velocities
        for ulysses, alone, reference in zip(ranks[0], single[variant], bf16):
            # The ranks quantize the bf16 q, k, v that arrive with the same per-head scales the one process's norm
            # kernel takes, and each GEMM's rows do not depend on how many rows run beside them: measured on an
            # H200, every variant's Ulysses velocities equal the one process's bit for bit (relative error 0; the
            # FP8 variants are 4.9e-3 to 2.3e-2 from the bf16 forward).
            assert relative_error(ulysses, alone) <= 1e-3
            if variant[0] == "fa3-fp8":  # FP8 ran, not a fallback to bf16
                assert 0 < relative_error(alone, reference) <= 5e-2
