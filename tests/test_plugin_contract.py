"""The stage contract holds a plugin to what docs/plugins.md says: a stage that breaks it costs what the document
says, named with its kind and plugin, in one line (the traceback only with --traceback); a bad Config or a name
clash is refused at registration."""

import av
import pytest

from conftest import h3gen, installed_plugins
from h3gen.run.fingerprint import read_stamp
from faulty import install

FAULTY = '''
import dataclasses, os
import sys
from h3gen.errors import ClipError, ModelError, UsageError
from h3gen.plugins.hookspecs import hookimpl
from h3gen.stages.base import Wrapped
from h3gen.stages.vae import FrameFilter


@dataclasses.dataclass
class FaultyConfig:
    fault: str = ""  # check, init, load, None (returned), raise, unload
    wraps: Wrapped = dataclasses.field(default_factory=Wrapped)


class Faulty(FrameFilter):
    kind, name = "vae", "faulty"
    Config = FaultyConfig

    @classmethod
    def check_config(cls, config):
        if config.fault == "check":
            raise UsageError("vae.fault = check is refused", "pick another fault")
        if config.fault == "check-other":
            raise ValueError("no such fault")

    @classmethod
    def check_model(cls, config, repo):
        if config.fault == "check-model":
            raise UsageError("vae.fault = check-model does not fit this model", "pick another fault")

    @classmethod
    def check_device(cls, config, device, dtype):
        if config.fault == "check-device":
            raise UsageError(f"vae.fault = check-device does not run on {device} in {dtype}", "pick another fault")

    def __init__(self, config, runtime):
        if config.fault == "init":
            raise KeyError("no such knob")
        if config.fault == "init-memory":
            raise RuntimeError("can't start new thread")
        if config.fault == "init-usage":
            raise UsageError("vae.fault = init-usage cannot start", "pick another fault")
        super().__init__(config, runtime)

    def load(self, repo):
        if self.config.fault == "load":
            raise RuntimeError("no weights here")
        if self.config.fault == "load-memory":
            raise ImportError("libtorch_cpu.so: failed to map segment from shared object")
        super().load(repo)

    def change(self, frames):
        pass

    def run(self, clip):
        if clip.request.id == "bad" and self.config.fault == "None":
            return None
        if clip.request.id == "bad" and self.config.fault == "raise":
            raise ValueError("boom in run")
        if clip.request.id == "bad" and self.config.fault == "skip":
            return clip  # no decode: no frames, nothing handed over
        if clip.request.id == "bad" and self.config.fault == "clip":
            raise ClipError("this clip's prompt is refused", "write another prompt")
        if clip.request.id == "bad" and self.config.fault == "model":
            raise ModelError("the model has no weights for faulty", "use a model with them")
        if clip.request.id == "bad" and self.config.fault == "exit":
            sys.exit(3)
        if clip.request.id == "bad" and self.config.fault == "interrupt":
            raise KeyboardInterrupt
        clip = super().run(clip)
        if clip.request.id == "bad" and self.config.fault == "float":
            clip.frames = clip.frames.astype("float32")
        if clip.request.id == "bad" and self.config.fault == "few":
            clip.frames = clip.frames[:10]
        if clip.request.id == "bad" and self.config.fault == "mono":
            clip.audio = clip.audio[:1]
        if clip.request.id == "bad" and self.config.fault == "short":
            clip.audio = clip.audio[:, : clip.audio.shape[1] // 2]
        if clip.request.id == "bad" and self.config.fault == "nan-audio":
            clip.audio = clip.audio * float("nan")
        return clip

    def unload(self):
        super().unload()
        if self.config.fault == "unload":
            raise RuntimeError("cannot let go")


@hookimpl
def h3gen_register_stages(register):
    register(Faulty)
'''

PROMPTS = '{"id": "bad", "prompt": "a fox"}\n{"id": "good", "prompt": "waves"}\n'


@pytest.fixture
def faulty(tmp_path):
    return install(tmp_path / "site", "faulty", FAULTY)


def render(env, prompts_file, tmp_path, fault, *args):
    return h3gen("render", prompts_file(PROMPTS), "-o", tmp_path / "out", "--set", "vae.use=faulty",
                 "--set", f"vae.fault={fault}", *args, env=env)


