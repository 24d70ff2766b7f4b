"""Out of memory, on the GPU and in the host: a clip that does not fit costs that clip with a hint, its memory goes
back before the next, and a clip that cannot fit is refused before the weights load."""

import gc
import re
import weakref
from pathlib import Path

import pytest

from conftest import ROOT, h3gen
from faulty import TWO_CLIPS, records


def test_out_of_memory_costs_one_clip_with_a_hint(faults, prompts_file, tmp_path):
    env, preset = faults
    out = tmp_path / "out"
    result = h3gen("render", prompts_file(TWO_CLIPS), "-o", out, "--preset", preset, "--json",
                   "--set", 'sampler.fail_ids=["a"]', env=env)
    assert result.returncode == 1, result.stderr[-2000:]
    clips = records(result)
    assert not clips["a"]["ok"] and clips["b"]["ok"]
    # the sampler is a plugin's: named, so its author can tell their stage ran out
    assert clips["a"]["error"] == ("out of GPU memory in sampler stage 'oom' (from plugin 'faults') (try --vram with "
                                   "less than the GPU has so DiT blocks stream, an FP8 preset, fewer frames or a "
                                   "smaller size)")
    assert "1 of 2 clips written, 1 failed" in result.stderr
    assert "failed a.mp4 (line 1): out of GPU memory in sampler stage 'oom' (from plugin 'faults') (try --vram" \
        in result.stderr
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
    assert re.fullmatch(r"the libraries and weights alone take 1\.\d GiB before any clip: run on a GPU, or free host "
                        "memory", refused.value.fix), refused.value.fix


def test_host_memory_free_is_what_the_kernel_says_is_available():
    """MemAvailable counts the page cache the kernel can drop: a machine that has just read its weights is not full."""
    from h3gen.run.budget import host_available_bytes

    meminfo = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in open("/proc/meminfo")}
    expected = meminfo["MemAvailable"]
    limit = Path("/sys/fs/cgroup/memory.max")
    if limit.exists() and limit.read_text().strip() != "max":  # a container's limit holds it lower
        expected = min(expected, int(limit.read_text()) - int(Path("/sys/fs/cgroup/memory.current").read_text()))
    assert abs(host_available_bytes() - expected) < 256 * 2**20


def cgroup_tree(tmp_path, membership: str, groups: dict) -> tuple:
    """A fake /sys/fs/cgroup: {relative folder: {file: text}}, and the /proc/self/cgroup that places the process."""
    for folder, files in groups.items():
        (tmp_path / folder).mkdir(parents=True, exist_ok=True)
        for name, text in files.items():
            (tmp_path / folder / name).write_text(text)
    (tmp_path / "self-cgroup").write_text(membership)
    return tmp_path, tmp_path / "self-cgroup"


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_host_memory_free_is_held_by_the_tightest_cgroup_above_the_process(tmp_path, version):
    """A container's or a unit's limit, at the root or at any level above the process's own cgroup, in cgroup v2 or
    v1's memory controller; what is charged counts but the page cache the kernel can drop."""
    from h3gen.run.budget import cgroup_headroom
    from h3gen.run.memory import GIB

    if version == "v2":
        membership, base, files, cache = "0::/job/step\n", "", ("memory.max", "memory.current"), "inactive_file"
        unlimited = "max\n"
    else:
        membership, base, files = "12:cpu,cpuacct:/job/step\n4:memory:/job/step\n0::/\n", "memory/", (
            "memory.limit_in_bytes", "memory.usage_in_bytes")
        cache, unlimited = "total_inactive_file", "9223372036854771712\n"
    limit, used = files
    mount, self_cgroup = cgroup_tree(tmp_path, membership, {
        base: {limit: unlimited, used: str(50 * GIB)},
        f"{base}job": {limit: str(8 * GIB), used: str(3 * GIB), "memory.stat": f"file 9\n{cache} {GIB}\n"},
        f"{base}job/step": {limit: str(16 * GIB), used: str(2 * GIB)},
    })
    assert cgroup_headroom(mount, self_cgroup) == 6 * GIB  # the job's 8 GiB less 3 charged, 1 of them droppable
    (mount / f"{base}job" / limit).write_text(unlimited)
    assert cgroup_headroom(mount, self_cgroup) == 14 * GIB  # the step's own
    (mount / f"{base}job/step" / limit).write_text(unlimited)
    assert cgroup_headroom(mount, self_cgroup) is None
    (mount / base.rstrip("/") / limit).write_text(str(60 * GIB))  # a container's, where its namespace shows it as /
    assert cgroup_headroom(mount, self_cgroup) == 10 * GIB
    assert cgroup_headroom(mount, tmp_path / "missing") is None


def test_host_memory_that_ran_out_in_a_plugin_s_stage_names_the_stage(tmp_path):
    from h3gen.inputs.request import Request
    from h3gen.run.render import HOST_OOM_HINT, clip_error
    from h3gen.stages.base import Stage
    from h3gen.stages.clip import Clip

    class Greedy(Stage):
        kind, name, origin = "vae", "greedy", "mine"

    class Builtin(Stage):
        kind, name = "vae", "own"

    clip = Clip(request=Request(index=0, prompt="a", seed=0, width=32, height=32, frames=124), path=tmp_path / "a.mp4",
                preset="tiny")
    for stage, line in ((Greedy, "out of host memory in vae stage 'greedy' (from plugin 'mine') (try fewer frames"),
                        (Builtin, HOST_OOM_HINT)):
        try:
            raise stage.failed("raised MemoryError") from MemoryError()
        except Exception as failed:
            assert clip_error(clip, failed).startswith(line)
