"""Faults during a run: a full disk, GPU out of memory, a signal. Each costs one clip at most, leaves no partial
file, and says why; a rerun resumes.

The faults come from a test plugin installed the way `pip install` would (an `h3gen` entry point), so the
command runs exactly as in production, in a child process.
"""

import contextlib
import gc
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import time
import weakref
from pathlib import Path

import pytest

from conftest import ROOT, child_env, h3gen
from h3gen.run.validate import validate_clip

FAULTS_PLUGIN = '''
import dataclasses, time
from pathlib import Path

import numpy as np

from h3gen.plugins.hookspecs import hookimpl
from h3gen.stages.vae import FastVAE, FastVAEConfig
from h3gen.stages.mux import PyAVMux, PyAVMuxConfig
from h3gen.stages.sampler import EulerConfig, EulerSampler


@dataclasses.dataclass
class OomConfig(EulerConfig):
    fail_ids: list[str] = dataclasses.field(default_factory=list)


class OomSampler(EulerSampler):
    """Runs out of GPU memory on the clips named in fail_ids, after allocating, as a real one would."""
    kind, name = "sampler", "oom"
    Config = OomConfig

    def run(self, clip):
        import torch

        if clip.request.id in self.config.fail_ids:
            clip.video_latents = torch.zeros(1 << 20)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 80.00 GiB")
        return super().run(clip)


class SlowFrames(np.ndarray):
    """Frames the muxer receives one by one, slowly after the first half: by then the encoder has written
    packets (x264 holds its first 40 frames back), and the marker says so."""

    def __iter__(self):
        for index in range(len(self)):
            if index >= len(self) // 2:
                Path(self.marker).touch()
                time.sleep(self.delay)
            yield np.asarray(self[index])


@dataclasses.dataclass
class SlowConfig(PyAVMuxConfig):
    slow_id: str = ""
    delay: float = 0.2
    marker: str = ""


class SlowMux(PyAVMux):
    kind, name = "mux", "slow"
    Config = SlowConfig
    output_neutral = ("slow_id", "delay", "marker")  # slow, never different: a rerun without them skips its clips

    def run(self, clip):
        if clip.request.id == self.config.slow_id:
            clip.frames = clip.frames.view(SlowFrames)
            clip.frames.delay, clip.frames.marker = self.config.delay, self.config.marker
        return super().run(clip)


@dataclasses.dataclass
class SlowDecodeConfig(FastVAEConfig):
    slow_id: str = ""
    marker: str = ""


class SlowDecodeVAE(FastVAE):
    """Hands the first chunk of the slow clip's frames to the mux, says so with the marker, then takes its time."""
    kind, name = "vae", "slow-decode"
    Config = SlowDecodeConfig
    output_neutral = ("slow_id", "marker")

    def decode(self, latents, emit):
        def emit_slowly(video):
            emit(video)
            if self.slow:
                Path(self.config.marker).touch()
                # A minute in short sleeps, as a real decode returns to Python between tile batches: a signal that
                # lands after the marker but before one long sleep begins would otherwise wait the whole minute.
                for _ in range(600):
                    time.sleep(0.1)
        return super().decode(latents, emit_slowly if emit is not None else None)

    def run(self, clip):
        self.slow = clip.request.id == self.config.slow_id
        return super().run(clip)


@hookimpl
def h3gen_register_stages(register):
    register(OomSampler)
    register(SlowMux)
    register(SlowDecodeVAE)
'''


def install(site, name, source):
    """What `pip install` leaves behind for a package with an `h3gen` entry point."""
    site.mkdir(exist_ok=True)
    (site / f"h3gen_{name}.py").write_text(source)
    info = site / f"h3gen_{name}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: h3gen-{name}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[h3gen]\n{name} = h3gen_{name}\n")
    return {"PYTHONPATH": str(site)}


@pytest.fixture
def faults(tmp_path):
    """(env, preset path): the tiny preset with the fault-injecting sampler and muxer."""
    env = install(tmp_path / "site", "faults", FAULTS_PLUGIN)
    preset = tmp_path / "faulty.toml"
    preset.write_text((ROOT / "presets" / "tiny.toml").read_text()
                      .replace('use = "euler"', 'use = "oom"').replace('use = "pyav"', 'use = "slow"'))
    return env, preset


def records(result):
    return {r["id"]: r for r in map(json.loads, result.stdout.splitlines())}


def hidden_files(out):
    return sorted(p.name for p in out.iterdir() if p.name.startswith("."))


TWO_CLIPS = '{"id": "a", "prompt": "a fox"}\n{"id": "b", "prompt": "waves"}\n'


# -- out of GPU memory ----------------------------------------------------------------------------------------------

def test_out_of_memory_costs_one_clip_with_a_hint(faults, prompts_file, tmp_path):
    env, preset = faults
    out = tmp_path / "out"
    result = h3gen("render", prompts_file(TWO_CLIPS), "-o", out, "--preset", preset, "--json",
                   "--set", 'sampler.fail_ids=["a"]', env=env)
    assert result.returncode == 1, result.stderr[-2000:]
    clips = records(result)
    assert not clips["a"]["ok"] and clips["b"]["ok"]
    assert clips["a"]["error"] == ("out of GPU memory (try --vram with less than the GPU has so DiT blocks stream, "
                                   "an FP8 preset, fewer frames or a smaller size)")
    assert "1 of 2 clips written, 1 failed" in result.stderr
    assert "failed a.mp4 (line 1): out of GPU memory (try --vram" in result.stderr
    assert sorted(p.name for p in out.glob("*.mp4")) == ["b.mp4"]


def test_out_of_memory_under_a_plan_names_a_smaller_budget(tmp_path):
    import torch

    from h3gen.inputs.request import Request
    from h3gen.run.render import clip_error
    from h3gen.stages.clip import Clip

    clip = Clip(request=Request(index=0, prompt="a", seed=0, width=32, height=32, frames=124), path=tmp_path / "a.mp4",
                preset="tiny")
    error = clip_error(clip, torch.OutOfMemoryError("CUDA out of memory"), {"vram_gib": 24.0})
    assert error.startswith("out of GPU memory under the plan for 24.0 GiB (try --vram 18 so more DiT blocks stream")


def test_out_of_host_memory_is_named_as_such_not_as_a_bug(tmp_path):
    """torch's CPU allocator raises a RuntimeError, Python a MemoryError: either costs the clip with a hint."""
    from h3gen.inputs.request import Request
    from h3gen.run.render import clip_error
    from h3gen.stages.base import StageFailed
    from h3gen.stages.clip import Clip

    clip = Clip(request=Request(index=0, prompt="a", seed=0, width=32, height=32, frames=124), path=tmp_path / "a.mp4",
                preset="tiny")
    refused = RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: "
                           "you tried to allocate 34359738368 bytes. Error code 12 (Cannot allocate memory)")
    wrapped = StageFailed("sampler stage 'euler' raised RuntimeError")
    wrapped.__cause__ = refused
    for error in (refused, wrapped, MemoryError()):
        assert clip_error(clip, error).startswith("out of host memory (try fewer frames or a smaller size"), error


def tiny_renderer_with_sampler(sampler_class, tiny_model, tmp_path):
    """A renderer of the tiny preset whose sampler is `sampler_class` (registered under its `name`), and the
    requests of TWO_CLIPS."""
    from h3gen.cli.ui import PlainReporter
    from h3gen.plugins.manager import Registered, registry
    from h3gen.config.preset import resolve
    from h3gen.inputs.prompts import read_prompts
    from h3gen.run.render import Renderer
    from h3gen.models.repo import ModelRepo

    found = registry()
    name = sampler_class.name
    found.stages[("sampler", name)] = Registered("sampler", name, sampler_class, "test")
    preset_file = tmp_path / f"{name}.toml"
    preset_file.write_text((ROOT / "presets" / "tiny.toml").read_text().replace('"euler"', f'"{name}"'))
    preset = resolve(str(preset_file), found)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(TWO_CLIPS)
    renderer = Renderer(preset, found, ModelRepo(tiny_model), PlainReporter(2))
    return renderer, read_prompts(prompts, 0, preset.request)


