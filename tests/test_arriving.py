"""The mux started with the decode: it encodes frames as the decode lands them and writes the MP4 a finished decode
would give; a decode that fails takes the file with it."""

import threading
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from conftest import ROOT
from h3gen.run.arriving import ArrivingMedia, DecodeFailed
from h3gen.stages.mux import write_mp4

TWO_CLIPS = '{"id": "a", "prompt": "a fox"}\n{"id": "b", "prompt": "waves"}\n'


def clip_media(frames=22, seed=0):
    generator = np.random.default_rng(seed)
    video = generator.integers(0, 256, (frames, 32, 48, 3), dtype=np.uint8)
    audio = (generator.random((2, 32000 * frames // 24), dtype=np.float32) - 0.5)
    return video, audio


def decode_in_background(media, video, audio, chunk, mux_reading, fail_after=None):
    """Land `video` chunk by chunk into the host buffer the media was opened with; after the first chunk, wait until
    the mux is reading, so the rest lands while it encodes. Returns the thread and whether the mux read that early."""
    buffer, read_early = np.zeros_like(video), []

    def decode():
        media.open(buffer, 32000)
        for start in range(0, len(video), chunk):
            if fail_after is not None and start >= fail_after:
                media.fail(RuntimeError("decoder fault"))
                return
            buffer[start:start + chunk] = video[start:start + chunk]
            media.landed(min(start + chunk, len(video)))
            if start == 0:
                read_early.append(mux_reading.wait(30))
        media.finish(audio)

    thread = threading.Thread(target=decode)
    thread.start()
    return thread, read_early


def test_arriving_frames_give_the_bytes_of_finished_ones(tmp_path):
    video, audio = clip_media()
    write_mp4(tmp_path / "whole.mp4", video, audio)
    media, reading = ArrivingMedia(), threading.Event()
    decoder, read_early = decode_in_background(media, video, audio, chunk=5, mux_reading=reading)
    write_mp4(tmp_path / "arriving.mp4", media, media.audio, cancelled=lambda: reading.set() or False)
    decoder.join()
    assert read_early == [True]  # the mux had its first frame before the rest of the clip landed
    assert (tmp_path / "arriving.mp4").read_bytes() == (tmp_path / "whole.mp4").read_bytes()


def test_a_soundtrack_handed_over_ahead_is_encoded_before_the_frames_land(tmp_path, monkeypatch):
    """The decode hands over the audio first: the mux encodes it before the first frame lands (the decode waits for
    that), and the file is still the bytes of a finished decode."""
    from h3gen.stages import mux

    video, audio = clip_media()
    write_mp4(tmp_path / "whole.mp4", video, audio)
    encoded, encode = threading.Event(), mux._encode_audio
    monkeypatch.setattr(mux, "_encode_audio", lambda *args: [encode(*args), encoded.set()][0])
    media, waited, buffer = ArrivingMedia(), [], np.zeros_like(video)

    def decode():
        media.sound(audio)
        media.open(buffer, 32000)
        waited.append(encoded.wait(10))
        buffer[:] = video
        media.landed(len(video))
        media.finish()

    decoder = threading.Thread(target=decode)
    decoder.start()
    write_mp4(tmp_path / "ahead.mp4", media, media.audio, audio_ahead=media.audio_ahead)
    decoder.join()
    assert waited == [True] and media.finished
    assert (tmp_path / "ahead.mp4").read_bytes() == (tmp_path / "whole.mp4").read_bytes()


def test_a_soundtrack_ahead_of_frames_that_end_short_still_stops_the_mux(tmp_path):
    video, audio = clip_media()
    media = ArrivingMedia()
    media.sound(audio)
    media.open(video, 32000)
    assert not media.finished  # the audio alone is not the end of the decode
    media.landed(10)
    media.finish()
    with pytest.raises(DecodeFailed, match="after 10 of 22 frames"):
        write_mp4(tmp_path / "clip.mp4", media, media.audio, audio_ahead=media.audio_ahead)
    assert list(tmp_path.iterdir()) == []


def test_a_failed_decode_leaves_no_file(tmp_path):
    video, audio = clip_media()
    media, reading = ArrivingMedia(), threading.Event()
    decoder, _ = decode_in_background(media, video, audio, chunk=5, mux_reading=reading, fail_after=10)
    with pytest.raises(DecodeFailed, match="decoder fault"):
        write_mp4(tmp_path / "clip.mp4", media, media.audio, cancelled=lambda: reading.set() or False)
    decoder.join()
    assert list(tmp_path.iterdir()) == []


def test_a_decode_that_ends_short_stops_the_mux(tmp_path):
    video, audio = clip_media()
    media = ArrivingMedia()
    media.open(video, 32000)
    media.landed(10)
    media.finish(audio)
    with pytest.raises(DecodeFailed, match="after 10 of 22 frames"):
        write_mp4(tmp_path / "clip.mp4", media, media.audio)
    assert list(tmp_path.iterdir()) == []


def test_a_decode_failing_mid_clip_costs_that_clip_and_no_file(tiny_model, tmp_path):
    """The fast VAE hands its first chunk to the mux, then fails: the clip fails, its MP4 never appears, the next
    clip is written."""
    from h3gen.cli.ui import PlainReporter
    from h3gen.plugins.manager import Registered, registry
    from h3gen.config.preset import resolve
    from h3gen.inputs.prompts import read_prompts
    from h3gen.run.render import Renderer
    from h3gen.models.repo import ModelRepo
    from h3gen.stages.vae import FastVAE

    class FailingVAE(FastVAE):
        name = "failing-fast"

        def decode(self, latents, emit):
            if self.failing:
                def emit_once(video):
                    emit(video)
                    raise RuntimeError("decoder fault")
                return super().decode(latents, emit_once)
            return super().decode(latents, emit)

        def run(self, clip):
            self.failing = clip.request.id == "a"
            assert clip.arriving is not None  # the mux has started
            return super().run(clip)

    found = registry()
    found.stages[("vae", "failing-fast")] = Registered("vae", "failing-fast", FailingVAE, "test")
    preset_file = tmp_path / "failing.toml"
    preset_file.write_text((ROOT / "presets" / "tiny.toml").read_text().replace('use = "reference"',
                                                                                'use = "failing-fast"'))
    preset = resolve(str(preset_file), found)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(TWO_CLIPS)
    renderer = Renderer(preset, found, ModelRepo(tiny_model), PlainReporter(2))
    out = tmp_path / "out"
    try:
        results = list(renderer.render(read_prompts(prompts, 0, preset.request), out))
    finally:
        renderer.close()
    assert [r.ok for r in results] == [False, True]
    assert "decoder fault" in results[0].error
    assert sorted(p.name for p in out.glob("*.mp4")) == ["b.mp4"]
    assert not [p for p in out.iterdir() if p.name.startswith(".") and p.suffix == ".mp4"]


def test_the_fast_decode_hands_over_the_soundtrack_before_its_frames(tiny_model, tmp_path, monkeypatch):
    """The fast VAE decodes the audio first and hands it to the mux before the first frames, then finishes with
    the frames all landed; the clip is the one a render with the mux in line writes."""
    from h3gen.cli.ui import PlainReporter
    from h3gen.config.preset import resolve
    from h3gen.inputs.prompts import read_prompts
    from h3gen.models.repo import ModelRepo
    from h3gen.plugins.manager import registry
    from h3gen.run import render
    from h3gen.run.render import Renderer

    calls = []

    class Recorded(ArrivingMedia):
        def sound(self, audio):
            calls.append("sound")
            super().sound(audio)

        def landed(self, count, copied=None):
            calls.append("landed")
            super().landed(count, copied)

        def finish(self, audio=None):
            calls.append("finish" if audio is None else "finish with audio")
            super().finish(audio)

    monkeypatch.setattr(render, "ArrivingMedia", Recorded)
    found = registry()
    prompts = tmp_path / "prompts.txt"
    prompts.write_text('{"id": "a", "prompt": "a fox"}\n')
    written = {}
    for workers in (2, 0):
        preset_file = tmp_path / f"fast-{workers}.toml"
        preset_file.write_text((ROOT / "presets" / "tiny.toml").read_text().replace('use = "reference"', 'use = "fast"')
                               + f"workers = {workers}\n")  # the last table is [mux]
        preset = resolve(str(preset_file), found)
        renderer = Renderer(preset, found, ModelRepo(tiny_model), PlainReporter(1))
        out = tmp_path / f"out-{workers}"
        try:
            assert [r.ok for r in renderer.render(read_prompts(prompts, 0, preset.request), out)] == [True]
        finally:
            renderer.close()
        written[workers] = (out / "a.mp4").read_bytes()
    assert calls[0] == "sound" and calls[-1] == "finish" and set(calls[1:-1]) == {"landed"}
    assert written[2] == written[0]


@pytest.mark.cuda
def test_frames_copied_from_the_device_arrive_as_the_reference_makes_them():
    """On CUDA each chunk lands after its copy on the side stream: a reader on another thread waits for it."""
    from h3gen.kernels.frames import frames_reference
    from h3gen.models.vae.host_frames import PIXEL_MEAN, PIXEL_STD, HostFrames

    device = torch.device("cuda")
    plan = SimpleNamespace(frames=10, row_starts=[0], col_starts=[0], tile_height=16, tile_width=24)
    media = ArrivingMedia()
    host = HostFrames(plan, device, media)
    media.open(host.frames.numpy(), 32000)
    read = []
    reader = threading.Thread(target=lambda: read.extend(np.array(frame) for frame in media))
    reader.start()
    video = torch.randn(3, 10, 16, 24, device=device)
    for start in range(0, 10, 4):
        host.write(video[:, start:start + 4])
    media.finish(np.zeros((2, 10), dtype=np.float32))
    reader.join(30)
    mean, std = torch.tensor(PIXEL_MEAN, device=device), torch.tensor(PIXEL_STD, device=device)
    assert np.array_equal(np.stack(read), frames_reference(video, mean, std).cpu().numpy())
    assert host.finite()
    video[1, 7, 3, 5] = float("nan")  # in the last chunk: the flag holds what any chunk's kernel saw
    damaged = HostFrames(plan, device)
    for start in range(0, 10, 4):
        damaged.write(video[:, start:start + 4])
    assert not damaged.finite()
