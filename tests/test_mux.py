import dataclasses
import errno
import sys

import av
import numpy as np
from av.video.reformatter import VideoReformatter
import pytest

from h3gen.stages import mux
from h3gen.stages.mux import write_mp4
from h3gen.run.validate import probe_clip, validate_clip

FRAMES, SIZE, FPS, RATE = 124, 32, 24, 32000


def moving_frames(frames: int = FRAMES) -> np.ndarray:
    rng = np.random.default_rng(7)
    t, y, x = np.meshgrid(np.arange(frames), np.arange(SIZE), np.arange(SIZE), indexing="ij")
    ramp = (x * 6 + y * 2 + t * 5) % 256
    noise = rng.integers(0, 32, (frames, SIZE, SIZE))
    return np.stack([ramp, 255 - ramp, noise * 4], axis=-1).astype(np.uint8)


def soundtrack(seconds: float = FRAMES / FPS) -> np.ndarray:
    t = np.arange(round(seconds * RATE)) / RATE
    left, right = np.sin(2 * np.pi * 440 * t), np.sin(2 * np.pi * 660 * t)
    return (0.5 * np.stack([left, right])).astype(np.float32)


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    path = tmp_path_factory.mktemp("clip") / "clip.mp4"
    write_mp4(path, moving_frames(), soundtrack())
    return path


def test_valid_clip_has_no_problems(clip):
    assert validate_clip(clip, expected_frames=FRAMES) == []
    info = probe_clip(clip)
    assert (info.frames, info.width, info.height, info.fps) == (FRAMES, SIZE, SIZE, FPS)
    assert (info.video_codec, info.audio_codec) == ("h264", "aac")
    assert (info.audio_channels, info.sample_rate) == (2, RATE)
    assert info.audio_duration == pytest.approx(info.video_duration, abs=0.1)


def test_without_pictures_the_probe_counts_the_frames_and_measures_the_sound_as_a_full_decode_does(clip, tmp_path):
    full, quick = probe_clip(clip), probe_clip(clip, pictures=False)
    assert quick.pixel_variance is None and full.pixel_variance > 0
    assert dataclasses.replace(quick, pixel_variance=full.pixel_variance) == full
    grey = tmp_path / "grey.mp4"
    write_mp4(grey, np.full((FRAMES, SIZE, SIZE, 3), 128, np.uint8), soundtrack())
    assert validate_clip(grey, expected_frames=FRAMES, pictures=False) == []  # the pictures alone go unread
    assert validate_clip(clip, expected_frames=100, pictures=False) == ["video has 124 frames, expected 100"]
    cut = tmp_path / "cut.mp4"
    cut.write_bytes(clip.read_bytes()[:-1000])
    assert validate_clip(cut, pictures=False)[0].startswith("truncated")


def test_only_the_finished_clip_is_left(clip):
    assert [p.name for p in clip.parent.iterdir()] == ["clip.mp4"]


def test_identical_inputs_give_identical_bytes(tmp_path):
    first, second = tmp_path / "first.mp4", tmp_path / "second.mp4"
    write_mp4(first, moving_frames(), soundtrack())
    write_mp4(second, moving_frames(), soundtrack())
    data = first.read_bytes()
    assert data == second.read_bytes()
    mvhd = data.index(b"mvhd")
    assert data[mvhd + 8 : mvhd + 16] == bytes(8), "creation/modification time must be zero"
    assert b"Lavf" not in data


def test_every_mp4_text_tag_is_written_beside_the_stamp_and_any_other_is_refused(tmp_path):
    """FFmpeg's MP4 muxer leaves out a tag it has no box for, without a word: write_mp4 takes only those it writes,
    and never a comment of the caller's, which would take the stamp's place."""
    path = tmp_path / "tagged.mp4"
    tags = {tag: f"{tag} of the clip" for tag in mux.MP4_TAGS}
    write_mp4(path, moving_frames(), soundtrack(), comment="the stamp", tags=tags)
    with av.open(str(path)) as container:
        assert {key: container.metadata.get(key) for key in tags} == tags
        assert container.metadata["comment"] == "the stamp"
    assert validate_clip(path) == []
    for bad, said in (({"comment": "mine"}, "the comment tag holds h3gen's stamp"), ({"mood": "calm"},
                                                                                    "MP4 has no tag 'mood'")):
        with pytest.raises(ValueError, match=said):
            write_mp4(tmp_path / "bad.mp4", moving_frames(), soundtrack(), tags=bad)
        assert list(tmp_path.iterdir()) == [path]