def test_a_failed_clip_gives_its_memory_back_before_the_next(tiny_model, tmp_path):
    """The failing stage leaves a tensor in a reference cycle; it is gone before the next clip starts."""
    import torch

    from h3gen.stages.sampler import EulerSampler

    leaked = []

    class CyclicOom(EulerSampler):
        kind, name = "sampler", "cyclic-oom"

        def run(self, clip):
            if clip.request.id == "a":
                holder = {"latents": torch.zeros(1 << 20)}
                holder["self"] = holder  # only the garbage collector frees this
                leaked.append(weakref.ref(holder["latents"]))
                clip.video_latents = holder
                raise torch.OutOfMemoryError("CUDA out of memory")
            assert leaked and leaked[0]() is None, "the failed clip's tensor is still alive"
            return super().run(clip)

    renderer, requests = tiny_renderer_with_sampler(CyclicOom, tiny_model, tmp_path)
    gc.disable()
    try:
        results = list(renderer.render(requests, tmp_path / "out"))
    finally:
        gc.enable()
        renderer.close()  # its mux pool goes, and the switch interval it lowered comes back
    assert [r.ok for r in results] == [False, True]


def test_an_allocation_a_kernel_library_could_not_make_is_out_of_memory(tiny_model, tmp_path, monkeypatch):
    """A kernel library allocating through torch's stable ABI (fa3-fwd) raises only that its call failed; the
    allocator's count of refused allocations says it ran out, and the clip's line says so."""
    from h3gen.run import memory
    from h3gen.stages.sampler import EulerSampler

    refused = [0]

    class RefusedInKernel(EulerSampler):
        kind, name = "sampler", "refused-in-kernel"

        def run(self, clip):
            if clip.request.id == "a":
                refused[0] += 1
                raise RuntimeError('torch_call_dispatcher("aten::new_empty", "", stack.data(), TORCH_ABI_VERSION) '
                                   "API call failed")
            return super().run(clip)

    monkeypatch.setattr(memory, "refused_allocations", lambda device: refused[0])
    renderer, requests = tiny_renderer_with_sampler(RefusedInKernel, tiny_model, tmp_path)
    try:
        results = list(renderer.render(requests, tmp_path / "out"))
    finally:
        renderer.close()
    assert [r.ok for r in results] == [False, True]
    assert results[0].error.startswith("out of GPU memory (try --vram")


@pytest.mark.cuda
def test_cuda_memory_returns_to_its_starting_level_between_clips(tiny_model, tmp_path):
    """Each clip starts from the level the one before it started from, and the run ends there: nothing a clip made
    stays on the device. The level is taken as each clip starts, after the prompts' encoding: on a GPU the text
    encoder is freed once its chunk is encoded, so the level with every stage just loaded is not the clips' level."""
    import torch

    from h3gen.cli.ui import PlainReporter
    from h3gen.plugins.manager import registry
    from h3gen.config.preset import resolve
    from h3gen.inputs.prompts import read_prompts
    from h3gen.run.render import Renderer
    from h3gen.models.repo import ModelRepo

    class Levels(PlainReporter):
        def clip_started(self, clip):
            torch.cuda.synchronize()
            started.append((torch.cuda.memory_allocated(), torch.cuda.memory_reserved()))
            super().clip_started(clip)

    started, after_result = [], []
    preset = resolve("tiny", registry(), ["runtime.device=cuda"])
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("one\ntwo\nthree\n")
    renderer = Renderer(preset, registry(), ModelRepo(tiny_model), Levels(3))
    try:
        for result in renderer.render(read_prompts(prompts, 0, preset.request), tmp_path / "out"):
            assert result.ok
            after_result.append(torch.cuda.memory_allocated())
    finally:  # the levels as the run ends, before close() unloads the stages
        allocated_at_end, reserved_at_end = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
        renderer.close()
    allocated, reserved = started[0]
    assert [level for level, _ in started] == [allocated] * 3
    assert after_result == [allocated] * 3 and allocated_at_end == allocated
    # The cache goes back but for the 2 MiB segments a loaded weight shares with the clip's small tensors.
    assert reserved_at_end <= reserved + 2 * 2**20


# -- peak memory estimate -------------------------------------------------------------------------------------------

def test_peak_estimate_matches_the_measured_h200_forward():
    """The released model on an H200: 62.4 GiB of DiT weights, 74.8 GiB peak for one forward over the 10 s
    request's 73,642 rows."""
    from h3gen.inputs.request import Request
    from h3gen.run.memory import GIB, DiTShape, packed_rows, peak_bytes

    ten_seconds = Request(index=0, prompt="x", seed=1101, width=1344, height=768, frames=243)
    assert packed_rows(ten_seconds, DiTShape()) == 73_642
    assert peak_bytes(ten_seconds, DiTShape(), int(62.4 * GIB)) / GIB == pytest.approx(74.8, abs=0.5)
    fifteen = Request(index=0, prompt="x", seed=0, width=1344, height=768, frames=362)
    assert peak_bytes(fifteen, DiTShape(), 0) > 1.4 * peak_bytes(ten_seconds, DiTShape(), 0)


def test_peak_estimate_warns_only_when_the_largest_clip_does_not_fit():
    from h3gen.inputs.request import Request
    from h3gen.run.memory import GIB, DiTShape, fit_warning

    small = Request(index=0, prompt="x", seed=0, width=1344, height=768, frames=124, line=1)
    large = Request(index=1, prompt="y", seed=0, width=1344, height=768, frames=362, line=2)
    weights = int(62.4 * GIB)
    assert fit_warning([small, large], DiTShape(), weights, available_bytes=60 * GIB) is None
    warning = fit_warning([small, large], DiTShape(), weights, available_bytes=10 * GIB)
    assert warning.startswith("warning: the largest clip (line 2, 1344x768, 362 frames) needs about 80.8 GiB")
    assert "the GPU has 72.4 GiB" in warning and "try an FP8 preset, fewer frames or a smaller size" in warning


def test_a_cpu_run_warns_when_its_largest_clip_needs_more_than_host_memory_has_free(tiny_model, monkeypatch):
    from h3gen.inputs.request import Request
    from h3gen.models.repo import ModelRepo
    from h3gen.run import budget
    from h3gen.run.memory import GIB, host_fit_warning

    config = ModelRepo(tiny_model).transformer_config()
    small = Request(index=0, prompt="x", seed=0, width=32, height=32, frames=124, line=1)
    huge = Request(index=1, prompt="y", seed=0, width=7680, height=4320, frames=362, line=2)
    monkeypatch.setattr(budget, "host_available_bytes", lambda: 8 * GIB)
    assert host_fit_warning([small], config, 4) is None
    warning = host_fit_warning([small, huge], config, 4)
    assert warning.startswith("warning: the largest clip (line 2, 7680x4320, 362 frames) needs about ")
    assert warning.endswith(", host memory has 8.0 GiB free: expect out of memory (try fewer frames or a smaller size)")


@pytest.mark.parametrize("dry_run", [["--dry-run"], []])
def test_a_cpu_run_with_a_clip_larger_than_host_memory_is_refused_before_it_loads(prompts_file, tmp_path, dry_run):
    """About 380 GiB at peak: more than any machine these tests run on has free. One line, exit 2, nothing written."""
    huge = prompts_file('a fox\n{"prompt": "a city", "width": 7680, "height": 4320, "duration": 15}\n')
    result = h3gen("render", huge, "-o", tmp_path / "out", *dry_run, check_code=2)
    (line,) = result.stderr.splitlines()
    assert line.startswith("h3gen: error: the largest clip (line 2, 7680x4320, 345 frames) needs about "), line
    assert line.endswith("GiB free (render fewer frames or a smaller size, free host memory, or render on a GPU)")
    assert result.stdout == "" and not (tmp_path / "out").exists()
    small = h3gen("render", prompts_file("a fox\n"), "-o", tmp_path / "out", "--dry-run", check_code=0)
    assert "warning" not in small.stderr