@pytest.mark.parametrize("fault, message", [
    ("None", "vae stage 'faulty' (from plugin 'faulty') returned NoneType from run(), not the clip (run(clip) must "
             "return the clip it was given"),
    ("raise", "vae stage 'faulty' (from plugin 'faulty') raised ValueError: boom in run (rerun with --traceback "
              "for where; fix the stage, or pick another in the preset)"),
    ("clip", "vae stage 'faulty' (from plugin 'faulty'): this clip's prompt is refused (write another prompt)"),
])
def test_a_stage_that_breaks_its_run_costs_its_clip_named(faulty, prompts_file, tmp_path, fault, message):
    result = render(faulty, prompts_file, tmp_path, fault)
    assert result.returncode == 1, result.stderr[-3000:]
    assert f"failed bad.mp4 (line 1): {message}" in result.stderr
    assert "Traceback" not in result.stderr and "1 of 2 clips written" in result.stderr
    assert sorted(p.name for p in (tmp_path / "out").glob("*.mp4")) == ["good.mp4"]


def test_a_model_error_from_run_ends_the_run(faulty, prompts_file, tmp_path):
    """docs/plugins.md: a model directory that cannot serve any clip ends the run, exit 2, rather than failing each."""
    result = render(faulty, prompts_file, tmp_path, "model")
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.splitlines()[-1] == ("h3gen: error: vae stage 'faulty' (from plugin 'faulty'): the model has "
                                              "no weights for faulty (use a model with them)")
    assert "good" not in result.stderr and not list(tmp_path.glob("out/*.mp4"))


def test_a_run_a_model_error_ends_after_a_clip_was_written_says_its_summary_first(faulty, prompts_file, tmp_path):
    """The summary agrees with the manifest, which holds the written clip; the error's line ends the output."""
    result = h3gen("render", prompts_file('{"id": "good", "prompt": "waves"}\n{"id": "bad", "prompt": "a fox"}\n'),
                   "-o", tmp_path / "out", "--set", "vae.use=faulty", "--set", "vae.fault=model", env=faulty)
    assert result.returncode == 2, result.stderr[-3000:]
    lines = result.stderr.splitlines()
    assert "1 of 2 clips written, 1 not rendered" in lines[-2] and lines[-1].startswith("h3gen: error: vae stage")
    assert [p.name for p in (tmp_path / "out").glob("*.mp4")] == ["good.mp4"]


@pytest.mark.parametrize("fault, raised", [("exit", "SystemExit: 3"), ("interrupt", "KeyboardInterrupt (rerun")])
def test_a_stage_that_exits_or_interrupts_from_run_costs_its_clip(faulty, prompts_file, tmp_path, fault, raised):
    result = render(faulty, prompts_file, tmp_path, fault)
    assert result.returncode == 1, result.stderr[-3000:]
    assert f"failed bad.mp4 (line 1): vae stage 'faulty' (from plugin 'faulty') raised {raised}" in result.stderr
    assert "1 of 2 clips written" in result.stderr
    assert sorted(p.name for p in (tmp_path / "out").glob("*.mp4")) == ["good.mp4"]


@pytest.mark.parametrize("decode, workers, missing", [
    ("reference", 2, "clip.frames or clip.audio"),
    ("fast", 0, "clip.frames or clip.audio"),
    ("fast", 2, "finishing clip.arriving with its audio"),  # the mux started with the decode: not left waiting
])
def test_a_vae_that_hands_on_no_frames_is_named_not_the_mux(faulty, prompts_file, tmp_path, decode, workers, missing):
    result = render(faulty, prompts_file, tmp_path, "skip", "--set", f"vae.wraps.use={decode}",
                    "--set", f"mux.workers={workers}")
    assert result.returncode == 1, result.stderr[-3000:]
    assert (f"failed bad.mp4 (line 1): vae stage 'faulty' (from plugin 'faulty') returned the clip without {missing} "
            "(a vae's run(clip) sets clip.frames") in result.stderr
    assert "mux stage" not in result.stderr and "1 of 2 clips written" in result.stderr
    assert sorted(p.name for p in (tmp_path / "out").glob("*.mp4")) == ["good.mp4"]


@pytest.mark.parametrize("fault, problem", [
    ("float", "returned a clip whose frames are float32 (124, 32, 32, 3), not uint8 (124, 32, 32, 3)"),
    ("few", "returned a clip whose frames are uint8 (10, 32, 32, 3), not uint8 (124, 32, 32, 3)"),
    ("mono", "returned a clip whose audio is float32 (1, "),
    ("short", "returned a clip whose audio lasts 2.587 s at 32000 Hz, the frames 5.167 s"),
    ("nan-audio", "returned a clip whose audio holds NaN or infinite values"),
])
def test_a_vae_that_hands_on_frames_or_a_soundtrack_of_another_shape_is_named_not_the_mux(
        faulty, prompts_file, tmp_path, fault, problem):
    """Frames or a soundtrack the mux cannot take, or would write into a clip `validate` refuses, are the vae's
    failure: the clip is not written, nor counted, nor rendered again as damaged on every rerun."""
    result = render(faulty, prompts_file, tmp_path, fault, "--set", "vae.wraps.use=reference")
    assert result.returncode == 1, result.stderr[-3000:]
    assert f"failed bad.mp4 (line 1): vae stage 'faulty' (from plugin 'faulty') {problem}" in result.stderr
    assert "mux stage" not in result.stderr and "1 of 2 clips written" in result.stderr
    assert sorted(p.name for p in (tmp_path / "out").glob("*.mp4")) == ["good.mp4"]


