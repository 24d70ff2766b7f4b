"""`h3gen bench`: every preset and the diffusers baseline through the same harness, in one run, on one device.

Stages run one at a time (load, warm up, time `repeat` runs, unload) so components that do not fit in memory
together can still be measured; end to end is the sum of the stage times of each repeat. With `forwards=K`,
K DiT forwards are timed and scaled to the preset's own forward count; the sampler's work outside its forwards (the
packed layout, the seeded noise, the steps) is counted once a clip, and `per_forward_s` is a forward alone.
"""

from __future__ import annotations

import dataclasses
import gc
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

from h3gen.inputs.request import AUDIO_CHANNELS, SAMPLE_RATE, Request, frames_for_duration
from h3gen.stages.clip import FORWARDS_PART, PIPELINE, Clip
from h3gen.run.render import Runtime, pick_device
from h3gen.run.timing import StageTimer

SAMPLES_PER_AUDIO_LATENT = 800
RECORD_STAGES = ("encode", "dit", "cache_check", "vae_video", "vae_audio", "transfer", "mux", "e2e")


@dataclasses.dataclass
class BenchPlan:
    presets: list[str]
    baseline: str | None = "diffusers"
    durations: list[float] = dataclasses.field(default_factory=lambda: [10.0])
    width: int = 1344
    height: int = 768
    repeat: int = 3
    warmup: int = 1
    stages: tuple[str, ...] = ("encode", "dit", "vae", "mux")
    forwards: int | None = None
    text_tokens: int = 256
    seed: int = 1101
    warm_cache: bool = False  # --batch: each batch twice over one fresh embedding cache, cold then warm
    baseline_clips: int | None = None  # --batch: the baseline's clip count, when not the batch's
    baseline_forwards: int | None = None  # --batch: the baseline's forwards per clip, when not `forwards`
    overrides: list[str] = dataclasses.field(default_factory=list)  # --set, on every preset but the baseline

    def preset(self, name: str, baseline: bool, registry, *more: str):
        """The preset as measured: the plan's overrides (not on the baseline), then `more`."""
        from h3gen.config.preset import resolve

        return resolve(name, registry, ([] if baseline else self.overrides) + list(more))


def forward_overrides(preset, forwards: int | None, registry) -> list[str]:
    """Overrides that make the sampler run `forwards` forwards (per-forward time does not depend on sigma). A preset
    whose step cache reuses runs all its forwards: a reused forward costs less than a computed one."""
    if not forwards or reuses_forwards(preset, registry):
        return []
    overrides = [f"sampler.steps={forwards + 1}"]
    if hasattr(preset.stages["sampler"][1], "sigma_positions"):
        overrides.append("sampler.sigma_positions=[]")
    return overrides


def cache_overrides(preset, cache_dir=None) -> list[str]:
    """The benchmark times the text encoder itself, never the embedding cache, unless it is handed a cache directory
    to fill (and read back)."""
    config = preset.stages["encode"][1]
    if cache_dir is None:
        return ["encode.cache=false"] if hasattr(config, "cache") else []
    return [f"encode.cache_dir={str(cache_dir)!r}"] if hasattr(config, "cache_dir") else []


def adapter_overrides(random_weights: str | None) -> list[str]:
    """Random weights have no adapters to fuse; fusing happens at load, so a forward costs the same without them."""
    return ["adapter.paths=[]"] if random_weights else []


def add_probe_options(parser) -> None:
    """The options of a probe that builds its renderer with `probe_renderer`: the preset, and --tiny and --set."""
    parser.add_argument("--preset", default="fasth3-fp8")
    parser.add_argument("--tiny", action="store_true", help="the tiny model (a smoke run on the CPU)")
    parser.add_argument("--set", action="append", default=[], help="a preset override, as `h3gen render --set`")


def probe_renderer(name: str, forwards: int, sets=(), tiny: bool = False):
    """A renderer of preset `name` at `forwards` DiT forwards a clip, as a bench run makes it, for the probes under
    bench/: the full-size architecture with random weights, or with `tiny` the tiny model (a smoke run on the CPU).
    `sets`: overrides as `--set` gives them."""
    from h3gen.bench.random_weights import FullSizeRandom
    from h3gen.config.preset import resolve
    from h3gen.models.repo import ModelRepo
    from h3gen.models.tiny import ensure_tiny_model
    from h3gen.plugins.manager import registry
    from h3gen.run.render import Renderer
    from h3gen.run.report import SilentReporter

    found = registry()
    preset = resolve(name, found)
    overrides = forward_overrides(preset, forwards, found) + cache_overrides(preset) + list(sets)
    preset = resolve(name, found, overrides + ([] if tiny else adapter_overrides("full")))
    model = ModelRepo(ensure_tiny_model())
    return Renderer(preset, found, model if tiny else FullSizeRandom(model), SilentReporter())