@pytest.mark.parametrize("kind", [["--stages", "dit"], ["--batch", "1"]])
def test_bench_refuses_a_clip_larger_than_host_memory_before_it_loads(tmp_path, kind):
    """As render does: one line and exit 2, not the kernel's out-of-memory kill minutes later; no record written."""
    result = h3gen("bench", "--preset", "tiny", "--baseline", "none", "--random-weights", "tiny", "--durations", "15",
                   "--size", "7680x4320", *kind, "-o", tmp_path / "results", check_code=2)
    (line,) = result.stderr.splitlines()
    assert line.startswith("h3gen: error: the largest clip (clip 1, 7680x4320, 345 frames) needs about "), line
    assert not (tmp_path / "results").exists()


def test_the_host_check_counts_weights_once_in_each_cpu_worker(tiny_model, monkeypatch):
    from h3gen.config.preset import resolve
    from h3gen.errors import UsageError
    from h3gen.inputs.request import Request
    from h3gen.models.repo import ModelRepo
    from h3gen.plugins.manager import registry
    from h3gen.run import budget, memory

    repo, preset = ModelRepo(tiny_model), resolve("tiny", registry())
    clip = Request(index=0, prompt="x", seed=0, width=64, height=32, frames=21)
    weights = sum(repo.weight_bytes(part) for part in ("transformer", "vae", "audio_vae", "text_encoder")) * 2
    need = memory.host_peak_bytes(clip, memory.DiTShape.from_dict(repo.transformer_config()), weights, 4)
    monkeypatch.setattr(budget, "host_available_bytes", lambda: 2 * need)
    budget.check_host_fits(preset, [clip], repo, processes=2)  # fits exactly
    with pytest.raises(UsageError, match=r"^the largest clip \(clip 1, 64x32, 21 frames\) needs about .* GiB of host "
                                         r"memory on the CPU \([\d.]+ MiB of it weights in each of 3 worker processes\)"
                                         r".* \(run at most 2 workers \(--cpu-workers 2\)\)$"):
        budget.check_host_fits(preset, [clip], repo, processes=3)
    monkeypatch.setattr(budget, "host_available_bytes", lambda: need)
    with pytest.raises(UsageError, match=r"\(run in one process: leave out --cpu-workers\)$"):
        budget.check_host_fits(preset, [clip], repo, processes=2)


def test_the_host_check_says_when_the_weights_alone_do_not_fit(tiny_model, monkeypatch):
    """Fewer frames cannot help where the libraries and weights alone take more than is free."""
    from h3gen.config.preset import resolve
    from h3gen.errors import UsageError
    from h3gen.inputs.request import Request
    from h3gen.models.repo import ModelRepo
    from h3gen.plugins.manager import registry
    from h3gen.run import budget

    clip = Request(index=0, prompt="x", seed=0, width=32, height=32, frames=124)
    monkeypatch.setattr(budget, "host_available_bytes", lambda: 2**29)
    with pytest.raises(UsageError) as refused:
        budget.check_host_fits(resolve("tiny", registry()), [clip], ModelRepo(tiny_model))
    assert refused.value.fix == "the weights alone take more: run on a GPU, or free host memory"


def test_host_memory_free_is_what_the_kernel_says_is_available():
    """MemAvailable counts the page cache the kernel can drop: a machine that has just read its weights is not full."""
    from h3gen.run.budget import host_available_bytes

    meminfo = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in open("/proc/meminfo")}
    expected = meminfo["MemAvailable"]
    limit = Path("/sys/fs/cgroup/memory.max")
    if limit.exists() and limit.read_text().strip() != "max":  # a container's limit holds it lower
        expected = min(expected, int(limit.read_text()) - int(Path("/sys/fs/cgroup/memory.current").read_text()))
    assert abs(host_available_bytes() - expected) < 256 * 2**20


# -- disk full ------------------------------------------------------------------------------------------------------

def limit_file_size(limit):
    def apply():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


def test_disk_full_while_writing_costs_one_clip_and_leaves_no_partial_file(prompts_file, tmp_path, tiny_model):
    """Two faults in one run: "full" writes into /dev/full (no space left from the first write), "big" grows past
    the file-size limit mid-write; "small" between them is written."""
    out = tmp_path / "out"
    out.mkdir()
    # The muxer writes .NAME.partial.mp4 and renames it when complete; for "full" that file is /dev/full.
    (out / ".full.mp4.partial.mp4").symlink_to("/dev/full")
    prompts = prompts_file('{"id": "full", "prompt": "a fox"}\n{"id": "small", "prompt": "waves"}\n'
                           '{"id": "big", "prompt": "rain", "duration": 15}\n')
    result = h3gen("render", prompts, "-o", out, "--json", preexec_fn=limit_file_size(300_000))
    assert result.returncode == 1, result.stderr[-2000:]
    clips = records(result)
    assert clips["small"]["ok"] and validate_clip(out / "small.mp4", expected_frames=124) == []
    for name, line, reason, hint in (("full", 1, "No space left on device", f"free space in {out}"),
                                     ("big", 3, "File too large", "a file size limit stops it: raise `ulimit -f`")):
        assert not clips[name]["ok"]
        assert clips[name]["error"] == (f"cannot write {out / name}.mp4: {reason} ({hint}; "
                                        "a rerun redoes only the clips that are missing)")
        assert f"failed {name}.mp4 (line {line}): cannot write {out / name}.mp4: {reason}" in result.stderr
    assert "1 of 3 clips written, 2 failed" in result.stderr
    assert sorted(p.name for p in out.glob("*.mp4")) == ["small.mp4"]


def test_a_clip_that_cannot_fit_on_the_disk_fails_before_it_renders(tmp_path, monkeypatch):
    import shutil

    from h3gen.inputs.request import Request
    from h3gen.errors import ClipError
    from h3gen.run.outputs import check_disk

    clip = Request(index=0, prompt="x", seed=0, width=1344, height=768, frames=243)
    check_disk(tmp_path, clip)
    free = 32 * 2**10
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**12, 10**12 - free, free))
    with pytest.raises(ClipError,
                       match=f"only 32 KiB free in {tmp_path}, the clip needs at least 64 KiB \\(free disk space"):
        check_disk(tmp_path, clip)
    free = 2**20  # room for an MP4, but not for one the size per pixel of this run's clips
    check_disk(tmp_path, clip)
    with pytest.raises(ClipError, match=f"only 1 MiB free in {tmp_path}, the clip needs about 12 MiB, as clips of"):
        check_disk(tmp_path, clip, bytes_per_pixel=0.05)
    free = 20 * 2**20  # room for this clip, but not beside the one still muxed in the background
    check_disk(tmp_path, clip, bytes_per_pixel=0.05)
    with pytest.raises(ClipError, match=f"only 20 MiB free in {tmp_path}, the clip needs about 12 MiB, as clips of "
                                        "these settings take, beside about 12 MiB for the clips still being written"):
        check_disk(tmp_path, clip, bytes_per_pixel=0.05, writing=[clip])


FREE_SPACE = '''
import os, shutil

_free = int(os.environ["H3GEN_TEST_FREE_BYTES"])
shutil.disk_usage = lambda path: shutil._ntuple_diskusage(10**12, 10**12 - _free, _free)
'''


def with_free_space(tmp_path, free: int) -> dict:
    """An environment whose h3gen sees `free` bytes free on every disk (a sitecustomize on its path)."""
    site = tmp_path / f"free-{free}"
    site.mkdir()
    (site / "sitecustomize.py").write_text(FREE_SPACE)
    return {"PYTHONPATH": str(site), "H3GEN_TEST_FREE_BYTES": str(free), "H3GEN_LOAD_PLUGINS": "none"}