def test_in_a_group_a_vae_s_refused_frames_cost_their_clip_alone(faulty, prompts_file, tmp_path):
    """Every rank ran the decode; the first finds its frames refused. The ranks are in step, so the group goes on to
    the next clip rather than ending the run."""
    result = render(faulty, prompts_file, tmp_path, "few", "--set", "vae.wraps.use=reference", "--set",
                    "sampler.dit=h3gen", "--cpu-workers", "2", "--ulysses", "2")
    assert result.returncode == 1, result.stderr[-3000:]
    assert ("failed bad.mp4 (line 1): vae stage 'faulty' (from plugin 'faulty') returned a clip whose frames are uint8 "
            "(10, 32, 32, 3)") in result.stderr
    assert "1 of 2 clips written" in result.stderr and "rank " not in result.stderr
    assert sorted(p.name for p in (tmp_path / "out").glob("*.mp4")) == ["good.mp4"]


NO_WRITE = '''
import dataclasses
from h3gen.plugins.hookspecs import hookimpl
from h3gen.stages.base import Stage


@dataclasses.dataclass
class NoWriteConfig:
    write: str = ""  # "", unstamped, stamped, truncated or text


class NoWrite(Stage):
    kind, name = "mux", "nowrite"
    Config = NoWriteConfig

    def run(self, clip):
        from h3gen.run.fingerprint import stamp
        from h3gen.stages.mux import write_mp4

        if self.config.write == "text":
            clip.path.write_text("not a movie")
        elif self.config.write:
            write_mp4(clip.path, clip.frames, clip.audio, clip.sample_rate,
                      comment=stamp(clip.fingerprint) if self.config.write != "unstamped" else "")
        if self.config.write == "truncated":
            whole = clip.path.read_bytes()
            clip.path.write_bytes(whole[:len(whole) // 2])
        return clip


@hookimpl
def h3gen_register_stages(register):
    register(NoWrite)
'''


def test_a_mux_that_writes_no_file_fails_its_clip(tmp_path, prompts_file):
    env = install(tmp_path / "site", "nowrite", NO_WRITE)
    out = tmp_path / "out"
    result = h3gen("render", prompts_file(PROMPTS), "-o", out, "--set", "mux.use=nowrite", env=env, check_code=1)
    assert (f"failed bad.mp4 (line 1): mux stage 'nowrite' (from plugin 'nowrite') returned without writing "
            f"{out / 'bad.mp4'} (a mux's run(clip) writes the MP4 at clip.path") in result.stderr
    assert "0 of 2 clips written" in result.stderr
    assert '"status": "ok"' not in (out / "manifest.jsonl").read_text()


def test_a_mux_that_writes_without_the_stamp_fails_its_clip_and_one_with_it_is_skipped_on_a_rerun(
        tmp_path, prompts_file):
    """Unstamped, every rerun would leave the clip as one h3gen did not write: the mux's clip fails now, named."""
    env = install(tmp_path / "site", "nowrite", NO_WRITE)
    out, prompts = tmp_path / "out", prompts_file(PROMPTS)
    result = h3gen("render", prompts, "-o", out, "--set", "mux.use=nowrite", "--set", "mux.write=unstamped",
                   env=env, check_code=1)
    assert ("failed bad.mp4 (line 1): mux stage 'nowrite' (from plugin 'nowrite') wrote bad.mp4 without the stamp "
            "of clip.fingerprint a rerun reads (pass comment=h3gen.run.fingerprint.stamp(clip.fingerprint) to "
            "write_mp4") in result.stderr
    assert "0 of 2 clips written" in result.stderr and not list(out.glob("*.mp4"))
    stamped = ("render", prompts, "-o", out, "--set", "mux.use=nowrite", "--set", "mux.write=stamped")
    assert "2 of 2 clips written" in h3gen(*stamped, env=env, check_code=0).stderr
    assert "2 already there and valid (skipped)" in h3gen(*stamped, env=env, check_code=0).stderr


def test_a_mux_that_writes_something_other_than_an_mp4_is_told_so(tmp_path, prompts_file):
    env = install(tmp_path / "site", "nowrite", NO_WRITE)
    out = tmp_path / "out"
    result = h3gen("render", prompts_file(PROMPTS), "-o", out, "--set", "mux.use=nowrite", "--set", "mux.write=text",
                   env=env, check_code=1)
    assert ("failed bad.mp4 (line 1): mux stage 'nowrite' (from plugin 'nowrite') wrote bad.mp4, which is not an MP4 "
            "(write it with h3gen.stages.mux.write_mp4, or wrap the pyav mux: docs/plugins.md)") in result.stderr
    assert not list(out.glob("*.mp4"))