def test_constant_video_fails(tmp_path):
    path = tmp_path / "grey.mp4"
    write_mp4(path, np.full((FRAMES, SIZE, SIZE, 3), 128, np.uint8), soundtrack())
    problems = validate_clip(path, expected_frames=FRAMES)
    assert problems == ["video is constant (zero pixel variance)"]


def test_silent_audio_fails(tmp_path):
    path = tmp_path / "silent.mp4"
    write_mp4(path, moving_frames(), np.zeros_like(soundtrack()))
    (problem,) = validate_clip(path, expected_frames=FRAMES)
    assert problem.startswith("audio is silent")


def test_wrong_frame_count_fails(clip):
    assert validate_clip(clip, expected_frames=100) == ["video has 124 frames, expected 100"]


def test_audio_shorter_than_video_fails(tmp_path):
    path = tmp_path / "short.mp4"
    write_mp4(path, moving_frames(), soundtrack(seconds=2.0))
    (problem,) = validate_clip(path)
    assert problem.startswith("audio lasts 2.0")


def test_loud_audio_is_clipped_not_rejected(tmp_path):
    path = tmp_path / "loud.mp4"
    write_mp4(path, moving_frames(24), 4 * soundtrack(seconds=1.0))
    assert validate_clip(path, expected_frames=24) == []


def test_failure_mid_write_leaves_no_file(tmp_path, monkeypatch):
    def broken_audio(*args):
        raise RuntimeError("encoder died")

    monkeypatch.setattr(mux, "_encode_audio", broken_audio)
    with pytest.raises(RuntimeError, match="encoder died"):
        write_mp4(tmp_path / "clip.mp4", moving_frames(), soundtrack())
    assert list(tmp_path.iterdir()) == []


def test_unencodable_input_leaves_no_file(tmp_path):
    with pytest.raises(ValueError):
        write_mp4(tmp_path / "clip.mp4", np.zeros((4, SIZE, SIZE), np.float32), soundtrack())
    assert list(tmp_path.iterdir()) == []


def test_disk_full_propagates_as_is(tmp_path, monkeypatch):
    disk_full = OSError(errno.ENOSPC, "No space left on device")

    def full_disk(path):
        raise disk_full

    monkeypatch.setattr(mux, "_fsync", full_disk)
    with pytest.raises(OSError) as raised:
        write_mp4(tmp_path / "clip.mp4", moving_frames(24), soundtrack(seconds=1.0))
    assert raised.value is disk_full
    assert list(tmp_path.iterdir()) == []


def test_corrupt_file_is_a_problem(tmp_path):
    path = tmp_path / "corrupt.mp4"
    path.write_bytes(np.random.default_rng(3).bytes(4096))
    assert validate_clip(path) == ["not an MP4 (it does not start with an ftyp box)"]


def test_a_few_bytes_of_text_are_not_an_mp4(tmp_path):
    path = tmp_path / "notvideo.mp4"
    path.write_text("hello\n")
    assert validate_clip(path) == ["not an MP4 (6 bytes, too short for a box)"]


def test_missing_file_is_a_problem(tmp_path):
    (problem,) = validate_clip(tmp_path / "missing.mp4")
    assert problem.startswith("cannot read")