def test_a_rerun_sizes_its_clips_by_the_valid_ones_it_skips(prompts_file, tmp_path):
    """A clip already there tells what the next ones take: on a disk with less free, they fail before rendering
    rather than after, each with its sampler and decode spent."""
    out = tmp_path / "out"
    size = ("--set", "request.width=256", "--set", "request.height=256")
    h3gen("render", prompts_file('{"id": "a", "prompt": "a fox"}\n'), "-o", out, *size, check_code=0)
    written = (out / "a.mp4").stat().st_size
    assert written > 2 * 2**17  # the test needs room under the clip's size above the smallest MP4 (64 KiB)
    prompts = prompts_file('{"id": "a", "prompt": "a fox"}\n{"id": "b", "prompt": "waves"}\n')
    result = h3gen("render", prompts, "-o", out, "--json", *size, env=with_free_space(tmp_path, written // 2),
                   check_code=1)
    clip = records(result)["b"]
    assert re.match(rf"only [\d.]+ MiB free in {re.escape(str(out))}, the clip needs about [\d.]+ MiB, as clips of "
                    r"these settings take \(free disk space", clip["error"]), clip
    assert "sampler" not in clip["seconds"]
    assert records(result)["a"]["status"] == "skipped"


def test_after_a_clip_finds_the_disk_full_the_next_fail_before_rendering_until_space_is_freed(tmp_path, monkeypatch):
    import errno
    from types import SimpleNamespace

    from h3gen.errors import ClipError
    from h3gen.inputs.request import Request
    from h3gen.run.outputs import check_disk
    from h3gen.run.render import Renderer

    clip = SimpleNamespace(request=Request(index=0, prompt="x", seed=0, width=256, height=256, frames=124))
    pixels = 124 * 256 * 256
    renderer = SimpleNamespace(unfit_per_pixel=0.0, out_dir=tmp_path)
    full = RuntimeError("the mux stage raised")  # a stage's failure, raised from the write's
    full.__cause__ = OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**12, 10**12 - free, free))
    for free, learned in ((10**12, 0.0), (2**20, 2**20 / pixels)):  # no lesson where more is free than raw frames
        Renderer.learn_unfit(renderer, clip, RuntimeError("not a full disk"))
        Renderer.learn_unfit(renderer, clip, full)
        assert renderer.unfit_per_pixel == learned
    with pytest.raises(ClipError, match=f"^only 1 MiB free in {tmp_path}, no more than when a clip of this run did "
                                        "not fit \\(free disk space"):
        check_disk(tmp_path, clip.request, unfit_per_pixel=renderer.unfit_per_pixel)
    free = 2**20 + 2**16  # space freed since: the clip is tried
    check_disk(tmp_path, clip.request, unfit_per_pixel=renderer.unfit_per_pixel)


def test_a_run_learns_the_least_its_clips_take_per_pixel(tmp_path):
    from types import SimpleNamespace

    from h3gen.inputs.request import Request
    from h3gen.run.render import Renderer

    renderer = SimpleNamespace(bytes_per_pixel=0.0)
    for size in (3000, 1000, 2000):
        path = tmp_path / f"{size}.mp4"
        path.write_bytes(b"x" * size)
        Renderer.learn_size(renderer, SimpleNamespace(path=path, request=Request(
            index=0, prompt="x", seed=0, width=10, height=10, frames=10)))
    assert renderer.bytes_per_pixel == 1.0


# -- signals and resuming -------------------------------------------------------------------------------------------

def start_render(args, env):
    return subprocess.Popen([sys.executable, "-m", "h3gen.cli.main", "render", *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env(env))


def wait_for(path, process, seconds=120):
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert process.poll() is None, process.communicate()[1][-2000:]
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143), (signal.SIGHUP, 129)])
def test_signal_discards_the_clip_in_flight_and_a_rerun_resumes(faults, prompts_file, tmp_path, signum, code):
    env, preset = faults
    out, marker = tmp_path / "out", tmp_path / "muxing-b"
    out.mkdir()
    (out / "c.mp4").write_bytes(b"\0\0\0\x20ftypisom" + bytes(8))  # an MP4 cut short: rendered again, not skipped
    render = ["render", prompts_file(TWO_CLIPS + '{"id": "c", "prompt": "rain"}\n'), "-o", out, "--preset", preset,
              "--save-latents"]
    # Muxing in line: with background muxing, how far the next clip got before the signal depends on timing.
    process = start_render(render[1:] + ["--set", 'mux.slow_id="b"', "--set", f'mux.marker="{marker}"',
                                         "--set", "mux.workers=0"], env)
    wait_for(marker, process)
    assert (out / ".b.mp4.partial.mp4").exists()  # stopped while b's MP4 was being written
    process.send_signal(signum)
    stdout, stderr = process.communicate(timeout=60)
    assert process.returncode == code, stderr[-2000:]
    assert (f"h3gen: stopped by {signal.Signals(signum).name}: the clip in flight was discarded; "
            "run the same command again") in stderr
    assert "1 of 3 clips written, 2 not rendered" in stderr
    assert sorted(p.name for p in out.glob("*.mp4")) == ["a.mp4", "c.mp4"]
    assert [p.name for p in out.glob("*.latents.safetensors")] == ["a.latents.safetensors"]  # b's went with it
    assert validate_clip(out / "a.mp4", expected_frames=124) == []
    assert not list(out.glob(".*"))  # no partial MP4, no claim left behind
    if signum != signal.SIGTERM:
        return  # resuming is the same after any signal; checked once below
    first = (out / "a.mp4").stat().st_mtime_ns

    rerun = h3gen(*render, "--json", env=env, check_code=0)
    assert f"skipped {out / 'a.mp4'}: already there and valid (--force renders it again)" in rerun.stderr
    assert "2 of 3 clips written, 1 already there and valid (skipped)" in rerun.stderr
    assert [(r["id"], r["status"]) for r in map(json.loads, rerun.stdout.splitlines())] == [
        ("a", "skipped"), ("b", "ok"), ("c", "ok")]
    assert (out / "a.mp4").stat().st_mtime_ns == first
    assert sorted(p.name for p in out.glob("*.mp4")) == ["a.mp4", "b.mp4", "c.mp4"]
    assert all(validate_clip(out / f"{name}.mp4", expected_frames=124) == [] for name in "abc")

    done = h3gen(*render, env=env, check_code=0)
    assert "0 of 3 clips written, 3 already there and valid (skipped)" in done.stderr
    assert "loaded on" not in done.stderr  # nothing to render: no weights are loaded

    only_a = tmp_path / "only-a.txt"
    only_a.write_text(TWO_CLIPS.splitlines()[0] + "\n")
    forced = h3gen("render", only_a, "-o", out, "--preset", preset, "--force", "--json", env=env, check_code=0)
    assert [(r["id"], r["status"]) for r in map(json.loads, forced.stdout.splitlines())] == [("a", "ok")]
    assert (out / "a.mp4").stat().st_mtime_ns != first


def test_partial_files_of_clips_the_prompts_file_does_not_name_are_named_and_left(prompts_file, tmp_path):
    """A killed run of other prompts (or other seeds) left partial files a rerun of its own clips would clear: this
    run names them and leaves them, as another run may be writing them. Its own clips' partial files just go."""
    out = tmp_path / "out"
    out.mkdir()
    others = [out / ".h3-8827002ba9f0.mp4.partial.mp4", out / ".old.latents.safetensors.partial"]
    for path in [*others, out / ".a.mp4.partial.mp4"]:
        path.write_bytes(b"\0" * 64)
    result = h3gen("render", prompts_file('{"id": "a", "prompt": "x"}\n'), "-o", out, check_code=0)
    assert (f"h3gen: note: {out} holds 2 partial file(s) of clips this prompts file does not name "
            "(.h3-8827002ba9f0.mp4.partial.mp4, .old.latents.safetensors.partial): a killed run left them, or another "
            "run is writing them; a run of their prompts removes them, or delete them once no other run writes "
            "there") in result.stderr
    assert sorted(p.name for p in out.glob(".*")) == sorted(p.name for p in others)


def test_after_one_stop_signal_any_second_one_ends_the_process_at_once():
    """SIGTERM, then SIGINT while the run winds down: the second kills, as a second SIGTERM would."""
    from h3gen.run.loop import STOP_SIGNALS, Interrupted, stop_on_signals

    before = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    with stop_on_signals():
        with pytest.raises(Interrupted):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
        assert {signum: signal.getsignal(signum) for signum in STOP_SIGNALS} == dict.fromkeys(STOP_SIGNALS,
                                                                                             signal.SIG_DFL)
    assert {signum: signal.getsignal(signum) for signum in STOP_SIGNALS} == before