def test_a_mux_that_leaves_its_mp4_cut_short_is_told_so_not_that_the_stamp_is_missing(tmp_path, prompts_file):
    env = install(tmp_path / "site", "nowrite", NO_WRITE)
    out = tmp_path / "out"
    result = h3gen("render", prompts_file(PROMPTS), "-o", out, "--set", "mux.use=nowrite", "--set",
                   "mux.write=truncated", env=env, check_code=1)
    assert ("failed bad.mp4 (line 1): mux stage 'nowrite' (from plugin 'nowrite') wrote bad.mp4, which is truncated: "
            "box ") in result.stderr
    assert "(write the whole MP4 under a temporary name and rename it to clip.path when closed" in result.stderr
    assert "without the stamp" not in result.stderr and not list(out.glob("*.mp4"))


LATENTS = '''
import dataclasses
import torch
from h3gen.plugins.hookspecs import hookimpl
from h3gen.stages.base import Wrapped, Wrapper


@dataclasses.dataclass
class LatentsConfig:
    fault: str = ""  # shape, none, int, not-finite
    wraps: Wrapped = dataclasses.field(default_factory=Wrapped)


class Latents(Wrapper):
    kind, name = "sampler", "latents"
    Config = LatentsConfig

    def run(self, clip):
        clip = self.inner.run(clip)
        if clip.request.id == "bad":
            if self.config.fault == "shape":
                clip.video_latents = clip.video_latents[..., :1]
            if self.config.fault == "none":
                clip.audio_latents = None
            if self.config.fault == "int":
                clip.video_latents = clip.video_latents.long()
            if self.config.fault == "not-finite":
                clip.audio_latents = torch.full_like(clip.audio_latents, float("nan"))
        return clip


@hookimpl
def h3gen_register_stages(register):
    register(Latents)
'''


@pytest.mark.parametrize("fault, problem", [
    ("shape", "returned a clip whose video latents are torch.float32 (1, 24, 37, 2, 1), not float (1, 24, 37, 2, 2) (a "
              "sampler's run(clip) sets clip.video_latents and clip.audio_latents as the request's shapes say"),
    ("none", "returned a clip whose audio latents are NoneType, not float (2, 32, 207)"),
    ("int", "returned a clip whose video latents are torch.int64 (1, 24, 37, 2, 2), not float"),
    ("not-finite", "returned audio latents holding NaN or infinite values (a sampler's latents must be finite: "
            "docs/plugins.md)"),
])
def test_a_sampler_that_returns_latents_the_decode_cannot_take_is_named_not_the_decode(
        tmp_path, prompts_file, fault, problem):
    """Latents of another shape or type, or not finite, are the sampler's failure: its own line, not the decode's
    error blamed on h3gen."""
    env = install(tmp_path / "site", "latents", LATENTS)
    out = tmp_path / "out"
    result = h3gen("render", prompts_file(PROMPTS), "-o", out, "--set", "sampler.use=latents",
                   "--set", "sampler.fault=" + fault, env=env, check_code=1)
    assert f"failed bad.mp4 (line 1): sampler stage 'latents' (from plugin 'latents') {problem}" in result.stderr
    assert "h3gen bug" not in result.stderr and "vae stage" not in result.stderr
    assert sorted(p.name for p in out.glob("*.mp4")) == ["good.mp4"]


def test_in_a_group_a_sampler_s_refused_latents_cost_their_clip_alone(tmp_path, prompts_file):
    """Every rank holds the same latents and refuses them alike, before the decode the ranks share."""
    env = install(tmp_path / "site", "latents", LATENTS)
    out = tmp_path / "out"
    result = h3gen("render", prompts_file(PROMPTS), "-o", out, "--set", "sampler.use=latents", "--set",
                   "sampler.fault=not-finite", "--set", "sampler.wraps.dit=h3gen", "--set", "vae.use=fast", "--cpu-workers", "2", "--ulysses",
                   "2", env=env, timeout=600)
    assert result.returncode == 1, result.stderr[-3000:]
    assert ("failed bad.mp4 (line 1): sampler stage 'latents' (from plugin 'latents') returned audio latents holding "
            "NaN") in result.stderr
    assert "1 of 2 clips written" in result.stderr and "rank " not in result.stderr
    assert sorted(p.name for p in out.glob("*.mp4")) == ["good.mp4"]


@pytest.mark.parametrize("fault, what", [("init", "failed to start: KeyError: 'no such knob'"),
                                         ("load", "failed to load: RuntimeError: no weights here")])
