"""The step cache: a forward's middle blocks skipped for the residual they added last time. Off (threshold 0, or a
schedule of every forward) it gives the uncached clip bit for bit; a schedule computes exactly the forwards it lists;
a Ulysses group takes every decision together; adapters and diffusers' DiT refuse it."""

import json

import pytest
import torch

from conftest import h3gen
from test_ulysses import TOLERANCE, join_group, leave_group, relative_error, sample, spawn, t2va_clip


def sampler_for(tiny_model, steps=3):
    """h3gen's DiT under the Euler sampler on the tiny model: `steps` sigma points, `steps - 1` forwards."""
    from types import SimpleNamespace

    from h3gen.models.repo import ModelRepo
    from h3gen.run.render import Runtime
    from h3gen.run.timing import StageTimer
    from h3gen.stages.quant import NoQuant
    from h3gen.stages.sampler import EulerConfig, EulerSampler

    runtime = Runtime("cpu", torch.float32, StageTimer("cpu"))
    runtime.quant = NoQuant(None, runtime)
    runtime.quant.load(SimpleNamespace(root=None))
    sampler = EulerSampler(EulerConfig(steps=steps, dit="h3gen"), runtime)
    sampler.load(ModelRepo(tiny_model))
    return sampler


def with_cache(sampler, name, **values):
    from h3gen.stages.cache import NoCache, ResidualCache, ScheduleCache

    stage = {"none": NoCache, "residual": ResidualCache, "schedule": ScheduleCache}[name]
    sampler.runtime.cache = stage(stage.Config(**values), sampler.runtime)
    return sampler


def run(sampler, clip):
    latents = sample(sampler, clip, "transformer")
    return latents, clip.forwards_reused


def middle_block_calls(sampler) -> list:
    calls = []
    sampler.dit.transformer_blocks[1].register_forward_hook(lambda *args: calls.append(1))
    return calls


def test_a_cache_that_never_reuses_gives_the_uncached_latents_bit_for_bit(tiny_model, tmp_path):
    clip = t2va_clip(tmp_path)
    plain, _ = run(with_cache(sampler_for(tiny_model), "none"), clip)
    for name, values in (("residual", dict(threshold=0.0, first_blocks=1, compute_first=0, compute_last=0)),
                         ("schedule", dict(steps=[0, 1, 2]))):
        cached, reused = run(with_cache(sampler_for(tiny_model), name, **values), clip)
        assert reused == 0 and all(torch.equal(a, b) for a, b in zip(cached, plain)), name


def test_a_schedule_computes_exactly_the_forwards_it_lists(tiny_model, tmp_path):
    sampler = with_cache(sampler_for(tiny_model, steps=4), "schedule", steps=[0, 2])
    calls, clip = middle_block_calls(sampler), t2va_clip(tmp_path)
    _, reused = run(sampler, clip)
    assert len(calls) == 2 and reused == 1 and clip.forwards == 3


def test_the_residual_cache_keeps_its_limits(tiny_model, tmp_path):
    sampler = with_cache(sampler_for(tiny_model, steps=9), "residual", threshold=1e9, first_blocks=1, max_reuse=2,
                         compute_first=2, compute_last=1)
    calls, clip = middle_block_calls(sampler), t2va_clip(tmp_path)
    _, reused = run(sampler, clip)
    # computed 0, 1 (first two), reused 2, 3, computed 4 (two in a row), reused 5, 6, computed 7 (the last)
    assert reused == 4 and len(calls) == 4


def cache_worker(rank, ranks, folder, tiny_model):
    join_group(rank, ranks, folder)
    sampler = with_cache(sampler_for(tiny_model), "residual", threshold=0.5, first_blocks=1, compute_first=1,
                         compute_last=0, max_reuse=1)
    sampler.parallelize(torch.distributed.group.WORLD)
    clip = t2va_clip(folder)
    torch.save(run(sampler, clip), f"{folder}/cache-rank{rank}.pt")
    del sampler
    leave_group()


def test_a_ulysses_group_decides_together_and_gives_the_latents_of_one(tiny_model, tmp_path):
    spawn(cache_worker, 2, tmp_path, tiny_model)
    sampler = with_cache(sampler_for(tiny_model), "residual", threshold=0.5, first_blocks=1, compute_first=1,
                         compute_last=0, max_reuse=1)
    expected, reused = run(sampler, t2va_clip(tmp_path))
    assert reused == 1  # the metric on random weights is far under 0.5: one forward in reuses
    for rank in range(2):
        latents, rank_reused = torch.load(tmp_path / f"cache-rank{rank}.pt")
        assert rank_reused == reused
        for actual, single in zip(latents, expected):
            assert relative_error(actual, single) < TOLERANCE


def test_a_cache_is_refused_by_diffusers_dit_and_by_adapters_that_do_not_allow_it(prompts_file, tmp_path):
    from h3gen.config.contract import check_cache
    from h3gen.config.preset import resolve
    from h3gen.errors import UsageError
    from h3gen.plugins.manager import registry

    result = h3gen("render", prompts_file("x\n"), "-o", tmp_path / "out", "--set", "cache.use=residual",
                   check_code=2)
    assert result.stderr.endswith('--set cache.use=residual: the step cache runs on sampler.dit = "h3gen" (--set '
                                  'sampler.dit=h3gen), and this preset has "diffusers" (set cache.use=none)\n')
    found = registry()
    with pytest.raises(UsageError, match="whose contract does not allow a step cache"):
        check_cache(resolve("fasth3", found, ["cache.use=residual"]), found)
    check_cache(resolve("fasth3", found, ["cache.use=residual", "adapter.cache=true"]), found)


@pytest.mark.parametrize("dry", [[], ["--dry-run"]])
def test_a_schedule_of_forwards_past_the_run_s_last_is_refused(prompts_file, tmp_path, dry):
    result = h3gen("render", prompts_file("x\n"), "-o", tmp_path / "out", "--set", "sampler.dit=h3gen", "--set",
                   "cache.use=schedule", "--set", "cache.steps=[0, 1, 7]", *dry, check_code=2)
    assert result.stderr == ("h3gen: error: preset tiny: cache.steps lists forward 7, and the run has 3 forwards "
                             "(0 to 2) (list forwards below 3, or raise sampler.steps)\n")
    assert not (tmp_path / "out").exists()


def test_each_clip_reports_its_reused_forwards(prompts_file, tmp_path):
    out = tmp_path / "out"
    result = h3gen("render", prompts_file("a fox\n"), "-o", out, "--json", "--set", "sampler.dit=h3gen",
                   "--set", "cache.use=schedule", "--set", "cache.steps=[0, 2]", check_code=0)
    (record,) = map(json.loads, result.stdout.splitlines())
    (line,) = map(json.loads, (out / "manifest.jsonl").read_text().splitlines())
    assert (record["forwards"], record["forwards_reused"]) == (line["forwards"], line["forwards_reused"]) == (3, 1)
    assert "1 of 3 forwards reused" in result.stderr