def test_a_signal_as_a_finished_run_puts_its_handlers_back_ends_with_one_line(monkeypatch, capsys):
    """SIGTERM from `timeout` just as the run ends, after the body returned and before the old handlers are back:
    the run's exit status for the signal and its one line, never a traceback."""
    import h3gen.cli.run as run
    from h3gen.run.loop import Interrupted
    from h3gen.run.settings import RunSettings

    @contextlib.contextmanager
    def signal_at_the_end():
        yield
        raise Interrupted(signal.SIGTERM)

    monkeypatch.setattr(run, "stop_on_signals", signal_at_the_end)
    monkeypatch.setattr(run, "_run_render", lambda settings, began: 0)
    assert run.run_render(RunSettings(prompts=Path("p.txt"), output=Path("out")), 0.0) == 143
    assert "h3gen: stopped by SIGTERM; run the same command again to resume" in capsys.readouterr().err


def test_a_signal_finishes_the_background_mux_of_a_decoded_clip_and_leaves_only_whole_files(faults, prompts_file,
                                                                                             tmp_path):
    """b's frames are all decoded, its device time spent, when the signal lands mid-mux: its MP4 is finished, said
    so, and counted written; what was on the device is discarded."""
    env, preset = faults
    out, marker = tmp_path / "out", tmp_path / "muxing-b"
    render = ["render", prompts_file(TWO_CLIPS + '{"id": "c", "prompt": "rain"}\n'), "-o", out, "--preset", preset]
    process = start_render(render[1:] + ["--set", 'mux.slow_id="b"', "--set", f'mux.marker="{marker}"',
                                         "--set", "mux.workers=2"], env)
    wait_for(marker, process)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 143, stderr[-2000:]
    assert not list(out.glob(".*"))  # no partial MP4, no claim left behind
    assert all(validate_clip(path, expected_frames=124) == [] for path in out.glob("*.mp4"))
    assert "b.mp4" in [p.name for p in out.glob("*.mp4")]
    assert re.search(r"\[2/3\] mux \d+\.\d\ds", stderr), stderr[-2000:]  # its mux line, as any written clip's
    assert re.search(r"h3gen: finishing the MP4 of [12] clip\(s\) already decoded; another signal ends at once",
                     stderr), stderr[-2000:]
    written = len(list(out.glob("*.mp4")))
    assert f"{written} of 3 clips written" in stderr, stderr[-2000:]
    rerun = h3gen(*render, env=env, check_code=0)
    assert "3 of 3 clips written" in rerun.stderr or "already there and valid (skipped)" in rerun.stderr
    assert sorted(p.name for p in out.glob("*.mp4")) == ["a.mp4", "b.mp4", "c.mp4"]


def test_signal_while_the_mux_reads_a_decode_in_flight_leaves_only_whole_files(faults, prompts_file, tmp_path):
    """The mux started with b's decode and has its first frames when the signal lands: b is discarded, no partial
    MP4 is left, the run ends at once."""
    env, preset = faults
    out, marker = tmp_path / "out", tmp_path / "decoding-b"
    render = ["render", prompts_file(TWO_CLIPS + '{"id": "c", "prompt": "rain"}\n'), "-o", out, "--preset", preset]
    process = start_render(render[1:] + ["--set", "vae.use=slow-decode", "--set", 'vae.slow_id="b"',
                                         "--set", f'vae.marker="{marker}"', "--set", "mux.workers=2",
                                         "--save-latents"], env)
    wait_for(marker, process)
    signalled = time.monotonic()
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 143, stderr[-2000:]
    assert time.monotonic() - signalled < 30  # not after the decode's minute
    assert not list(out.glob(".*"))  # no partial MP4, no claim left behind
    # a's background mux may or may not have finished when the signal came; b's never does
    assert {p.name for p in out.glob("*.mp4")} <= {"a.mp4"}
    assert all(validate_clip(path, expected_frames=124) == [] for path in out.glob("*.mp4"))
    # a discarded clip's latents go with it
    assert {p.name.split(".")[0] for p in out.glob("*.latents.safetensors")} == {p.stem for p in out.glob("*.mp4")}


# -- every write of the run fails soft ------------------------------------------------------------------------------

@pytest.fixture
def full_disk(tmp_path):
    """A 1 MiB tmpfs filled to the last block (mounting needs root; elsewhere the patched tests below stand in)."""
    mount = tmp_path / "full"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        with open(mount / "filler", "wb", buffering=0) as filler:
            try:
                while True:
                    filler.write(b"\0" * 4096)
            except OSError:
                pass
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)])


def test_a_full_output_disk_is_refused_before_any_weight_loads(full_disk, prompts_file, tiny_model):
    """No space for even the smallest MP4: one line and exit 1 before the weights load, nothing written. (A disk
    that fills once clips render fails each clip that no longer fits: the patched tests below.)"""
    for dry in ([], ["--dry-run"]):  # the dry run says what the run would
        result = h3gen("render", prompts_file("a fox\nwaves\n"), "-o", full_disk, "--json", "--save-latents",
                       "--model", tiny_model, "--preset", "tiny", *dry)
        assert result.returncode == 1, result.stderr[-3000:]
        assert re.fullmatch(rf"h3gen: error: only \d+ KiB free in {re.escape(str(full_disk))}, and a clip takes at "
                            r"least 64 KiB \(free disk space there, or pass -o on another disk\)",
                            result.stderr.splitlines()[-1])
        assert "loaded" not in result.stderr and result.stdout == ""
        assert sorted(p.name for p in full_disk.iterdir()) == ["filler"]


def test_a_full_cache_disk_costs_only_the_cache(full_disk, prompts_file, tiny_model, tmp_path):
    """The embedding cache lives on another disk; when that one is full, clips render as without a cache."""
    out = tmp_path / "out"
    result = h3gen("render", prompts_file("a fox\n"), "-o", out, "--json", "--model", tiny_model, "--preset", "tiny",
                   env={"XDG_CACHE_HOME": str(full_disk)})
    assert result.returncode == 0, result.stderr[-3000:]
    assert [json.loads(line)["ok"] for line in result.stdout.splitlines()] == [True]


def test_an_embedding_cache_folder_that_cannot_be_written_is_said_once(prompts_file, tmp_path):
    """encode.cache_dir where nothing can be written: the clips render, and the run says once why the next one will
    encode the prompts again."""
    result = h3gen("render", prompts_file("a fox\nwaves\n"), "-o", tmp_path / "out", "--set",
                   'encode.cache_dir="/proc/h3gen-nope"', check_code=0)
    note = ("h3gen: note: the embedding cache in /proc/h3gen-nope cannot be written (No such file or directory): these "
            "prompts are encoded again on the next run (set encode.cache_dir or XDG_CACHE_HOME to a folder you can "
            "write to)")
    assert result.stderr.count(note) == 1, result.stderr[-2000:]
    assert len(list((tmp_path / "out").glob("*.mp4"))) == 2


def manifest_line_error(out_dir: Path) -> str:
    """The line a clip's manifest record that cannot be written costs it (with os.write patched to fail)."""
    from h3gen.inputs.request import Request
    from h3gen.run import outputs
    from h3gen.run.records import ClipResult

    result = ClipResult(Request(index=0, prompt="x", seed=0, width=32, height=32, frames=124), out_dir / "a.mp4",
                        True, {}, 0.0)
    error = outputs.record(out_dir, result, "tiny", "ok")
    return outputs.write_error(Path(error.filename), error)