def test_a_stage_that_fails_to_start_or_load_ends_the_run_in_one_line(faulty, prompts_file, tmp_path, fault, what):
    result = render(faulty, prompts_file, tmp_path, fault)
    assert result.returncode == 1
    assert result.stderr.splitlines()[-1] == (
        f"h3gen: error: vae stage 'faulty' (from plugin 'faulty') {what} (rerun with --traceback for where; fix the "
        "stage, or pick another in the preset)")
    assert "Traceback" not in result.stderr and not list((tmp_path / "out").glob("*.mp4"))
    traced = render(faulty, prompts_file, tmp_path, fault, "--traceback")
    assert "Traceback (most recent call last)" in traced.stderr and "faulty.py" in traced.stderr


@pytest.mark.parametrize("fault, what", [("init-memory", "failed to start: RuntimeError: can't start new thread"),
                                         ("load-memory", "failed to load: ImportError: libtorch_cpu.so: failed to map "
                                                         "segment from shared object")])
def test_a_stage_the_host_s_memory_fails_says_so_not_a_bug(faulty, prompts_file, tmp_path, fault, what):
    result = render(faulty, prompts_file, tmp_path, fault)
    assert result.returncode == 1
    assert result.stderr.splitlines()[-1] == (
        f"h3gen: error: vae stage 'faulty' (from plugin 'faulty') {what} (out of host memory: leave h3gen more: close "
        "other programs or raise `ulimit -v`; or render fewer frames or a smaller size)")


def test_out_of_host_memory_outside_any_stage_is_one_line_not_a_bug(monkeypatch, capsys):
    import errno

    import h3gen.cli.main as main

    def out_of_memory(**kwargs):
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    monkeypatch.setattr(main, "app", out_of_memory)
    monkeypatch.setattr(main.os, "environ", dict(main.os.environ))  # what main sets for torch stays in the test
    monkeypatch.setattr(main, "reopen_closed_streams", lambda: None)
    monkeypatch.setattr("h3gen.run.memory.exit_soon", lambda: None)
    with pytest.raises(SystemExit) as stopped:
        main.main()
    assert stopped.value.code == 1
    assert capsys.readouterr().err.strip() == ("h3gen: error: out of host memory, OSError: [Errno 12] Cannot allocate "
                                               "memory (leave h3gen more: close other programs or raise `ulimit -v`; "
                                               "or render fewer frames or a smaller size)")


def test_a_plugin_s_own_error_as_it_starts_names_the_stage(faulty, prompts_file, tmp_path):
    result = render(faulty, prompts_file, tmp_path, "init-usage")
    assert result.returncode == 2
    assert result.stderr.splitlines()[-1] == ("h3gen: error: vae stage 'faulty' (from plugin 'faulty'): vae.fault = "
                                              "init-usage cannot start (pick another fault)")


def test_a_refused_config_is_one_line_and_its_origin_only_with_traceback(faulty, prompts_file, tmp_path):
    result = render(faulty, prompts_file, tmp_path, "check")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.splitlines()[-1].startswith("h3gen: error: --set vae.fault: vae.fault = check is refused")
    traced = render(faulty, prompts_file, tmp_path, "check", "--traceback")
    assert traced.returncode == 2 and traced.stderr.splitlines()[-1] == result.stderr.splitlines()[-1]
    assert "Traceback (most recent call last)" in traced.stderr and "faulty.py" in traced.stderr


def test_a_model_check_s_refusal_says_where_the_value_came_from(faulty, prompts_file, tmp_path):
    result = render(faulty, prompts_file, tmp_path, "check-model", "--dry-run")
    assert result.returncode == 2
    assert result.stderr.splitlines()[-1] == ("h3gen: error: --set vae.fault: vae.fault = check-model does not fit "
                                              "this model (pick another fault)")


@pytest.mark.parametrize("dry", [True, False])
def test_a_device_check_s_refusal_comes_before_any_weight_loads(faulty, prompts_file, tmp_path, dry):
    result = render(faulty, prompts_file, tmp_path, "check-device", *(["--dry-run"] if dry else []))
    assert result.returncode == 2 and "loaded" not in result.stderr
    assert result.stderr.splitlines()[-1] == ("h3gen: error: --set vae.fault: vae.fault = check-device does not run "
                                              "on cpu in float32 (pick another fault)")
    assert not list(tmp_path.glob("**/*.mp4"))


