"""Keyframes and references in the prompts file: paths, the task they make, the canvas a keyframe sets, and a clear
error, before any weight loads, for media H3 cannot use."""

import importlib.util
import json
import wave
from types import SimpleNamespace

import pytest

from conftest import h3gen
from h3gen.stages.clip import Clip
from h3gen.errors import ClipError, UsageError
from h3gen.inputs.prompts import read_prompts
from test_tasks import write_image, write_video, write_wav

DEFAULTS = {"width": 32, "height": 32, "duration": 5.0}


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    folder = tmp_path_factory.mktemp("inputs")
    write_image(folder / "frame.png", 48, 32, 1)
    write_image(folder / "wide.png", 128, 32, 2)
    write_image(folder / "too-wide.png", 200, 32, 3)
    (folder / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    (folder / "notes.txt").write_text("not media\n")
    (folder / "notes.png").write_text("not media either, named as an image\n")
    with wave.open(str(folder / "header.wav"), "wb") as header:  # a WAV header and not one sample
        header.setnchannels(2), header.setsampwidth(2), header.setframerate(32000)
    write_video(folder / "clip.mp4", 20, sound=False)
    (folder / "cut.mp4").write_bytes((folder / "clip.mp4").read_bytes()[:200])  # its ftyp box, then nothing whole
    write_video(folder / "blink.mp4", 6, sound=False)
    write_raw_h264(folder / "blink.h264", 6)
    write_image(folder / "photo.jpg", 64, 64, 4)
    photo = (folder / "photo.jpg").read_bytes()
    (folder / "cut.jpg").write_bytes(photo[:len(photo) * 9 // 10])
    write_wav(folder / "voice.wav")
    write_wav(folder / "cd.wav", rate=44100)
    write_wav(folder / "surround.wav", channels=6)
    (folder / "sub").mkdir()
    return folder


def parse(folder, *lines, defaults=DEFAULTS):
    path = folder / "sub" / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": "a fox", **line}) + "\n" for line in lines))
    return read_prompts(path, 0, defaults)


def test_the_task_follows_from_the_fields_and_paths_are_relative_to_the_prompts_file(media):
    t2va, first, both, refs = parse(media, {}, {"first_frame": "../frame.png"},
                                    {"first_frame": "../frame.png", "last_frame": str(media / "wide.png")},
                                    {"references": ["../voice.wav", "../clip.mp4", "../frame.png"]})
    assert [r.task for r in (t2va, first, both, refs)] == ["t2va", "fl2va", "fl2va", "ref2va"]
    assert first.first_frame == media / "frame.png" and first.last_frame is None
    assert both.last_frame == media / "wide.png"
    assert [(r.kind, r.path.name) for r in refs.references] == [("audio", "voice.wav"), ("video", "clip.mp4"),
                                                                 ("image", "frame.png")]
    assert (refs.width, refs.height) == (32, 32)  # references never set the canvas


@pytest.mark.parametrize("line, size", [
    ({"first_frame": "../wide.png"}, (64, 32)),  # 4:1 on the tiny 32 px canvas
    ({"last_frame": "../wide.png"}, (64, 32)),  # the last frame sets it when it is the only keyframe
    ({"first_frame": "../frame.png", "last_frame": "../wide.png"}, (32, 32)),  # the first frame wins
    ({"first_frame": "../wide.png", "width": 96, "height": 32}, (96, 32)),  # a size given is kept
])
def test_the_keyframe_sets_the_aspect_ratio_when_no_size_is_given(media, line, size):
    (request,) = parse(media, line)
    assert (request.width, request.height) == size


@pytest.mark.parametrize("image", [(1920, 1080), (1080, 1920), (1000, 1000), (3000, 1000), (720, 2560)])
def test_keyframe_canvas_on_h3_base_is_diffusers_canvas_rule(image):
    from diffusers.modular_pipelines.minimax_h3.before_encoder import MiniMaxH3ResizeStep
    from diffusers.modular_pipelines.minimax_h3.modular_pipeline import resolve_canvas_size

    from h3gen.inputs.media import keyframe_canvas

    rule = {spec.name: spec.default for spec in MiniMaxH3ResizeStep().expected_configs}
    height, width = resolve_canvas_size(*image, 32, rule["canvas_short_edge"], rule["canvas_max_pixels"])
    assert keyframe_canvas(image, 1344, 768) == (width, height)


def test_the_documented_keyframe_canvas_example_holds():
    """README and man page: a 2:1 keyframe on 1344x768 gets the short edge scaled down to fit the area, 1440x704."""
    from h3gen.inputs.media import keyframe_canvas

    assert keyframe_canvas((640, 320), 1344, 768) == (1440, 704)
    assert keyframe_canvas((64, 32), 32, 32) == (32, 32)


@pytest.mark.parametrize("line, message", [
    ({"first_frame": "../missing.png"}, r"first_frame .*missing.png does not exist"),
    ({"last_frame": ".."}, "is a directory"),
    ({"first_frame": ""}, "first_frame is not a file path"),
    ({"first_frame": "../broken.png"}, "broken.png is not an image h3gen can read"),
    ({"first_frame": "../too-wide.png"}, "is 200x32, outside the 1:4 to 4:1 aspect ratios H3 generates"),
    ({"first_frame": "../frame.png", "width": 64}, "give both width and height, or neither"),
    ({"first_frame": "../frame.png", "references": ["../frame.png"]}, "keyframes .* or on references .*not both"),
    ({"first_frame": 3}, "field 'first_frame' has the wrong type"),
    ({"references": "../frame.png"}, "field 'references' has the wrong type"),
    ({"references": []}, "'references' is empty"),
    ({"references": [7]}, r"references\[0\] must be a path string"),
    ({"references": ["../notes.txt"]}, "notes.txt is not an image, video or audio file"),
    ({"references": ["../notes.png"]}, "notes.png is not an image, video or audio file h3gen can read"),
    ({"references": ["../cut.mp4"]}, r"cut.mp4 is an MP4/MOV file that does not decode \(the file is cut short or "
                                     r"damaged: export it again\)"),
    ({"references": ["../frame.png", "../header.wav"]}, "header.wav has an audio stream with no samples in it"),
    ({"references": ["../too-wide.png"]}, r"references\[0\] .* outside the 1:4 to 4:1"),
    ({"references": ["../voice.wav"]}, "audio references cannot be used on their own"),
    ({"references": ["../clip.mp4"] * 4}, "4 video references, H3 takes at most 3"),
    ({"references": ["../frame.png"] * 13}, "13 image references, H3 takes at most 9"),
    ({"references": ["../frame.png", "../blink.mp4"]},
     r"blink.mp4 lasts 0.2\d s; .* needs 13 frames at 24 fps \(at least 0.52 s\)"),
    ({"references": ["../frame.png", "../blink.h264"]},
     r"blink.h264 lasts 0.25 s; .* needs 13 frames at 24 fps \(at least 0.52 s\)"),
    ({"references": ["../cut.jpg"]}, r"cut.jpg is a JPEG image that does not decode \(.*\)"),
    ({"first_frame": "../cut.jpg"}, r"cut.jpg is a JPEG image that does not decode"),
    ({"references": ["../frame.png", "../surround.wav"]}, "has 6 audio channels; H3 conditions on mono or stereo"),
])
def test_media_h3_cannot_use_is_refused_with_the_line(media, line, message):
    with pytest.raises(UsageError, match=message) as caught:
        parse(media, {}, line)
    assert "prompts.jsonl:2:" in str(caught.value)


def write_raw_h264(path, frames):
    """A bare H.264 stream: no container, so no length in any header."""
    import av
    import numpy as np

    rng = np.random.default_rng(frames)
    with av.open(str(path), "w", format="h264") as container:
        video = container.add_stream("libx264", rate=24)
        video.width, video.height, video.pix_fmt = 48, 32, "yuv420p"
        for _ in range(frames):
            pixels = rng.integers(0, 256, (32, 48, 3), np.uint8)
            container.mux(video.encode(av.VideoFrame.from_ndarray(pixels, "rgb24")))
        container.mux(video.encode())


@pytest.mark.parametrize("limit", [1_000, 3_000])
def test_an_image_past_the_pixel_limit_is_refused_as_too_large(media, monkeypatch, limit):
    """Past Pillow's limit (64x64 against 3,000 here) and past twice it, where Pillow refuses to open it: too large,
    not unreadable, and not taken for a one-frame video."""
    from PIL import Image

    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", limit)
    for line in ({"first_frame": "../photo.jpg"}, {"references": ["../photo.jpg"]}):
        said = r"is 64x64 \(0 MP\)" if limit == 3_000 else "has more than 0 MP"  # 2,000 pixels: 0 MP
        with pytest.raises(UsageError, match=rf"photo.jpg {said}, more than the 0 MP h3gen reads") as caught:
            parse(media, line)
        assert caught.value.fix == "scale it down, e.g. to 2048 px on its long side"


@pytest.mark.skipif(importlib.util.find_spec("torchaudio") is not None, reason="torchaudio resamples it")
def test_audio_off_the_vae_rate_needs_torchaudio(media):
    with pytest.raises(UsageError, match=r"cd.wav has audio at 44100 Hz; .* needs torchaudio .*ffmpeg -ar 32000"):
        parse(media, {"references": ["../frame.png", "../cd.wav"]})


def test_a_bad_keyframe_stops_the_run_before_loading(media, tmp_path):
    prompts = media / "sub" / "cli.jsonl"
    prompts.write_text('{"prompt": "ok"}\n{"prompt": "x", "first_frame": "nope.png"}\n')
    result = h3gen("render", prompts, "-o", tmp_path / "out", check_code=2)
    assert "cli.jsonl:2: first_frame" in result.stderr and "does not exist" in result.stderr
    assert "loaded on" not in result.stderr and not (tmp_path / "out").exists()


@pytest.mark.parametrize("preset, task, line", [
    ("fasth3", "fl2va", {"first_frame": "../frame.png"}),
    ("turbo-8", "ref2va", {"references": ["../frame.png"]}),
])
def test_a_task_the_adapter_was_not_distilled_for_is_refused(media, tmp_path, preset, task, line):
    import torch
    from safetensors.torch import save_file

    from h3gen.config.contract import check_adapters
    from h3gen.plugins.manager import registry
    from h3gen.config.preset import resolve

    adapter = tmp_path / "adapters" / f"{preset}.safetensors"
    adapter.parent.mkdir()
    save_file({"proj_out.diff_b": torch.zeros(96)}, str(adapter))
    resolved = resolve(preset, registry())
    requests = parse(media, {}, line, line, defaults=resolved.request)
    # The prompts file's line asks for the task, not the sampler: the error names the line, and the lines after it.
    with pytest.raises(UsageError, match=rf"^prompts.jsonl:2: a {task} clip \(.*\) \(and 1 more line\(s\)\), and "
                                         rf"preset {preset}'s adapter .* renders [a-z0-9 ]+ only \(render those lines with "
                                         "a preset without adapters"):
        check_adapters(resolved, requests, tmp_path, "prompts.jsonl")


def test_a_model_without_the_ref2va_partition_is_refused_before_loading(media, tiny_model, tmp_path):
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_model, model, ignore=shutil.ignore_patterns("transformer_ref"))
    prompts = media / "sub" / "refs.jsonl"
    prompts.write_text('{"prompt": "ok"}\n{"prompt": "x", "references": ["../frame.png"]}\n')
    for dry in ([], ["--dry-run"]):
        result = h3gen("render", prompts, "--model", model, "--preset", "tiny", "-o", tmp_path / "out", *dry,
                       check_code=2)
        assert result.stderr == (f"h3gen: error: {prompts}:2: a ref2va clip (references) runs the transformer_ref/ "
                                 f"partition, which {model} does not have (download transformer_ref/ of "
                                 "MiniMaxAI/MiniMax-H3 into the model directory, or drop the ref2va lines)\n")
        assert not (tmp_path / "out").exists()


def test_ref2va_refuses_adapters_and_a_repository_without_its_partition(tmp_path):
    from h3gen.stages.sampler import EulerConfig, EulerSampler

    sampler = EulerSampler(EulerConfig(), SimpleNamespace(quant=SimpleNamespace(adapter_deltas=object())))
    sampler.repo = SimpleNamespace(root=tmp_path)
    with pytest.raises(ClipError, match="adapters were trained on transformer/, and ref2va runs transformer_ref/"):
        sampler.check_ref_partition()
    sampler.runtime.quant.adapter_deltas = None
    with pytest.raises(ClipError, match="transformer_ref/ partition, which .* does not have"):
        sampler.check_ref_partition()


def test_the_diffusers_baseline_refuses_conditioned_clips(media):
    from h3gen.stages.diffusers_baseline import DiffusersEncode

    (request,) = parse(media, {"first_frame": "../frame.png"})
    with pytest.raises(ClipError, match="render t2va only, and this clip is fl2va"):
        DiffusersEncode(None, None).run(Clip(request=request, path=media / "x.mp4"))


def test_media_paths_start_from_the_file_a_link_leads_to_and_from_here_for_a_pipe(media, tmp_path, monkeypatch):
    import subprocess

    line = json.dumps({"prompt": "a fox", "first_frame": "frame.png"}) + "\n"
    (media / "keyed.jsonl").write_text(line)
    (tmp_path / "linked.jsonl").symlink_to(media / "keyed.jsonl")
    [request] = read_prompts(tmp_path / "linked.jsonl", 0, DEFAULTS)
    assert request.first_frame == media / "frame.png"
    monkeypatch.chdir(media)
    result = subprocess.run(f"cat keyed.jsonl | {h3gen_command()} render /dev/stdin -o {tmp_path / 'out'} --dry-run",
                            shell=True, capture_output=True, text=True)
    assert result.returncode == 0 and "render" in result.stdout, result.stderr
    with pytest.raises(UsageError, match=r"first_frame /dev/zero is not a regular file \(give the path of a media"):
        parse(media, {"first_frame": "/dev/zero"})


def h3gen_command() -> str:
    import shlex
    import sys

    return f"{shlex.quote(sys.executable)} -m h3gen.cli.main"


def test_a_conditioned_clip_keeps_its_name_when_the_project_moves(media, tmp_path):
    """Named by its media's content, as the fingerprint takes them, not by where they lie; other media, another
    name."""
    import shutil

    from h3gen.run.resume import clip_name

    def name(folder, frame="frame.png"):
        (folder / "p.jsonl").write_text(json.dumps({"prompt": "a door", "first_frame": frame}) + "\n")
        [request] = read_prompts(folder / "p.jsonl", 0, DEFAULTS)
        return clip_name(request, "tiny")

    here, there = tmp_path / "here", tmp_path / "there"
    here.mkdir()
    shutil.copy(media / "frame.png", here / "frame.png")
    before = name(here)
    shutil.move(here, there)
    assert name(there) == before and before.startswith("h3-")
    shutil.copy(media / "wide.png", there / "wide.png")
    assert name(there, "wide.png") != before


def test_a_keyframe_rounded_past_4_to_1_blames_the_keyframe_on_that_canvas(tmp_path):
    from test_tasks import write_image

    write_image(tmp_path / "band.png", 400, 100, 5)
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "a band", "first_frame": "band.png"}) + "\n")
    with pytest.raises(UsageError, match=r"the keyframe's 400x100 on the 768x448 canvas gives 1184x288, outside "
                                         r"H3's 1:4 to 4:1 once rounded to multiples of 32 \(give the line a width"):
        read_prompts(tmp_path / "p.jsonl", 0, {"width": 768, "height": 448, "duration": 5.0})
    [request] = read_prompts(tmp_path / "p.jsonl", 0, {"width": 1344, "height": 768, "duration": 5.0})
    assert request.width / request.height <= 4