def test_validate_names_a_link_to_nothing_in_a_folder_and_keeps_its_lines_in_order_in_a_log(clip, tmp_path):
    """A folder's entries named as clips that are not files are checked too (a link to nothing does not exist, as it
    does named alone); ok lines go to stdout, INVALID ones to stderr, each as it is checked."""
    import shutil
    import subprocess

    folder = tmp_path / "out"
    folder.mkdir()
    for name in ("a.mp4", "c.mp4"):
        shutil.copy(clip, folder / name)
    (folder / "b.mp4").symlink_to(tmp_path / "gone.mp4")
    (folder / "d.mp4").mkdir()
    with open(tmp_path / "log", "w") as log:
        code = subprocess.run([sys.executable, "-m", "h3gen.cli.main", "validate", folder], stdout=log,
                              stderr=subprocess.STDOUT).returncode
    assert code == 2 and (tmp_path / "log").read_text().splitlines() == [
        f"{folder}/a.mp4: ok", f"{folder}/b.mp4: INVALID: does not exist (a link to {tmp_path}/gone.mp4, which is "
        "missing)", f"{folder}/c.mp4: ok", f"{folder}/d.mp4: INVALID: is a directory, not a clip"]
    (folder / "b.mp4").unlink()
    code = subprocess.run([sys.executable, "-m", "h3gen.cli.main", "validate", folder], capture_output=True).returncode
    assert code == 1  # a directory named as a clip is there: invalid, not missing


def test_a_truncated_clip_is_a_problem(clip, tmp_path):
    """The last bytes cut: the clip may still decode, but its boxes no longer add up to the file's size."""
    whole = clip.read_bytes()
    for cut in (1, 7, 48, 100):
        path = tmp_path / f"cut-{cut}.mp4"
        path.write_bytes(whole[:-cut])
        problems = validate_clip(path, expected_frames=FRAMES)
        assert problems and "truncated" in problems[0], (cut, problems)
    grown = tmp_path / "grown.mp4"
    grown.write_bytes(whole + b"\0" * 3)
    assert validate_clip(grown, expected_frames=FRAMES)


def test_frames_converted_ahead_of_the_encoder_give_its_own_bytes(tmp_path, monkeypatch):
    """The mux converts each RGB frame to yuv420p itself, on several threads; handed the RGB frame, the encoder
    converts it on one. Both give the same frame and the same file."""
    wide = np.random.default_rng(3).integers(0, 256, (770, 1344, 3), dtype=np.uint8)  # 8 slices of uneven height
    one = av.VideoFrame.from_ndarray(wide, "rgb24").reformat(format="yuv420p")
    assert np.array_equal(mux._yuv420p(VideoReformatter(), wide, 8).to_ndarray(), one.to_ndarray())
    frames = np.concatenate([moving_frames(12)] * 3, axis=2)  # 32 x 96
    write_mp4(tmp_path / "ahead.mp4", frames, soundtrack(0.5), x264_threads=4)
    rgb = lambda reformatter, pixels, threads: av.VideoFrame.from_ndarray(pixels, "rgb24")  # noqa: E731
    monkeypatch.setattr(mux, "_yuv420p", rgb)
    write_mp4(tmp_path / "encoder.mp4", frames, soundtrack(0.5), x264_threads=4)
    assert (tmp_path / "ahead.mp4").read_bytes() == (tmp_path / "encoder.mp4").read_bytes()


def test_the_background_mux_lowers_the_switch_interval_while_its_threads_live():
    """Its threads retake the GIL many times a frame; at Python's default 5 ms switch interval a busy render thread
    kept a 10 s clip's mux waiting for most of its time. The interval comes back when the last pool ends."""
    before = sys.getswitchinterval()
    first, second = (mux.PyAVMux(mux.PyAVMuxConfig(workers=1), runtime=None) for _ in range(2))
    seen = first.submit("clip", stage=lambda clip, report: (clip, sys.getswitchinterval())).result()
    assert seen == ("clip", min(before, mux.MUX_SWITCH_INTERVAL_S)) and before > mux.MUX_SWITCH_INTERVAL_S
    second.submit("clip", stage=lambda clip, report: clip).result()
    first.unload()
    assert sys.getswitchinterval() == mux.MUX_SWITCH_INTERVAL_S  # the second pool still lives
    second.unload()
    assert sys.getswitchinterval() == before
    assert mux.PyAVMux(mux.PyAVMuxConfig(workers=0), runtime=None).submit("clip") is None
    assert sys.getswitchinterval() == before