def test_a_wrapper_s_own_config_check_leaves_the_wrapped_stage_s_check_in_place(faulty, prompts_file, tmp_path):
    """Faulty overrides check_config without calling super(): the decode it wraps is checked all the same."""
    result = h3gen("render", prompts_file(PROMPTS), "-o", tmp_path / "out", "--set", "vae.use=fast", "--set",
                   "vae.use=faulty", "--set", "vae.wraps.tile_batch=2", "--set", "vae.wraps.attention=bogus",
                   "--dry-run", env=faulty)
    assert result.returncode == 2, result.stderr[-2000:]
    # the wrapped decode names its key as its own, vae.attention: the line says where it was set, vae.wraps.attention
    assert result.stderr.splitlines()[-1].startswith("h3gen: error: --set vae.wraps.attention: ")
    assert "bogus" in result.stderr.splitlines()[-1] and not (tmp_path / "out").exists()


def test_a_config_check_that_raises_something_else_is_the_stage_s_failure_named(faulty, prompts_file, tmp_path):
    """And with --traceback given, the line points to the traceback printed above it, not to --traceback."""
    result = render(faulty, prompts_file, tmp_path, "check-other", "--dry-run")
    assert result.returncode == 1
    assert result.stderr.splitlines()[-1] == (
        "h3gen: error: vae stage 'faulty' (from plugin 'faulty') raised ValueError: no such fault while checking its "
        "settings (rerun with --traceback for where; fix the stage, or pick another in the preset)")
    traced = render(faulty, prompts_file, tmp_path, "check-other", "--dry-run", "--traceback")
    assert traced.returncode == 1 and "Traceback (most recent call last)" in traced.stderr
    assert traced.stderr.splitlines()[-1].endswith(
        "while checking its settings (the traceback above says where; fix the stage, or pick another in the preset)")


def test_a_stage_that_fails_to_unload_is_reported_and_the_clips_stay(faulty, prompts_file, tmp_path):
    result = render(faulty, prompts_file, tmp_path, "unload")
    assert result.returncode == 0, result.stderr[-3000:]
    assert ("h3gen: warning: vae stage 'faulty' (from plugin 'faulty') failed to unload: RuntimeError: cannot let go"
            in result.stderr)
    assert len(list((tmp_path / "out").glob("*.mp4"))) == 2


BAD_CONFIGS = '''
import dataclasses
from h3gen.plugins.hookspecs import hookimpl
from h3gen.stages.mux import PyAVMux


class NotADataclass:
    crf: int = 18


@dataclasses.dataclass
class NoDefault:
    crf: int


@dataclasses.dataclass
class OddType:
    crf: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class WrongDefault:
    crf: int = "abc"


def mux(name, config):
    return type(name, (PyAVMux,), {{"name": name, "Config": config}})


@hookimpl
def h3gen_register_stages(register):
    register(mux({stage!r}, {config}))
'''

CLASHING_PRESET = '''
from h3gen.plugins.hookspecs import hookimpl


@hookimpl
def h3gen_register_presets(register):
    register({path!r})
'''


@pytest.mark.parametrize("config, why", [
    ("NotADataclass", "its Config <class 'h3gen_bad.NotADataclass'> is not a dataclass"),
    ("NoDefault", "its Config field 'crf' has no default"),
    ("OddType", "its Config field 'crf' is <class 'dict'>: use bool, int, float, str or a list of one of them"),
    ("WrongDefault", "its Config field 'crf' is int with the default 'abc'"),
])
def test_a_config_that_breaks_the_rules_is_refused_at_registration(tmp_path, config, why):
    env = install(tmp_path / "site", "bad", BAD_CONFIGS.format(stage="bad-mux", config=config))
    result = h3gen("plugins", env=env, check_code=0)
    assert f"h3gen: plugin 'bad' failed during registration: mux stage 'bad-mux': {why} (skipped; " in result.stderr
    assert "bad-mux" not in result.stdout


NAMELESS_OR_IDLE = '''
from h3gen.plugins.hookspecs import hookimpl
from h3gen.stages.base import Stage


class Idle(Stage):
    kind, name = "vae", {name!r}


@hookimpl
def h3gen_register_stages(register):
    register(Idle)
'''


@pytest.mark.parametrize("name, why", [
    ("", "Idle needs a kind (one of encode, sampler, vae, quant, mux, cache) and a name (a word, as `use = \"name\"` "
         "names it)"),
    ("idle", "vae stage 'idle' has no run(clip)"),
])
def test_a_stage_without_a_name_or_a_run_is_refused_at_registration(tmp_path, name, why):
    env = install(tmp_path / "site", "idle", NAMELESS_OR_IDLE.format(name=name))
    result = h3gen("plugins", env=env, check_code=0)
    assert f"h3gen: plugin 'idle' failed during registration: {why} (skipped; " in result.stderr