def reuses_forwards(preset, registry) -> bool:
    name = preset.stages.get("cache", ("none", None))[0]
    return registry.stage("cache", name).reuses


def preset_forwards(preset) -> int:
    from h3gen.stages.sampler import forwards

    config = preset.stages["sampler"][1]
    return forwards(config)


class StageBench:
    """Times one preset at one request, stage by stage."""

    def __init__(self, preset, registry, source, plan: BenchPlan, request: Request, workdir: Path, say=print):
        import torch

        from h3gen.run import budget

        self.plan, self.source, self.request, self.say = plan, source, request, say
        device = pick_device(preset.runtime["device"])
        budget.hold_to(device, preset.runtime["vram_gib"])  # the process's cap is set for every preset anew
        self.memory_plan = budget.planned(preset, [request], source, device)
        self.runtime = Runtime(device, getattr(torch, preset.runtime["dtype"]), StageTimer(device))
        if self.memory_plan is not None:
            say(f"bench:   {self.memory_plan.describe()}{self.allocated()}")
        self.stages = {kind: registry.stage(kind, name)(config, self.runtime)
                       for kind, (name, config) in preset.stages.items()}
        self.runtime.quant, self.runtime.cache = self.stages["quant"], self.stages["cache"]
        self.stages["quant"].load(source)
        self.clip = Clip(request=request, path=workdir / "bench.mp4", preset=preset.name)
        self.peaks: dict[str, float] = {}
        self.host: dict[str, float] = {}  # the process's resident host GiB once each stage has loaded and has run
        self.forwards_run = self.forwards_reused = 0

    def run(self) -> list[dict[str, float]]:
        """Per repeat, the seconds of every stage and part of a stage that ran."""
        runs = [{} for _ in range(self.plan.repeat)]
        for kind in PIPELINE:
            wanted = "dit" if kind == "sampler" else kind
            if wanted not in self.plan.stages:
                self.stand_in(kind)
                continue
            for index, seconds in enumerate(self.time_stage(kind)):
                runs[index].update(seconds)
        return runs

    def time_stage(self, kind: str) -> list[dict[str, float]]:
        import torch

        stage = self.stages[kind]
        started = time.perf_counter()
        stage.load(self.source)
        loaded = host_gib()
        self.say(f"bench:   {kind} loaded in {time.perf_counter() - started:.1f} s{self.allocated()}")
        cuda = self.runtime.device.startswith("cuda")
        try:
            for _ in range(self.plan.warmup):
                stage(dataclasses.replace(self.clip, seconds={}))
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            timed = []
            for _ in range(self.plan.repeat):
                clip = stage(dataclasses.replace(self.clip, seconds={}))
                timed.append(clip.seconds)
            self.clip = clip
            self.forwards_run = clip.forwards or self.forwards_run
            self.forwards_reused = clip.forwards_reused or self.forwards_reused
            if cuda:  # the device's peak; a CPU run has none to report
                self.peaks[kind] = torch.cuda.max_memory_allocated() / 2**30
            self.host[kind] = max(loaded, host_gib())
            parts = ", ".join(f"{part} {value:.2f} s" for part, value in timed[-1].items())
            self.say(f"bench:   {kind} timed: {parts}{self.allocated()}")
        finally:
            stage.unload()
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
                self.say(f"bench:   {kind} unloaded{self.allocated()}")
        return timed

    def allocated(self) -> str:
        """What the allocator holds now, for the progress lines: what a stage leaves behind shows there."""
        import torch

        if not self.runtime.device.startswith("cuda"):
            return ""
        return f" ({torch.cuda.memory_allocated() / 2**30:.2f} GiB allocated)"

    def stand_in(self, kind: str) -> None:
        """Random (never zero) inputs for the next stage when this one is not being measured."""
        import numpy as np
        import torch

        device, request = self.runtime.device, self.request
        generator = torch.Generator("cpu").manual_seed(self.plan.seed)
        if kind == "encode":
            tokens = self.plan.text_tokens
            self.clip.prompt_embeds = torch.randn((1, tokens, self.source.text_dim()), generator=generator).to(
                device, self.runtime.dtype)
            self.clip.text_token_tags = torch.full((tokens,), 1, dtype=torch.long)
        elif kind == "sampler":
            self.clip.video_latents = torch.randn(request.video_latent_shape, generator=generator).to(device)
            self.clip.audio_latents = torch.randn(request.audio_latent_shape, generator=generator).to(device)
        elif kind == "vae":
            rng = np.random.default_rng(self.plan.seed)
            self.clip.frames = rng.integers(0, 256, (request.frames, request.height, request.width, 3), np.uint8)
            samples = request.audio_latent_shape[-1] * SAMPLES_PER_AUDIO_LATENT
            self.clip.audio = rng.uniform(-0.5, 0.5, (AUDIO_CHANNELS, samples)).astype(np.float32)
            self.clip.sample_rate = SAMPLE_RATE