def test_a_manifest_line_that_cannot_be_written_fails_its_clip(tmp_path, monkeypatch):
    import errno

    from h3gen.run import outputs

    def no_space(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(outputs.os, "write", no_space)
    assert manifest_line_error(tmp_path) == (
        f"cannot write {tmp_path / 'manifest.jsonl'}: No space left on device (free space in {tmp_path}; a rerun "
        "redoes only the clips that are missing)")


def test_a_manifest_line_cut_short_by_a_file_size_limit_is_named_as_that_and_taken_back(tmp_path, monkeypatch):
    """The write that stops short does not say why; the next one does (`ulimit -f`), and the half line goes."""
    import errno

    from h3gen.run import outputs

    (tmp_path / "manifest.jsonl").write_text('{"earlier": 1}\n')
    real_write, calls = os.write, []

    def size_limit(fd, data):
        calls.append(len(data))
        if len(calls) > 1:
            raise OSError(errno.EFBIG, "File too large")
        return real_write(fd, data[:10])

    monkeypatch.setattr(outputs.os, "write", size_limit)
    assert manifest_line_error(tmp_path) == (
        f"cannot write {tmp_path / 'manifest.jsonl'}: File too large (a file size limit stops it: raise `ulimit -f`; "
        "a rerun redoes only the clips that are missing)")
    assert (tmp_path / "manifest.jsonl").read_text() == '{"earlier": 1}\n'


def test_a_file_system_out_of_inodes_is_named_as_such_not_as_out_of_space(tmp_path, monkeypatch):
    """`df -h` shows room: the hint to free space would mislead."""
    import errno
    from types import SimpleNamespace

    from h3gen.run import outputs

    full = OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(outputs.os, "statvfs", lambda path: SimpleNamespace(f_files=5, f_favail=0))
    assert outputs.write_error(tmp_path / "a.mp4", full) == (
        f"cannot write {tmp_path / 'a.mp4'}: No space left on device (its file system has no free inodes, however much "
        "space it has: delete files there or pass -o on another disk; a rerun redoes only the clips that are missing)")
    monkeypatch.setattr(outputs.os, "statvfs", lambda path: SimpleNamespace(f_files=5, f_favail=1))
    assert "(free space in" in outputs.write_error(tmp_path / "a.mp4", full)


def test_a_run_whose_output_disk_cannot_take_a_clip_is_refused_before_any_weight_loads(tmp_path, monkeypatch,
                                                                                       prompts_file):
    import dataclasses

    from h3gen.config.preset import resolve
    from h3gen.errors import WriteError
    from h3gen.plugins.manager import registry
    from h3gen.run.loop import prepare
    from h3gen.run.settings import RunSettings

    found = registry()
    preset = resolve("tiny", found)
    settings = RunSettings(prompts=prompts_file('{"prompt": "x"}\n'), output=tmp_path / "out")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**12, 10**12 - 2**10, 2**10))
    for run in (settings, dataclasses.replace(settings, dry_run=True)):  # a dry run says what the run would do
        with pytest.raises(WriteError,
                           match=f"^only 1 KiB free in {tmp_path / 'out'}, and a clip takes at least 64 KiB"):
            prepare(run, preset, found)
        assert not (tmp_path / "out").exists()  # the folder the run made goes with it


def test_a_run_whose_clips_are_all_there_is_not_refused_for_a_full_disk(tmp_path, monkeypatch, prompts_file):
    """A nightly rerun over a finished prompts file renders nothing, so it needs no room; --force would."""
    import dataclasses

    from h3gen.config.preset import resolve
    from h3gen.errors import WriteError
    from h3gen.plugins.manager import registry
    from h3gen.run.loop import prepare
    from h3gen.run.settings import RunSettings

    settings = RunSettings(prompts=prompts_file('{"id": "a", "prompt": "x"}\n'), output=tmp_path / "out")
    h3gen("render", settings.prompts, "-o", settings.output, check_code=0)
    found = registry()
    preset = resolve("tiny", found)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**12, 10**12 - 2**10, 2**10))
    for run in (settings, dataclasses.replace(settings, dry_run=True)):
        assert prepare(run, preset, found).requests
    with pytest.raises(WriteError, match="^only 1 KiB free in"):
        prepare(dataclasses.replace(settings, force=True), preset, found)