def test_a_preset_named_like_a_builtin_is_refused_as_a_stage_clash_is(tmp_path):
    preset = tmp_path / "tiny.toml"
    preset.write_text('version = 1\ndescription = "an impostor"\nextends = "h3-base"\n')
    env = install(tmp_path / "site", "clash", CLASHING_PRESET.format(path=str(preset)))
    result = h3gen("presets", "list", env=env, check_code=0)
    assert ("h3gen: plugin 'clash' failed during registration: preset 'tiny' is already registered by h3gen "
            "(built-in) (skipped; ") in result.stderr


def test_a_stage_left_out_by_load_plugins_is_named_as_such(faulty, prompts_file, tmp_path):
    result = h3gen("render", prompts_file("x\n"), "-o", tmp_path / "out", "--set", "vae.use=faulty",
                   env={**faulty, "H3GEN_LOAD_PLUGINS": "nope"}, check_code=2)
    assert "unknown vae stage 'faulty' (registered vae stages: diffusers, fast, reference; " in result.stderr
    installed = installed_plugins("faulty")
    assert (f"plugin 'nope' is named in H3GEN_LOAD_PLUGINS, and no such plugin is installed (installed: "
            f"{', '.join(installed)}); H3GEN_LOAD_PLUGINS=nope leaves out the installed plugin(s) "
            f"{', '.join(map(repr, installed))}, which may register it)") in result.stderr


SIDECAR = '''
import dataclasses, json
from h3gen.plugins.hookspecs import hookimpl
from h3gen.stages.base import Wrapped, Wrapper


@dataclasses.dataclass
class SidecarConfig:
    fail: bool = False
    title: str = ""
    wraps: Wrapped = dataclasses.field(default_factory=Wrapped)


class Sidecar(Wrapper):
    kind, name = "mux", "sidecar"
    Config = SidecarConfig

    def run(self, clip):
        if self.config.title:
            clip.tags["title"] = self.config.title
        clip = self.inner.run(clip)
        if self.config.fail:
            return None  # after the inner mux wrote the MP4
        clip.path.with_suffix(".json").write_text(json.dumps({"seed": clip.request.seed}))
        return clip


@hookimpl
def h3gen_register_stages(register):
    register(Sidecar)
'''


@pytest.mark.parametrize("workers", [2, 0])
def test_a_mux_wrapper_runs_on_the_background_mux_and_a_failure_leaves_no_file(tmp_path, prompts_file, workers):
    env = install(tmp_path / "site", "sidecar", SIDECAR)
    args = ["--set", "mux.use=sidecar", "--set", f"mux.wraps.workers={workers}"]
    out = tmp_path / "out"
    h3gen("render", prompts_file('{"id": "a", "prompt": "a fox"}\n'), "-o", out, *args, "--set",
          "mux.title=a fox at dawn", env=env, check_code=0)
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == ["a.json", "a.mp4", "manifest.jsonl"]
    with av.open(str(out / "a.mp4")) as container:  # the wrapper's tag, and the stamp a rerun reads
        assert container.metadata["title"] == "a fox at dawn"
    assert read_stamp(out / "a.mp4")["mux.title"] == "a fox at dawn"
    assert h3gen("validate", out, check_code=0).stdout == f"{out / 'a.mp4'}: ok\n"
    failed = tmp_path / "failed"
    result = h3gen("render", prompts_file('{"id": "a", "prompt": "a fox"}\n'), "-o", failed, *args,
                   "--set", "mux.fail=true", env=env, check_code=1)
    assert "mux stage 'sidecar' (from plugin 'sidecar') returned NoneType" in result.stderr
    assert not list(failed.glob("*.mp4"))  # the inner mux's file went with the failed clip


def test_a_misspelled_load_plugins_name_under_strict_plugins_asks_for_the_name_fixed(faulty):
    result = h3gen("plugins", "--strict-plugins", env={**faulty, "H3GEN_LOAD_PLUGINS": "nosuch"}, check_code=2)
    assert result.stderr == ("h3gen: error: plugin 'nosuch' is named in H3GEN_LOAD_PLUGINS, and no such plugin is "
                             f"installed (installed: {', '.join(installed_plugins('faulty'))}) (correct the name in "
                             "H3GEN_LOAD_PLUGINS or install the plugin, or run without --strict-plugins and "
                             "H3GEN_STRICT_PLUGINS)\n")


def test_a_wrapped_stage_s_run_only_keys_leave_the_clip_s_fingerprint_alone(tmp_path, prompts_file):
    """mux.workers picks where the mux runs, never what it writes: under a wrapper as well (mux.wraps.workers)."""
    env = install(tmp_path / "site", "sidecar", SIDECAR)
    prompts, out = prompts_file('{"id": "a", "prompt": "a fox"}\n'), tmp_path / "out"
    h3gen("render", prompts, "-o", out, "--set", "mux.use=sidecar", env=env, check_code=0)
    again = h3gen("render", prompts, "-o", out, "--set", "mux.use=sidecar", "--set", "mux.wraps.workers=0",
                  "--dry-run", env=env, check_code=0)
    assert "skip" in again.stdout + again.stderr and "conflict" not in again.stdout + again.stderr, again.stderr
    changed = h3gen("render", prompts, "-o", out, "--set", "mux.use=sidecar", "--set", "mux.wraps.crf=20",
                    "--dry-run", env=env)
    assert "mux.wraps.crf: 18 -> 20" in changed.stdout + changed.stderr, changed.stderr


