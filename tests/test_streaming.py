"""DiT blocks streamed from host memory change where the weights live, never what is computed: a streamed forward,
a streamed clip and a streamed cached clip are the resident ones bit for bit."""

import pytest
import torch

from conftest import h3gen
from test_step_cache import run, sampler_for, with_cache
from test_ulysses import t2va_clip


def streamed(sampler, count):
    sampler.dit.stream_blocks(count)
    return sampler


def test_streamed_blocks_give_the_resident_latents_bit_for_bit(tiny_model, tmp_path):
    clip = t2va_clip(tmp_path)
    resident, _ = run(with_cache(sampler_for(tiny_model), "none"), clip)
    for count in (1, 2):
        latents, _ = run(streamed(with_cache(sampler_for(tiny_model), "none"), count), clip)
        assert all(torch.equal(a, b) for a, b in zip(latents, resident)), count
    cached, reused = run(with_cache(sampler_for(tiny_model, steps=4), "schedule", steps=[0, 2]), clip)
    both, both_reused = run(streamed(with_cache(sampler_for(tiny_model, steps=4), "schedule", steps=[0, 2]), 2), clip)
    assert reused == both_reused == 1 and all(torch.equal(a, b) for a, b in zip(both, cached))


def test_a_streamed_block_holds_host_tensors_between_forwards(tiny_model):
    sampler = streamed(with_cache(sampler_for(tiny_model), "none"), 1)
    block = sampler.dit.transformer_blocks[-1]
    assert sampler.dit.streamer.streams(1) and not sampler.dit.streamer.streams(0)
    assert block.adaln_table is not None  # resident: indexed every forward
    weights = [p for p in block.parameters()]
    assert weights and all(p.device.type == "cpu" for p in weights)


def test_a_clip_rendered_with_streamed_blocks_is_byte_identical(prompts_file, tmp_path):
    prompts = prompts_file("a red fox\n")
    for name, count in (("resident", 0), ("streamed", 2)):
        h3gen("render", prompts, "-o", tmp_path / name, "--set", "sampler.dit=h3gen",
              "--set", f"sampler.stream_blocks={count}", check_code=0)
    (a,), (b,) = (list((tmp_path / name).glob("*.mp4")) for name in ("resident", "streamed"))
    assert a.read_bytes() == b.read_bytes()


@pytest.mark.parametrize("count, problem, fix", [
    (99, "sampler.stream_blocks is 99, and the DiT in {model}/transformer has 2 blocks",
     "set sampler.stream_blocks from 0 to 2; 2 streams every block"),
    (-1, "sampler.stream_blocks is -1", "set it to 0 to keep every block resident, or to a count of blocks to stream")])
def test_blocks_to_stream_that_the_dit_does_not_have_are_refused_before_a_run(prompts_file, tmp_path, tiny_model,
                                                                              count, problem, fix):
    refused = h3gen("render", prompts_file("a red fox\n"), "-o", tmp_path / "out", "--dry-run", "--set",
                    "sampler.dit=h3gen", "--set", f"sampler.stream_blocks={count}", check_code=2)
    assert refused.stderr.splitlines()[-1] == \
        f"h3gen: error: --set sampler.stream_blocks: {problem.format(model=tiny_model)} ({fix})"


def test_streamed_blocks_leave_for_host_memory_as_they_load(tiny_model, monkeypatch):
    # Each block is placed (quantized) and, when it streams, moved to host memory before the next block is read:
    # a DiT larger than the device loads one block at a time.
    from h3gen.models.dit.streaming import BlockStreamer
    from h3gen.models.dit.transformer import FastH3Transformer

    events, take = [], BlockStreamer.take
    monkeypatch.setattr(BlockStreamer, "take", lambda self, index: (events.append(("host", index)), take(self, index)))
    dit = FastH3Transformer.from_pretrained(tiny_model / "transformer", dtype=torch.float32, adaln_timesteps=[0.5],
                                            place_block=lambda index, block: events.append(("placed", index)),
                                            stream_blocks=1)
    assert events == [("placed", 0), ("placed", 1), ("host", 1)]
    assert all(p.device.type == "cpu" and not p.is_meta for p in dit.transformer_blocks[1].parameters())
    assert dit.transformer_blocks[1].adaln_table is not None and dit.streamer.slots


