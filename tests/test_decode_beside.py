"""`runtime.overlap_decode`: each clip's decode on a thread of its own, beside the next clip's DiT forwards."""

import threading

import pytest

from conftest import h3gen
from h3gen.errors import ModelError
from h3gen.run.loop import Interrupted
from h3gen.run.validate import validate_clip

THREE = '{"id": "a", "prompt": "a fox"}\n{"id": "b", "prompt": "waves"}\n{"id": "c", "prompt": "rain on a roof"}\n'


@pytest.mark.parametrize("vae", ["reference", "fast"])
def test_a_decode_beside_the_next_clips_forwards_writes_the_same_bytes(prompts_file, tmp_path, vae):
    """The same MP4s as decoding in line, and the same fingerprint: a run with the other setting skips them."""
    prompts = prompts_file(THREE)
    in_line = h3gen("render", prompts, "-o", tmp_path / "in-line", "--set", f"vae.use={vae}", check_code=0)
    beside = h3gen("render", prompts, "-o", tmp_path / "beside", "--set", f"vae.use={vae}",
                   "--set", "runtime.overlap_decode=true", check_code=0)
    assert "decodes beside" not in in_line.stderr
    assert "each clip decodes beside the next clip's forwards" in beside.stderr
    for name in "abc":
        assert (tmp_path / f"in-line/{name}.mp4").read_bytes() == (tmp_path / f"beside/{name}.mp4").read_bytes()
    again = h3gen("render", prompts, "-o", tmp_path / "beside", "--set", f"vae.use={vae}", check_code=0)
    assert "0 of 3 clips written, 3 already there and valid (skipped)" in again.stderr


def renderer_of(tiny_model, tmp_path, vae_class=None, overlap=True, prompts=THREE):
    """A renderer of the tiny preset (its vae `vae_class`, registered under its name) and the requests of
    `prompts`."""
    from h3gen.cli.ui import PlainReporter
    from h3gen.config.preset import resolve
    from h3gen.inputs.prompts import read_prompts
    from h3gen.models.repo import ModelRepo
    from h3gen.plugins.manager import Registered, registry
    from h3gen.run.render import Renderer

    found, sets = registry(), [f"runtime.overlap_decode={str(overlap).lower()}"]
    if vae_class is not None:
        found.stages[("vae", vae_class.name)] = Registered("vae", vae_class.name, vae_class, "test")
        sets.append(f"vae.use={vae_class.name}")
    preset = resolve("tiny", found, sets)
    file = tmp_path / "prompts.txt"
    file.write_text(prompts)
    requests = read_prompts(file, 0, preset.request)
    return Renderer(preset, found, ModelRepo(tiny_model), PlainReporter(len(requests))), requests


def test_a_failed_decode_beside_costs_its_clip_alone(tiny_model, tmp_path):
    from h3gen.stages.vae import ReferenceVAE

    decoded_on = []

    class FailsOnB(ReferenceVAE):
        name = "fails-on-b"

        def run(self, clip):
            decoded_on.append(threading.current_thread().name)
            if clip.request.id == "b":
                raise RuntimeError("the decoder broke")
            return super().run(clip)

    renderer, requests = renderer_of(tiny_model, tmp_path, FailsOnB)
    results = sorted(renderer.render(requests, tmp_path / "out"), key=lambda r: r.request.index)
    renderer.close()
    assert [(r.request.id, r.ok) for r in results] == [("a", True), ("b", False), ("c", True)]
    assert "the decoder broke" in results[1].error
    assert all(name.startswith("h3gen-decode") for name in decoded_on)
    for name in "ac":
        assert validate_clip(tmp_path / f"out/{name}.mp4", expected_frames=124) == []
    assert not (tmp_path / "out/b.mp4").exists() and not list((tmp_path / "out").glob("*.lock"))