QUANT = '''
from h3gen.plugins.hookspecs import hookimpl
from h3gen.stages.base import Stage
from h3gen.stages.quant import QuantStage


class Bare(Stage):
    kind, name = "quant", "bare"

    def quantize(self, role, module, prefix=""):
        return module


class Broken(QuantStage):
    kind, name = "quant", "broken"

    def quantize(self, role, module, prefix=""):
        {body}


@hookimpl
def h3gen_register_stages(register):
    register({registered})
'''


def test_a_quant_stage_not_built_on_quantstage_is_refused_at_registration(tmp_path):
    env = install(tmp_path / "site", "q", QUANT.format(body="return module", registered="Bare"))
    result = h3gen("plugins", env=env, check_code=0)
    assert ("h3gen: plugin 'q' failed during registration: quant stage 'bare' is not built on "
            "h3gen.stages.quant.QuantStage (subclass it and implement quantize) (skipped; ") in result.stderr


@pytest.mark.parametrize("body, what", [("raise ValueError('no scales')", "raised ValueError: no scales quantizing the"),
                                        ("return None", "returned None quantizing the")])
def test_a_quant_stage_that_fails_is_named_not_the_stage_that_loads(tmp_path, prompts_file, body, what):
    env = install(tmp_path / "site", "q", QUANT.format(body=body, registered="Broken"))
    result = h3gen("render", prompts_file(PROMPTS), "-o", tmp_path / "out", "--set", "quant.use=broken", env=env)
    assert result.returncode == 1, result.stderr[-2000:]
    assert result.stderr.splitlines()[-1].startswith(f"h3gen: error: quant stage 'broken' (from plugin 'q') {what}")
    assert not list((tmp_path / "out").glob("*.mp4"))


INVERT = '''
import dataclasses
from h3gen.plugins.hookspecs import hookimpl
from h3gen.stages.base import Wrapped, Wrapper


@dataclasses.dataclass
class InvertConfig:
    wraps: Wrapped = dataclasses.field(default_factory=Wrapped)


class Invert(Wrapper):
    kind, name = "vae", "invert"
    Config = InvertConfig

    def run(self, clip):
        clip = self.inner.run(clip)
        clip.frames = 255 - clip.frames
        return clip


@hookimpl
def h3gen_register_stages(register):
    register(Invert)
'''


@pytest.mark.parametrize("workers", [2, 0])
def test_a_vae_wrapper_that_edits_the_finished_frames_gets_them_from_a_decode_that_hands_frames_over(
        tmp_path, prompts_file, workers):
    """`fast` hands its frames to a background mux as they decode; under a plain wrapper it sets clip.frames instead,
    so what the wrapper does to them is what the clip holds."""
    import av
    import numpy as np

    env = install(tmp_path / "site", "invert", INVERT)
    prompts = prompts_file('{"id": "a", "prompt": "a fox"}\n')
    common = ["--set", "vae.use=fast", "--set", f"mux.workers={workers}"]
    h3gen("render", prompts, "-o", tmp_path / "plain", *common, env=env, check_code=0)
    h3gen("render", prompts, "-o", tmp_path / "inverted", *common, "--set", "vae.use=invert", env=env, check_code=0)

    def frames(path):
        with av.open(str(path)) as container:
            return np.stack([frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]).astype(float)

    plain, inverted = frames(tmp_path / "plain/a.mp4"), frames(tmp_path / "inverted/a.mp4")
    # H.264 rounds both: the inverted clip is near 255 minus the plain one, and far from it
    assert np.abs(inverted - (255 - plain)).mean() < 8 < np.abs(inverted - plain).mean()


def test_a_wrapper_left_without_the_stage_it_wraps_is_blamed_on_the_set_that_did_it(tmp_path, prompts_file):
    env = install(tmp_path / "site", "invert", INVERT)
    result = h3gen("presets", "show", "tiny", "--set", "vae.use=invert", "--set", "vae.wraps.use=invert", env=env,
                   check_code=2)
    assert result.stderr.splitlines()[-1] == (
        "h3gen: error: --set vae.wraps.use=invert: vae stage 'invert' wraps another vae stage, and none is named (name "
        "it: [vae.wraps.wraps] use = \"...\" in a preset, --set vae.wraps.wraps.use=... on the command line)")