def encode_streamed_and_resident(tiny_model, device):
    """The prompt's embeddings from the tiny encoder with FP8 layers, resident and streamed, on `device`; and the
    streamed encoder's language layers after their forward."""
    from h3gen.config.preset import resolve
    from h3gen.inputs.request import Request
    from h3gen.models.repo import ModelRepo
    from h3gen.plugins.manager import registry
    from h3gen.run.render import Runtime
    from h3gen.run.timing import StageTimer
    from h3gen.stages.clip import Clip

    found, repo, embeds = registry(), ModelRepo(tiny_model), {}
    for stream in (False, True):
        preset = resolve("tiny", found, ["quant.use=fp8-rowwise", "quant.roles=['text_encoder']", "encode.cache=false",
                                         f"encode.stream_layers={str(stream).lower()}"])
        runtime = Runtime(device, torch.float32 if device == "cpu" else torch.bfloat16, StageTimer(device))
        runtime.quant = found.stage("quant", "fp8-rowwise")(preset.stages["quant"][1], runtime)
        runtime.quant.load(repo)
        encode = found.stage("encode", "qwen3vl")(preset.stages["encode"][1], runtime)
        encode.load(repo)
        clip = Clip(request=Request(index=0, prompt="a red fox", seed=0, width=32, height=32, frames=124, id="f"),
                    path=None, preset="tiny")
        embeds[stream] = encode.run(clip).prompt_embeds
        layers = encode.text_encoder.model.language_model.layers
        assert len(runtime.quant.quantized["text_encoder"]) == 7 * len(layers)  # q, k, v, o, gate, up, down
        assert hasattr(layers[0], "_diffusers_hook") == stream
    return embeds, layers


def test_a_streamed_text_encoder_gives_the_resident_embeddings_bit_for_bit(tiny_model):
    # The layers pass through diffusers' group offloading, each quantized (FP8 here) as it is first placed.
    embeds, _ = encode_streamed_and_resident(tiny_model, "cpu")
    assert torch.equal(embeds[False], embeds[True])


@pytest.mark.cuda
def test_on_a_gpu_a_streamed_text_encoder_returns_its_layers_to_host_memory(tiny_model):
    # With a side stream, group offloading returns only parameters to host memory: the FP8 weights are parameters.
    embeds, layers = encode_streamed_and_resident(tiny_model, "cuda")
    assert torch.equal(embeds[False], embeds[True])
    assert {t.device.type for t in (*layers.parameters(), *layers.buffers())} == {"cpu"}


def test_group_offloading_over_the_dit_gives_the_resident_latents_bit_for_bit(tiny_model, tmp_path):
    # sampler.stream_with = "diffusers": the comparison with h3gen's own streamer runs the same numbers.
    from h3gen.models.offload import group_offload_blocks

    clip = t2va_clip(tmp_path)
    resident, _ = run(with_cache(sampler_for(tiny_model), "none"), clip)
    sampler = with_cache(sampler_for(tiny_model), "none")
    group_offload_blocks(sampler.dit, "cpu")
    assert hasattr(sampler.dit.transformer_blocks[0], "_diffusers_hook")
    latents, _ = run(sampler, clip)
    assert all(torch.equal(a, b) for a, b in zip(latents, resident))


def streamed_group_worker(rank, ranks, folder, tiny_model):
    from test_ulysses import join_group, leave_group

    join_group(rank, ranks, folder)
    clip, results = t2va_clip(folder), []
    for count in (0, 2):  # each rank streams its own copy of the blocks
        sampler = streamed(with_cache(sampler_for(tiny_model), "none"), count)
        sampler.parallelize(torch.distributed.group.WORLD)
        results.append(run(sampler, clip)[0])
        del sampler
    torch.save(results, f"{folder}/streamed-rank{rank}.pt")
    leave_group()