def test_a_failed_clip_whose_manifest_line_is_lost_says_so(tmp_path, monkeypatch):
    """The summary, --json and the manifest agree, or the failure says where they do not."""
    import errno

    from h3gen.inputs.request import Request
    from h3gen.run import outputs
    from h3gen.run.records import ClipResult

    def no_space(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(outputs.os, "write", no_space)
    failed = ClipResult(Request(index=0, prompt="x", seed=0, width=32, height=32, frames=124), tmp_path / "a.mp4",
                        False, {}, 0.0, error="only 0 KiB free", status="failed")
    result = outputs.recorded(tmp_path, failed, "tiny")
    assert result.error == "only 0 KiB free; its manifest line was not written either (No space left on device)"


def test_a_rerun_with_save_latents_renders_again_a_clip_whose_latents_were_cut_short(prompts_file, tmp_path):
    out, prompts = tmp_path / "out", prompts_file('{"id": "a", "prompt": "a fox"}\n')
    h3gen("render", prompts, "-o", out, "--save-latents", check_code=0)
    latents = out / "a.latents.safetensors"
    whole = latents.read_bytes()
    latents.write_bytes(whole[:100])
    planned = h3gen("render", prompts, "-o", out, "--save-latents", "--dry-run", check_code=0)
    assert planned.stdout.strip().endswith("a.mp4: there, but its latents a.latents.safetensors are cut "
                                           "short or not safetensors; rendered again"), planned.stdout
    h3gen("render", prompts, "-o", out, "--save-latents", check_code=0)
    assert latents.read_bytes() == whole


def test_a_rerun_with_save_latents_says_why_it_renders_a_clip_whose_latents_are_gone(prompts_file, tmp_path):
    out, prompts = tmp_path / "out", prompts_file('{"id": "a", "prompt": "a fox"}\n')
    h3gen("render", prompts, "-o", out, "--save-latents", check_code=0)
    (out / "a.latents.safetensors").unlink()
    planned = h3gen("render", prompts, "-o", out, "--save-latents", "--dry-run", check_code=0)
    assert planned.stdout.strip().endswith("a.mp4: there, but its latents a.latents.safetensors are missing "
                                           "(--save-latents writes them beside the clip); rendered again"), \
        planned.stdout
    assert "skip" in h3gen("render", prompts, "-o", out, "--dry-run", check_code=0).stdout  # without: nothing lacks


def test_latents_of_other_settings_are_rendered_again_and_a_clip_rendered_without_them_takes_its_old_ones(
        prompts_file, tmp_path):
    """Latents carry the clip's stamp: another render's latents beside the clip, or latents without a stamp, are not
    taken as its own, and a clip rendered again without --save-latents leaves no latents of its earlier settings
    beside it."""
    out, other, prompts = tmp_path / "out", tmp_path / "other", prompts_file('{"id": "a", "prompt": "a fox"}\n')
    h3gen("render", prompts, "-o", out, "--save-latents", check_code=0)
    h3gen("render", prompts, "-o", other, "--seed", "1", "--save-latents", check_code=0)
    shutil.copy(other / "a.latents.safetensors", out / "a.latents.safetensors")
    planned = h3gen("render", prompts, "-o", out, "--save-latents", "--dry-run", check_code=0)
    assert re.search(r"a\.mp4: there, but its latents a\.latents\.safetensors are of other settings \(request\.seed: 1 -> 0"
                     r"\); rendered again$", planned.stdout.strip()), planned.stdout
    h3gen("render", prompts, "-o", other, "--redo-conflicts", check_code=0)  # seed 0 now, no latents asked for
    assert sorted(p.name for p in other.iterdir()) == ["a.mp4", "manifest.jsonl"]

    from safetensors.torch import load_file, save_file

    save_file(load_file(out / "a.latents.safetensors"), out / "a.latents.safetensors")  # no metadata: no stamp
    planned = h3gen("render", prompts, "-o", out, "--save-latents", "--dry-run", check_code=0)
    assert planned.stdout.strip().endswith("a.mp4: there, but its latents a.latents.safetensors carry no h3gen stamp, "
                                           "so their settings are not known; rendered again"), planned.stdout


def test_a_manifest_cut_short_mid_line_takes_the_next_record_on_a_line_of_its_own(prompts_file, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "manifest.jsonl").write_text('{"partial": tru')  # what a crash or a full disk can leave
    h3gen("render", prompts_file("a fox\n"), "-o", out, check_code=0)
    cut, record = (out / "manifest.jsonl").read_text().splitlines()
    assert cut == '{"partial": tru' and json.loads(record)["status"] == "ok"


def test_once_the_manifest_cannot_be_written_the_run_renders_no_more_clips(prompts_file, tmp_path, monkeypatch):
    """Every later clip would be written and then counted failed: they are failed unrendered, each saying why."""
    import errno

    from typer.testing import CliRunner

    from h3gen.cli.main import app
    from h3gen.run import outputs

    real, calls = outputs.record, []

    def full_after_one(out_dir, result, preset, status):
        calls.append(status)
        if len(calls) == 1:
            return real(out_dir, result, preset, status)
        return OSError(errno.EPERM, "Operation not permitted", str(out_dir / outputs.MANIFEST))

    monkeypatch.setattr(outputs, "record", full_after_one)
    out = tmp_path / "out"
    # The mux in line: a clip's line is written before the next clip is taken (a background mux can let one more in).
    result = CliRunner().invoke(app, ["render", str(prompts_file("a fox\nwaves\na lighthouse\n")), "-o", str(out),
                                      "--set", "mux.workers=0"])
    assert result.exit_code == 1, result.output[-2000:]
    why = (f"cannot write {out / 'manifest.jsonl'}: Operation not permitted (make it writable; a rerun redoes only "
           "the clips that are missing)")
    failed = [line for line in result.output.splitlines() if "FAILED" in line]
    assert len(failed) == 2 and failed[0].endswith(why) and failed[1].endswith(f"not rendered: {why}"), failed
    assert len(list(out.glob("*.mp4"))) == 2  # the second was written before its line failed; the third never was


@pytest.mark.parametrize("dry", [False, True])
def test_a_manifest_that_cannot_be_written_refuses_the_run_before_any_clip(prompts_file, tmp_path, dry):
    """A directory where the manifest goes: said before a clip renders (a dry run too), not after it."""
    out = tmp_path / "out"
    (out / "manifest.jsonl").mkdir(parents=True)
    result = h3gen("render", prompts_file("a fox\n"), "-o", out, *(["--dry-run"] if dry else []))
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().splitlines()[-1] == (
        f"h3gen: error: the run's manifest {out / 'manifest.jsonl'} cannot be written (Is a directory) (move what "
        "is in its place away, or pass -o with another directory)")
    assert sorted(p.name for p in out.iterdir()) == ["manifest.jsonl"]


def test_skipped_clips_the_manifest_cannot_record_are_skipped_all_the_same(prompts_file, tmp_path):
    """A rerun finds the clips written, but their manifest lines cannot be appended (past the file-size limit, as on
    a full disk): the clips are done, their files say so; one note says the manifest was not written, and the run
    exits 0 (a cron job over a finished prompts file failed on every rerun)."""
    out = tmp_path / "out"
    prompts = prompts_file("a fox\na heron\n")
    assert h3gen("render", prompts, "-o", out).returncode == 0
    manifest = out / "manifest.jsonl"
    lines = manifest.read_text()
    result = h3gen("render", prompts, "-o", out, preexec_fn=limit_file_size(manifest.stat().st_size))
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stderr.count(f"note: cannot write {manifest}: File too large; the clips already written are "
                               "skipped all the same, without their line") == 1
    assert "0 of 2 clips written, 2 already there and valid (skipped)" in result.stderr
    assert manifest.read_text() == lines


def test_a_claim_that_cannot_be_created_fails_its_clip(tiny_model, tmp_path, monkeypatch):
    """The lock file of one clip cannot be created: that clip fails with one line, the next renders."""
    import errno

    from h3gen.cli.ui import PlainReporter
    from h3gen.config.preset import resolve
    from h3gen.inputs.prompts import read_prompts
    from h3gen.models.repo import ModelRepo
    from h3gen.plugins.manager import registry
    from h3gen.run import outputs
    from h3gen.run.render import Renderer

    real_open = os.open

    def open_except_a(path, *args):
        if str(path).endswith(".a.mp4.lock"):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real_open(path, *args)

    monkeypatch.setattr(outputs.os, "open", open_except_a)
    preset = resolve("tiny", registry())
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(TWO_CLIPS)
    out = tmp_path / "out"
    renderer = Renderer(preset, registry(), ModelRepo(tiny_model), PlainReporter(2))
    results = list(renderer.render(read_prompts(prompts, 0, preset.request), out, save_latents=True))
    renderer.close()
    assert [r.ok for r in results] == [False, True]
    assert results[0].error.startswith(f"cannot write {out / '.a.mp4.lock'}: No space left on device (free space")
    assert sorted(p.name for p in out.iterdir()) == ["b.latents.safetensors", "b.mp4", "manifest.jsonl"]


def test_tensors_that_cannot_be_written_raise_the_os_error(tmp_path, monkeypatch):
    """safetensors reports a full disk as its own error; the latents and the embedding cache see an OSError."""
    import errno

    import torch

    from h3gen.run.outputs import save_tensors

    target = tmp_path / "x.safetensors"
    with pytest.raises(OSError) as raised:
        save_tensors({"a": torch.zeros(4)}, tmp_path / "missing-folder" / "x.safetensors")
    assert raised.value.errno == errno.ENOENT
    save_tensors({"a": torch.zeros(4)}, target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.safetensors"]


def test_tensors_are_written_with_the_mode_the_umask_gives(tmp_path):
    """Latents and cache entries get the mode every other output gets (safetensors' own writer makes them 0600)."""
    import stat

    import torch

    from h3gen.run.outputs import save_tensors

    before = os.umask(0o027)
    try:
        save_tensors({"a": torch.zeros(4)}, tmp_path / "x.latents.safetensors")
        (tmp_path / "x.mp4").write_bytes(b"")
    finally:
        os.umask(before)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in tmp_path.iterdir()}
    assert modes == {"x.latents.safetensors": 0o640, "x.mp4": 0o640}


def test_the_tiny_model_is_written_with_the_modes_the_umask_gives(tmp_path):
    """`h3gen tiny DIR` (and the user cache's copy) can be shared as the user's other files are: not 0700 and 0600
    as tempfile and safetensors' writer make them."""
    import stat

    h3gen("tiny", tmp_path / "tiny", check_code=0, fresh=True, preexec_fn=lambda: os.umask(0o027))
    written = [tmp_path / "tiny", *(tmp_path / "tiny").rglob("*")]
    assert {stat.S_IMODE(p.stat().st_mode) for p in written if p.is_dir()} == {0o750}
    assert {stat.S_IMODE(p.stat().st_mode) for p in written if p.is_file()} == {0o640}
    assert any(p.suffix == ".safetensors" for p in written)


def test_a_rerun_after_sigkill_removes_the_partial_mp4_and_the_locks_it_owns(faults, prompts_file, tmp_path):
    """SIGKILL mid-write leaves b's 48-byte partial MP4 and b's lock; a lock of a clip already written is left too
    when the kill lands between the MP4's rename and the claim's release (made by hand here). The rerun removes
    them all, also the lock of the clip it skips."""
    env, preset = faults
    out, marker = tmp_path / "out", tmp_path / "muxing-b"
    render = ["render", prompts_file(TWO_CLIPS), "-o", out, "--preset", preset, "--set", "mux.workers=0"]
    process = start_render(render[1:] + ["--set", 'mux.slow_id="b"', "--set", f'mux.marker="{marker}"'], env)
    wait_for(marker, process)
    process.kill()
    process.communicate(timeout=60)
    assert (out / ".b.mp4.partial.mp4").stat().st_size == 48 and (out / ".b.mp4.lock").exists()
    (out / ".a.mp4.lock").touch()
    rerun = h3gen(*render, "--json", env=env, check_code=0)
    records = [(r["id"], r["status"]) for r in map(json.loads, rerun.stdout.splitlines())]
    assert records == [("a", "skipped"), ("b", "ok")]
    assert not list(out.glob(".*")), list(out.glob(".*"))
    assert all(validate_clip(out / f"{name}.mp4", expected_frames=124) == [] for name in "ab")


def test_a_rerun_leaves_the_claims_of_a_run_still_rendering(tmp_path):
    from h3gen.run.outputs import ClipClaim, clear_leftovers

    clip = tmp_path / "a.mp4"
    other_run = ClipClaim(clip)
    assert other_run.acquire()
    partial = tmp_path / ".a.mp4.partial.mp4"
    partial.write_bytes(b"being written")
    clear_leftovers(clip)
    assert partial.exists() and other_run.lock_path.exists()
    other_run.release()
    clear_leftovers(clip)
    assert not list(tmp_path.iterdir())


def test_weights_unloaded_in_a_reference_cycle_are_collected(tiny_model, tmp_path):
    """The loaded stages are held out of the per-clip collection (gc.freeze); an encoder whose model sits in a
    reference cycle is still collected once it is unloaded after the last chunk, and close() hands every held
    object back to the collector."""
    import torch

    from h3gen.cli.ui import PlainReporter
    from h3gen.config.preset import resolve
    from h3gen.inputs.prompts import read_prompts
    from h3gen.models.repo import ModelRepo
    from h3gen.plugins.manager import Registered, registry
    from h3gen.run.render import Renderer
    from h3gen.stages.encode import Qwen3VLEncoder

    loaded, held_during_render = [], []

    class CyclicEncoder(Qwen3VLEncoder):
        kind, name = "encode", "cyclic-encoder"

        def load(self, repo):
            super().load(repo)
            holder = {"weights": torch.ones(1 << 20)}
            holder["self"] = holder  # only the garbage collector frees this
            loaded.append(weakref.ref(holder["weights"]))
            self.holder = holder

        def unload(self):
            super().unload()
            self.holder = None

    found = registry()
    found.stages[("encode", "cyclic-encoder")] = Registered("encode", "cyclic-encoder", CyclicEncoder, "test")
    preset_file = tmp_path / "cyclic.toml"
    preset_file.write_text((ROOT / "presets" / "tiny.toml").read_text().replace('"qwen3vl"', '"cyclic-encoder"'))
    preset = resolve(str(preset_file), found)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(TWO_CLIPS)
    gc.disable()
    try:
        renderer = Renderer(preset, found, ModelRepo(tiny_model), PlainReporter(2))
        held_during_render.append(gc.get_freeze_count())
        results = list(renderer.render(read_prompts(prompts, 0, preset.request), tmp_path / "out"))
        assert loaded and loaded[0]() is None, "the unloaded encoder's weights are still alive"
        renderer.close()
        assert gc.get_freeze_count() == 0, "close() left objects out of the collector's reach"
    finally:
        gc.enable()
        gc.unfreeze()
    assert held_during_render[0] > 0 and [r.ok for r in results] == [True, True]


def test_the_embedding_cache_is_keyed_by_the_quant_stages_knobs(prompts_file, tmp_path):
    """Which roles the quant stage quantizes changes the text encoder's output: another roles list misses the cache."""
    prompts, cache = prompts_file("a fox\n"), tmp_path / "cache"
    args = ["--set", f"encode.cache_dir={cache}", "--set", "quant.use=fp8-rowwise"]
    h3gen("render", prompts, "-o", tmp_path / "a", *args, check_code=0)
    again = h3gen("render", prompts, "-o", tmp_path / "b", *args, check_code=0)
    assert "(1 from the embedding cache)" in again.stderr
    other = h3gen("render", prompts, "-o", tmp_path / "c", *args, "--set", 'quant.roles=["dit"]', check_code=0)
    assert "(0 from the embedding cache)" in other.stderr, other.stderr


def test_a_log_on_a_full_disk_loses_its_lines_but_not_the_clips(prompts_file, tmp_path, tiny_model):
    """`2>>log` on a full disk (cron): the clips and the manifest are written all the same, exit 0."""
    out = tmp_path / "out"
    with open("/dev/full", "w") as full:
        result = subprocess.run([sys.executable, "-m", "h3gen.cli.main", "render", str(prompts_file("a\nb\n")), "-o",
                                 str(out)], stderr=full, stdout=subprocess.PIPE, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0
    assert len(list(out.glob("*.mp4"))) == 2 and len((out / "manifest.jsonl").read_text().splitlines()) == 2


def test_json_lines_on_a_full_disk_are_named_as_standard_output(prompts_file, tmp_path, tiny_model):
    out = tmp_path / "out"
    with open("/dev/full", "w") as full:
        result = subprocess.run([sys.executable, "-m", "h3gen.cli.main", "render", str(prompts_file("a\n")), "-o",
                                 str(out), "--json"], stdout=full, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 1
    assert result.stderr.splitlines()[-1] == (
        "h3gen: error: cannot write the --json lines to standard output (No space left on device) (give standard "
        "output somewhere with room; a rerun resumes, keeping the clips written)")
    assert [p.name for p in out.glob("*.mp4")] and not list(out.glob(".*"))  # the clip itself is whole


def with_nan_weights(tiny_model, tmp_path, folder: str, damaged) -> Path:
    """A copy of the tiny model whose `folder` weights named by `damaged(name)` are all NaN."""
    import torch
    from safetensors.torch import load_file, save_file

    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    weights = model / folder / "diffusion_pytorch_model.safetensors"
    tensors = load_file(str(weights))
    names = [name for name in tensors if damaged(name)]
    assert names
    for name in names:
        tensors[name] = torch.full_like(tensors[name], float("nan"))
    save_file(tensors, str(weights), metadata={"format": "pt"})
    return model


def test_a_dit_whose_weights_hold_a_nan_fails_its_clips_naming_the_weights(prompts_file, tmp_path, tiny_model):
    """A NaN in a weight gives latents no decode or mux can use: the clip fails at the sampler, not in the AAC
    encoder, and no file is left."""
    model = with_nan_weights(tiny_model, tmp_path, "transformer",
                             lambda name: name.endswith("norm_out.linear.weight") or name.startswith("proj_out."))
    out = tmp_path / "out"
    result = h3gen("render", prompts_file('{"id": "nan", "prompt": "x"}\n'), "-o", out, "--model", model,
                   "--preset", "tiny", check_code=1)
    assert re.search(r"sampler stage 'euler' \(built into h3gen\) returned video and audio latents holding NaN or "
                     r"infinite values \(download the model again if its weights are damaged, or try a preset "
                     r"without FP8\)", result.stderr), result.stderr
    assert "h3gen bug" not in result.stderr and not (out / "nan.mp4").exists()


@pytest.mark.parametrize("folder, vae, broken", [("vae", "fast", "the frames"), ("vae", "reference", "the frames"),
                                                 ("audio_vae", "fast", "the soundtrack")])
def test_a_decoder_whose_weights_hold_a_nan_fails_its_clips_naming_the_weights(prompts_file, tmp_path, tiny_model,
                                                                                folder, vae, broken):
    """Damaged decoder weights with finite latents: the frames would clamp to a black clip that the run calls
    written, the soundtrack would stop the AAC encoder; the decode refuses the clip instead, and no file is left."""
    model = with_nan_weights(tiny_model, tmp_path, folder, lambda name: name.startswith(("decoder.", "post_quant")))
    out = tmp_path / "out"
    result = h3gen("render", prompts_file('{"id": "nan", "prompt": "x"}\n'), "-o", out, "--model", model,
                   "--preset", "tiny", "--set", f"vae.use={vae}", "--save-latents", check_code=1)
    assert (f"vae stage '{vae}' (built into h3gen) decoded {broken} to NaN or infinite values (download the model "
            "again if its weights are damaged, or try a preset without FP8)") in result.stderr, result.stderr
    assert "h3gen bug" not in result.stderr
    assert [p.name for p in out.iterdir()] == ["manifest.jsonl"]  # no MP4, and the clip's latents went with it