def host_gib() -> float:
    """The process's resident host memory now (pinned copies of streamed weights included), in GiB; 0 where
    /proc is not there to read it."""
    import os

    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30
    except OSError:
        return 0.0


def summarize(values: list[float]) -> tuple[float, float]:
    ordered = sorted(values)
    p95 = ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]
    return statistics.median(ordered), p95


STAGE_KINDS = {"dit": "sampler", "vae_video": "vae", "vae_audio": "vae", "transfer": "vae"}  # record stage -> stage


def gib(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def records_for(name, baseline, request, runs, forwards_run, full_forwards, peaks, common, attention,
                dit_rel_err=None, forwards_reused=0, host=None) -> list[dict]:
    duration = request.duration
    per_stage: dict[str, list[float]] = {}
    forward_s, outside_s = [], []  # per repeat: one forward, and the sampler's work outside its forwards
    for seconds in runs:
        if "sampler" in seconds and forwards_run:
            # Forwards scale to the preset's count; the layout, noise and steps are paid once a clip.
            forwards = seconds.get(FORWARDS_PART, seconds["sampler"])
            forward_s.append(forwards / forwards_run)
            outside_s.append(seconds["sampler"] - forwards)
            seconds["dit"] = outside_s[-1] + forward_s[-1] * full_forwards
        parts = [seconds[k] for k in ("encode", "dit", "vae", "mux") if k in seconds]
        if len(parts) > 1:  # one stage timed alone has no end to end beyond its own row
            seconds["e2e"] = sum(parts)
        for stage in RECORD_STAGES:
            if stage in seconds:
                per_stage.setdefault(stage, []).append(seconds[stage])
    records = []
    for stage, values in per_stage.items():
        median, p95 = summarize(values)
        kind = STAGE_KINDS.get(stage, stage)
        record = dict(common, preset=name, baseline=baseline, duration_s=round(duration, 4), frames=request.frames,
                      size=f"{request.width}x{request.height}", stage=stage, median_s=round(median, 4),
                      p95_s=round(p95, 4), repeats=len(values), per_forward_s=None, forwards=None,
                      peak_gib=gib(max(peaks.values(), default=None) if stage == "e2e" else peaks.get(kind)),
                      host_gib=round(max(host.values(), default=0.0) if stage == "e2e" else host.get(kind, 0.0), 3)
                      if host else None,
                      rtf=round(median / duration, 4) if stage == "e2e" else None, dit_rel_err=None)
        if stage == "dit":
            timed = f"{forwards_run} forward{'s' * (forwards_run != 1)} timed"
            if forwards_reused:
                timed += f" ({forwards_run - forwards_reused} computed in full, {forwards_reused} reused)"
            if forwards_run != full_forwards:
                timed += f", scaled to {full_forwards}"
            outside = statistics.median(outside_s)
            record.update(per_forward_s=round(statistics.median(forward_s), 4), forwards=full_forwards,
                          notes=f"{timed}; per forward from the forwards alone, {outside:.3f} s of the sampler's "
                                f"work outside them once a clip; attention {attention}")
            if dit_rel_err is not None:  # the output video latents against the baseline's (bench.velocity_error)
                record.update(dit_rel_err=round(dit_rel_err, 5))
        if stage == "cache_check":  # the step cache's own work (copies, residuals, the metric) over every forward
            record.update(per_forward_s=round(median / forwards_run, 5), forwards=forwards_run)
        records.append(record)
    return records


def said_failed(say, what: str, error: Exception) -> None:
    """One line for a preset that failed, the others measured on; with --traceback (H3GEN_DEBUG) where it came from."""
    from h3gen.errors import debugging

    if debugging():
        traceback.print_exception(error, file=sys.stderr)
    say(f"bench: {what} failed: {type(error).__name__}: {str(error)[:300]}")


def forget_failed_run(preset) -> None:
    """What a run that failed had loaded (a baseline out of memory on a smaller GPU: most of its weights on the
    device) back to the device before the next preset loads, or that one fails for want of memory too."""
    from h3gen.run import memory
    from h3gen.run.render import pick_device

    memory.let_go(pick_device(preset.runtime["device"]))


def run_bench(plan: BenchPlan, registry, source, random_weights: str | None, say=print) -> list[dict]:
    common = dict(gpus=1, layout="single", random_weights=random_weights, notes="")
    names = [(plan.baseline, True)] if plan.baseline else []
    names += [(name, False) for name in plan.presets]
    records = []
    prompt = " ".join(["a"] * plan.text_tokens)
    with tempfile.TemporaryDirectory(prefix="h3gen-bench-") as workdir:
        for seconds in plan.durations:
            request = Request(index=0, prompt=prompt, seed=plan.seed, width=plan.width, height=plan.height,
                              frames=frames_for_duration(seconds), id="bench")
            reference = None  # the baseline's output video latents and forwards, for each preset's dit_rel_err
            for name, baseline in names:
                preset = plan.preset(name, baseline, registry)
                full_forwards = preset_forwards(preset)
                preset = plan.preset(name, baseline, registry, *forward_overrides(preset, plan.forwards, registry),
                                     *cache_overrides(preset), *adapter_overrides(random_weights))
                say(f"bench: {name} at {seconds:g} s ({request.frames} frames, {plan.width}x{plan.height})")
                bench = None  # the last preset's clip (latents, frames) freed before this one's budget is set
                gc.collect()
                failed = False
                try:
                    bench = StageBench(preset, registry, source, plan, request, Path(workdir), say)
                    runs = bench.run()
                except Exception as e:  # one preset failing must not lose the others' numbers
                    said_failed(say, f"{name} at {seconds:g} s", e)
                    # the row the run would have had: its one stage's, or end to end
                    stage = {"vae": "vae_video"}.get(plan.stages[0], plan.stages[0]) if len(plan.stages) == 1 else "e2e"
                    records.append(dict(common, gpus=int(pick_device(preset.runtime["device"]).startswith("cuda")),
                                        preset=name, baseline=baseline, duration_s=round(request.duration, 4),
                                        frames=request.frames, size=f"{plan.width}x{plan.height}", stage=stage,
                                        median_s=None, p95_s=None, repeats=0, per_forward_s=None, forwards=None,
                                        peak_gib=None, host_gib=None, rtf=None, dit_rel_err=None,
                                        vram_gib=preset.runtime["vram_gib"] or None,
                                        notes=f"failed: {type(e).__name__}: {e}"[:500]))
                    failed = True
                if failed:  # past the except block, its exception and what it held are garbage now
                    bench = None
                    forget_failed_run(preset)
                    continue
                error, reference, unmeasured = output_error(plan, request, bench.clip, baseline, reference)
                gpus = int(bench.runtime.device.startswith("cuda"))  # a CPU run has none
                measured = records_for(preset.name, baseline, request, runs, bench.forwards_run, full_forwards,
                                       bench.peaks, dict(common, gpus=gpus), bench.clip.attention or "-", error,
                                       bench.forwards_reused, bench.host)
                for record in measured:
                    record["vram_gib"] = preset.runtime["vram_gib"] or None
                    record["notes"] = "; ".join(filter(None, [
                        record["notes"], "--set " + " ".join(plan.overrides) if plan.overrides and not baseline else "",
                        bench.memory_plan.describe() if bench.memory_plan is not None and record["stage"] == "dit"
                        else "", unmeasured if record["stage"] == "dit" else ""]))
                records += measured
    add_ratios(records)
    return records


def output_error(plan: BenchPlan, request: Request, clip, baseline: bool, reference):
    """(this preset's dit_rel_err or None, the reference from here on, why a preset has none when it could): the
    baseline's DiT output and its forward count; each preset after it that ran as many forwards on the same weights
    and inputs is measured against it."""
    from h3gen.bench.velocity_error import latent_step_error, starting_noise

    if "dit" not in plan.stages or clip.video_latents is None or request.task != "t2va":
        return None, reference, ""
    latents = clip.video_latents.float().cpu()
    if baseline:
        return None, (latents, clip.forwards), ""
    if reference is None:
        return None, reference, "no dit_rel_err: the baseline did not run" if plan.baseline else ""
    if reference[1] != clip.forwards:  # latents after other step counts do not compare
        return None, reference, (f"no dit_rel_err: {clip.forwards} forwards against the baseline's {reference[1]} "
                                 "(--forwards K runs both alike)")
    return latent_step_error(latents, reference[0], starting_noise(request, plan.seed)), reference, ""


def add_ratios(records: list[dict]) -> None:
    """`vs_baseline`: the baseline's median over this one's (above 1 = faster than the baseline)."""
    base = {(r["duration_s"], r["stage"]): r["median_s"] for r in records if r["baseline"] and r["median_s"]}
    for r in records:
        reference = base.get((r["duration_s"], r["stage"]))
        r["vs_baseline"] = round(reference / r["median_s"], 3) if reference and r["median_s"] else None
