"""Stages declare what they can do as class attributes; the run loop reads the declarations and never probes, so a
plugin stage that declares nothing runs with the in-line defaults."""

import pytest

from conftest import ROOT

PROMPTS = '{"id": "a", "prompt": "a fox"}\n{"id": "b", "prompt": "waves"}\n'


def render_with(tmp_path, tiny_model, vae=None, mux=None, sampler=None):
    from h3gen.config.preset import resolve
    from h3gen.inputs.prompts import read_prompts
    from h3gen.models.repo import ModelRepo
    from h3gen.plugins.manager import Registered, registry
    from h3gen.run.render import Renderer
    from h3gen.run.report import SilentReporter

    found, text = registry(), (ROOT / "presets" / "tiny.toml").read_text()
    for stage in filter(None, (vae, mux, sampler)):
        found.stages[(stage.kind, stage.name)] = Registered(stage.kind, stage.name, stage, "test")
        text = text.replace({"vae": 'use = "reference"', "mux": 'use = "pyav"', "sampler": 'use = "euler"'}[stage.kind],
                            f'use = "{stage.name}"')
    preset_file = tmp_path / "preset.toml"
    preset_file.write_text(text)
    preset = resolve(str(preset_file), found)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(PROMPTS)
    renderer = Renderer(preset, found, ModelRepo(tiny_model), SilentReporter())
    try:
        results = list(renderer.render(read_prompts(prompts, 0, preset.request), tmp_path / "out"))
    finally:
        renderer.close()
    assert [r.ok for r in results] == [True, True], [r.error for r in results]
    return results


def test_the_builtin_stages_declare_their_capabilities():
    from h3gen.stages.diffusers_baseline import DiffusersSampler
    from h3gen.stages.mux import PyAVMux
    from h3gen.stages.sampler import EulerConfig, EulerSampler
    from h3gen.stages.vae import FastVAE, ReferenceVAE

    assert FastVAE.hands_over_frames and not ReferenceVAE.hands_over_frames
    assert PyAVMux.background
    assert EulerSampler.refuses_split(EulerConfig(dit="h3gen")) == ""
    assert "sampler.dit" in EulerSampler.refuses_split(EulerConfig(dit="diffusers"))
    assert DiffusersSampler.refuses_split(None) == "the sampler stage 'diffusers' renders a clip on one rank"


def test_a_mux_that_declares_no_background_runs_in_line(tmp_path, tiny_model):
    from h3gen.stages.mux import PyAVMux
    from h3gen.stages.vae import FastVAE

    class InlineMux(PyAVMux):
        name, background = "inline", False

        def submit(self, clip):
            raise AssertionError("a mux that declares no background is never submitted")

        def run(self, clip):
            assert clip.arriving is None and clip.frames is not None  # finished frames, never the arriving ones
            return super().run(clip)

    render_with(tmp_path, tiny_model, vae=FastVAE, mux=InlineMux)
    assert sorted(p.name for p in (tmp_path / "out").glob("*.mp4")) == ["a.mp4", "b.mp4"]


def test_a_decode_that_declares_no_handover_gives_the_mux_finished_frames(tmp_path, tiny_model):
    from h3gen.stages.mux import PyAVMux
    from h3gen.stages.vae import FastVAE

    class FinishedFrames(FastVAE):
        name, hands_over_frames = "finished-frames", False

    seen = []

    class RecordingMux(PyAVMux):
        name = "recording"

        def run(self, clip):
            seen.append(clip.arriving)
            return super().run(clip)

    render_with(tmp_path, tiny_model, vae=FinishedFrames, mux=RecordingMux)
    assert seen == [None, None]


def test_the_sampler_draws_the_next_clip_s_noise_while_this_one_renders(tmp_path, tiny_model):
    """The renderer hands the sampler the next clip before this one goes to the device; the sampler draws its seeded
    noise on a host thread, the very draws `run` would make in line."""
    import torch

    from h3gen.stages.sampler import EulerSampler

    ahead = []

    class Recording(EulerSampler):
        name = "recording"

        def run(self, clip):
            ahead.append(clip.noise is not None)
            if clip.noise is not None:
                conditions, video, audio = clip.noise.result()
                again = self.draw(clip)
                assert conditions == again[0] == [] and torch.equal(video, again[1]) and torch.equal(audio, again[2])
            return super().run(clip)

    render_with(tmp_path, tiny_model, sampler=Recording)
    assert ahead == [False, True]


def test_a_plugin_stage_that_declares_nothing_works_in_line(tmp_path, tiny_model):
    from h3gen.run.fingerprint import stamp
    from h3gen.stages.base import Stage
    from h3gen.stages.mux import write_mp4

    class PlainMux(Stage):
        kind, name = "mux", "plain"

        def run(self, clip):  # as docs/plugins.md says a new mux writes: with the stamp a rerun reads
            write_mp4(clip.path, clip.frames, clip.audio, sample_rate=clip.sample_rate, comment=stamp(clip.fingerprint))
            return clip

    assert not PlainMux.background and not PlainMux.hands_over_frames and PlainMux.refuses_split(None)
    render_with(tmp_path, tiny_model, mux=PlainMux)
    assert sorted(p.name for p in (tmp_path / "out").glob("*.mp4")) == ["a.mp4", "b.mp4"]


@pytest.mark.parametrize("module", ["cli", "run", "stages", "models", "inputs", "config", "parallel", "bench",
                                    "plugins", "kernels"])
def test_every_h3gen_import_names_its_file_and_only_cli_imports_cli(module):
    import re

    for path in (ROOT / module).rglob("*.py"):
        for name in re.findall(r"^\s*(?:from|import) (h3gen[\w.]*)", path.read_text(), re.M):
            parts = name.split(".")[1:]
            target = ROOT.joinpath(*parts)
            assert target.with_suffix(".py").is_file() or (target / "__init__.py").is_file(), (path, name)
            assert module == "cli" or parts[:1] != ["cli"], f"{path} imports {name}"