def test_a_mono_soundtrack_is_named_as_one_channel(tmp_path):
    path = tmp_path / "mono.mp4"
    with av.open(str(path), "w", format="mp4") as container:
        video = container.add_stream("libx264", rate=24)
        video.width = video.height = 32
        video.pix_fmt = "yuv420p"
        audio = container.add_stream("aac", rate=32000, layout="mono")
        for index, pixels in enumerate(moving_frames(FRAMES)):
            frame = av.VideoFrame.from_ndarray(pixels, format="rgb24")
            frame.pts = index
            container.mux(video.encode(frame))
        container.mux(video.encode(None))
        samples = soundtrack(FRAMES / 24)[:1]
        for start in range(0, samples.shape[1], 1024):
            frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(samples[:, start:start + 1024]), format="fltp",
                                               layout="mono")
            frame.sample_rate, frame.pts = 32000, start
            container.mux(audio.encode(frame))
        container.mux(audio.encode(None))
    assert validate_clip(path, expected_frames=FRAMES) == ["audio has 1 channel, expected 2"]


def test_a_second_soundtrack_a_quicktime_movie_and_an_odd_frame_count_are_problems(tmp_path):
    """What h3gen writes: one H.264 stream, one AAC stereo stream, in an MP4, 17n+5 frames unless --frames says."""
    assert validate_clip(clip_with_streams(tmp_path / "two.mp4", "mp4", soundtracks=2)) == [
        "expected exactly one audio stream, found 2"]
    assert validate_clip(clip_with_streams(tmp_path / "movie.mov", "mov", soundtracks=1)) == [
        "a QuickTime movie (brand 'qt  '), not an MP4"]
    one = tmp_path / "one.mp4"
    write_mp4(one, moving_frames(1), soundtrack(seconds=1 / FPS))
    assert validate_clip(one) == ["video has 1 frame, not a count H3 renders (17n+5)"]
    assert validate_clip(one, expected_frames=1) == []


def clip_with_streams(path, container_format, soundtracks):
    import av

    with av.open(str(path), "w", format=container_format) as container:
        video = container.add_stream("libx264", rate=FPS)
        video.width = video.height = SIZE
        video.pix_fmt = "yuv420p"
        sounds = [container.add_stream("aac", rate=RATE, layout="stereo") for _ in range(soundtracks)]
        for frame in moving_frames():
            container.mux(video.encode(av.VideoFrame.from_ndarray(frame, "rgb24")))
        container.mux(video.encode())
        samples = soundtrack()
        for sound in sounds:
            for start in range(0, samples.shape[1], 1024):
                chunk = av.AudioFrame.from_ndarray(np.ascontiguousarray(samples[:, start:start + 1024]), "fltp",
                                                   "stereo")
                chunk.sample_rate, chunk.pts = RATE, start
                container.mux(sound.encode(chunk))
            container.mux(sound.encode())
    return path


def test_a_background_mux_hashes_the_clip_it_wrote_on_its_own_thread(tmp_path, monkeypatch):
    """The manifest's sha256 reads the whole MP4: that read is the mux thread's, not the run loop's, whose time
    launches the device's kernels."""
    import contextlib
    import hashlib
    import threading
    import types

    from h3gen.inputs.request import Request
    from h3gen.run import outputs
    from h3gen.stages.clip import Clip

    hashed_on, sha256_of = [], outputs.sha256_of
    monkeypatch.setattr(outputs, "sha256_of", lambda path: hashed_on.append(threading.current_thread().name)
                        or sha256_of(path))
    runtime = types.SimpleNamespace(timer=types.SimpleNamespace(measure=lambda *a, **k: contextlib.nullcontext()))
    stage = mux.PyAVMux(mux.PyAVMuxConfig(workers=1), runtime)
    request = Request(index=0, prompt="p", seed=1, width=SIZE, height=SIZE, frames=FRAMES)
    clip = Clip(request, tmp_path / "c.mp4", frames=moving_frames(), audio=soundtrack(), sample_rate=RATE)
    done = stage.submit(clip).result()
    stage.unload()
    assert done.sha256 == hashlib.sha256(clip.path.read_bytes()).hexdigest()
    assert len(hashed_on) == 1 and hashed_on[0].startswith("h3gen-mux"), hashed_on