def test_a_ulysses_group_streaming_its_blocks_gives_the_group_s_resident_latents(tiny_model, tmp_path):
    from test_ulysses import spawn

    spawn(streamed_group_worker, 2, tmp_path, tiny_model)
    for rank in range(2):
        resident, streamed_latents = torch.load(tmp_path / f"streamed-rank{rank}.pt")
        assert all(torch.equal(a, b) for a, b in zip(resident, streamed_latents))


@pytest.mark.cuda
def test_on_a_gpu_a_clip_under_a_budget_with_streamed_blocks_and_encoder_is_the_resident_clip(prompts_file, tmp_path):
    from conftest import media

    prompts = prompts_file("a red fox\n")
    # No embedding cache: the streamed run encodes the prompt itself rather than reading the resident run's.
    common = ("--set", "runtime.device=cuda", "--set", "sampler.dit=h3gen", "--set", "encode.cache=false", "--json")
    resident = h3gen("render", prompts, "-o", tmp_path / "resident", *common, check_code=0)
    streamed = h3gen("render", prompts, "-o", tmp_path / "streamed", *common, "--vram", "4", "--set",
                     "sampler.stream_blocks=2", "--set", "encode.stream_layers=true", check_code=0)
    import json

    record = json.loads(streamed.stdout.splitlines()[0])
    assert record["memory_plan"]["vram_gib"] == 4.0 and record["memory_plan"]["asked"]
    assert json.loads(resident.stdout.splitlines()[0])["memory_plan"]["asked"] is False
    (a,), (b,) = (list((tmp_path / name).glob("*.mp4")) for name in ("resident", "streamed"))
    assert media(a) == media(b)


@pytest.mark.cuda
def test_on_a_gpu_group_offloading_over_an_fp8_dit_gives_the_resident_clip(prompts_file, tmp_path):
    # With a side stream, group offloading moves parameters only: the FP8 weights are parameters, so they move.
    from conftest import media

    prompts = prompts_file("a red fox\n")
    common = ("--set", "runtime.device=cuda", "--set", "sampler.dit=h3gen", "--set", "quant.use=fp8-rowwise",
              "--set", "quant.roles=['dit']")
    h3gen("render", prompts, "-o", tmp_path / "resident", *common, check_code=0)
    h3gen("render", prompts, "-o", tmp_path / "offloaded", *common, "--set", "sampler.stream_blocks=2", "--set",
          "sampler.stream_with=diffusers", check_code=0)
    (a,), (b,) = (list((tmp_path / name).glob("*.mp4")) for name in ("resident", "offloaded"))
    assert media(a) == media(b)


def test_an_adapter_fused_at_load_streams_with_its_block(tiny_model, tmp_path):
    """A full-rank delta on a streamed block's weight is fused as the block loads, before it is quantized and moved
    to host memory: the streamed FP8 clip's latents are the resident one's, and the adapter shows in both."""
    from safetensors.torch import load_file, save_file

    from test_quant import tiny_dit

    last = len(tiny_dit(tiny_model, torch.float32).transformer_blocks) - 1
    weight = tiny_dit(tiny_model, torch.float32).transformer_blocks[last].attn.to_out[0].weight
    adapter = tmp_path / "delta.safetensors"
    delta = torch.randn(weight.shape, generator=torch.Generator().manual_seed(7))
    save_file({f"transformer.transformer_blocks.{last}.attn.to_out.0.diff": delta}, str(adapter))
    (tmp_path / "p.txt").write_text('{"id": "fox", "prompt": "a fox"}\n')
    latents = {}
    for name, options in (("plain", []), ("resident", [f'adapter.paths=["{adapter}"]']),
                          ("streamed", [f'adapter.paths=["{adapter}"]', "sampler.stream_blocks=1"])):
        sets = [arg for option in ["quant.use=fp8-rowwise", 'sampler.dit="h3gen"', *options]
                for arg in ("--set", option)]
        h3gen("render", tmp_path / "p.txt", "-o", tmp_path / name, "--model", tiny_model, "--preset", "tiny",
              "--save-latents", *sets, check_code=0)
        latents[name] = load_file(str(tmp_path / name / "fox.latents.safetensors"))
    assert all(torch.equal(latents["streamed"][key], latents["resident"][key]) for key in ("video", "audio"))
    assert not torch.equal(latents["resident"]["video"], latents["plain"]["video"])