def test_lines_of_two_tasks_an_adapter_refuses_name_both_fields_to_drop(media, tmp_path):
    import torch
    from safetensors.torch import save_file

    from h3gen.config.contract import check_adapters
    from h3gen.config.preset import resolve
    from h3gen.plugins.manager import registry

    adapter = tmp_path / "adapters" / "fasth3.safetensors"
    adapter.parent.mkdir()
    save_file({"proj_out.diff_b": torch.zeros(96)}, str(adapter))
    resolved = resolve("fasth3", registry())
    requests = parse(media, {"first_frame": "../frame.png"}, {"references": ["../frame.png"]},
                     defaults=resolved.request)
    with pytest.raises(UsageError, match=r"or drop their first_frame / last_frame or references\)$"):
        check_adapters(resolved, requests, tmp_path, "prompts.jsonl")


def test_media_changed_or_taken_away_after_the_prompts_were_checked_fails_its_clip(media, tmp_path):
    """The clip's name and stamp are the files' as the run found them: a keyframe or reference replaced or removed
    before its clip's encode read it fails that clip, which a rerun renders from the file as it is then."""
    import shutil

    from h3gen.models.conditions import decode_keyframe
    from h3gen.run.fingerprint import clip_fields
    from h3gen.run.render import check_media_read

    for name in ("frame.png", "photo.jpg"):
        shutil.copy(media / name, tmp_path / name)
    (tmp_path / "sub").mkdir()
    keyed, referenced = parse(tmp_path, {"first_frame": "../frame.png"}, {"references": ["../photo.jpg"]})
    clips = [Clip(request=r, path=tmp_path / "x.mp4", fingerprint=clip_fields({}, r)) for r in (keyed, referenced)]
    for clip in clips:
        check_media_read(clip)  # as they were
    write_image(tmp_path / "frame.png", 48, 32, 9)
    with pytest.raises(ClipError, match="its first_frame changed while the clip rendered, so the clip would carry "
                                        "the name and stamp of the file as it was"):
        check_media_read(clips[0])
    (tmp_path / "photo.jpg").unlink()
    with pytest.raises(ClipError, match=r"photo\.jpg was taken away while its clip rendered"):
        check_media_read(clips[1])
    with pytest.raises(ClipError, match=r"keyframe \S+photo\.jpg was taken away while the run went on"):
        decode_keyframe(tmp_path / "photo.jpg")
    check_media_read(Clip(request=parse(tmp_path, {})[0], path=tmp_path / "x.mp4"))  # a t2va clip has none