def test_a_model_error_in_a_decode_beside_ends_the_run_and_lets_go_of_its_clip(tiny_model, tmp_path):
    from h3gen.stages.vae import ReferenceVAE

    class ModelBroken(ReferenceVAE):
        name = "model-broken"

        def run(self, clip):
            raise ModelError("the decoder's weights are corrupt", "download the model again")

    renderer, requests = renderer_of(tiny_model, tmp_path, ModelBroken)
    with pytest.raises(ModelError, match="corrupt"):
        list(renderer.render(requests, tmp_path / "out"))
    renderer.close()
    assert not list((tmp_path / "out").glob("*.mp4")) and not list((tmp_path / "out").glob("*.lock"))


def test_a_signal_while_a_clip_decodes_beside_leaves_only_whole_files_and_no_claims(tiny_model, tmp_path):
    """The signal lands in the next clip's forwards while clip a decodes: close() waits for the decode (none stops
    halfway), then discards a's mux, so a is written whole or not at all, and every claim is let go."""
    from h3gen.stages.vae import ReferenceVAE

    decoding, go_on = threading.Event(), threading.Event()

    class Slow(ReferenceVAE):
        name = "slow"

        def run(self, clip):
            decoding.set()
            go_on.wait(30)
            return super().run(clip)

    renderer, requests = renderer_of(tiny_model, tmp_path, Slow)
    sampler = renderer.stages["sampler"]
    sample = sampler.run

    def stopped_in_the_next_clip(clip):
        if clip.request.id == "b":
            assert decoding.wait(30)
            go_on.set()
            raise Interrupted(2)
        return sample(clip)

    sampler.run = stopped_in_the_next_clip
    with pytest.raises(Interrupted):
        list(renderer.render(requests, tmp_path / "out"))
    renderer.close(discard=True)
    written = {r.path.name for r in renderer.results if r.ok}
    assert renderer.discarded + len(written) == 2  # a (decoded beside) and b (on the sampler)
    for path in (tmp_path / "out").glob("*.mp4"):
        assert path.name in written and validate_clip(path, expected_frames=124) == []
    assert not list((tmp_path / "out").glob("*.lock")) and not list((tmp_path / "out").glob(".*partial*"))


def test_a_memory_plan_that_streams_a_compiled_stage_or_a_group_decodes_after_the_forwards():
    from h3gen.config.preset import resolve
    from h3gen.parallel.group_render import GroupRenderer
    from h3gen.plugins.manager import registry
    from h3gen.run.budget import MemoryPlan
    from h3gen.run.decode_beside import why_not

    preset = resolve("fasth3-fp8", registry(), ["runtime.overlap_decode=true"])
    resident = MemoryPlan(80 * 2**30, 48, 0, 60 * 2**30, 0)
    assert why_not(preset, None) == "" and why_not(preset, resident) == ""
    assert "streams weights" in why_not(preset, MemoryPlan(24 * 2**30, 48, 30, 22 * 2**30, 20 * 2**30))
    assert "streams weights" in why_not(preset, MemoryPlan(24 * 2**30, 48, 0, 22 * 2**30, 0, stream_encoder=True))
    tiny = resolve("tiny", registry(), ["sampler.compile=true"])  # diffusers' DiT there: nothing compiles
    assert why_not(tiny, None) == ""
    compiled = resolve("fasth3-fp8", registry(), ["sampler.compile=true", "vae.compile=true"])
    assert why_not(compiled, resident) == ("torch.compile (sampler.compile, vae.compile) compiles on one thread "
                                                "at a time")
    assert "decode each clip together" in GroupRenderer.decodes_together(None)


@pytest.mark.cuda
def test_on_a_gpu_a_decode_beside_writes_the_same_bytes(prompts_file, tmp_path):
    prompts = prompts_file(THREE)
    for overlap in ("false", "true"):
        h3gen("render", prompts, "-o", tmp_path / overlap, "--set", "runtime.device=cuda", "--set", "vae.use=fast",
              "--set", f"runtime.overlap_decode={overlap}", check_code=0)
    for name in "abc":
        assert (tmp_path / f"false/{name}.mp4").read_bytes() == (tmp_path / f"true/{name}.mp4").read_bytes()
