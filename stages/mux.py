"""Mux rendered frames and a stereo soundtrack into a deterministic MP4."""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
from fractions import Fraction
from pathlib import Path

import numpy as np

from h3gen.run.arriving import decoded
from h3gen.run.fingerprint import stamp
from h3gen.run.outputs import partial_mp4
from h3gen.stages.base import Stage

AAC_FRAME_SAMPLES = 1024

# No muxer version string in the file; the mp4 muxer writes a zero creation time
# unless a creation_time tag is set, and none is.
_BITEXACT = {"fflags": "+bitexact"}

# x264's AVX-512 macroblock-tree code reads uninitialised memory, so with mbtree on
# the bitstream changes from run to run on AVX-512 CPUs; off keeps it byte-identical.
_X264_PARAMS = "mbtree=0"

# A background mux thread drops and retakes the GIL around its calls into libav, many times a frame. While the run
# loop's thread launches the decode's kernels, each retake waits until Python makes the loop drop the GIL, after
# its switch interval (5 ms by default). Beside a busy Python thread a 10 s clip's mux took 25.8 s instead of 3.1 s
# (`python3 bench/mux_probe.py` on an H200 host).
MUX_SWITCH_INTERVAL_S = 5e-4


class _SwitchInterval:
    """Python's switch interval at most MUX_SWITCH_INTERVAL_S while any mux's pool lives; the one before comes back
    when the last pool ends."""

    def __init__(self):
        self.lock, self.pools, self.before = threading.Lock(), 0, None

    def pool_started(self) -> None:
        with self.lock:
            if self.pools == 0:
                self.before = sys.getswitchinterval()
                sys.setswitchinterval(min(self.before, MUX_SWITCH_INTERVAL_S))
            self.pools += 1

    def pool_ended(self) -> None:
        with self.lock:
            self.pools -= 1
            if self.pools == 0:
                sys.setswitchinterval(self.before)


_switch_interval = _SwitchInterval()


# The text tags FFmpeg's MP4 muxer writes (and the comment, which holds h3gen's stamp); it leaves out any other.
MP4_TAGS = ("title", "artist", "album_artist", "composer", "album", "date", "genre", "copyright", "grouping", "lyrics",
            "description", "synopsis", "show", "episode_id", "network", "keywords")


# A stage's Config is user documentation too: each field's comment is its text in the man page's PRESET KEYS
# (h3gen.cli.preset_keys), and check_config refuses a value before the run starts.
@dataclasses.dataclass
class PyAVMuxConfig:
    crf: int = 18  # x264's constant rate factor: lower keeps more detail, in a bigger file
    x264_preset: str = "veryfast"  # x264's speed preset: a slower one makes a smaller file of the same quality
    # A fixed count, not "auto": x264's output depends on its thread count, so a fixed one keeps the same clip
    # byte-identical on every machine.
    x264_threads: int = 8
    # Clips encoded in the background while the device renders the next ones; 0 muxes in line.
    workers: int = 2


def write_mp4(
    path: Path,
    frames: np.ndarray,
    audio: np.ndarray,
    sample_rate: int = 32000,
    fps: int = 24,
    crf: int = PyAVMuxConfig.crf,  # the built-in mux's settings, so a plugin's call writes the same bytes
    preset: str = PyAVMuxConfig.x264_preset,
    x264_threads: int = PyAVMuxConfig.x264_threads,
    cancelled=lambda: False,
    comment: str = "",
    audio_ahead=lambda: None,
    tags: dict[str, str] | None = None,
) -> None:
    """Write H.264 + AAC to `path` atomically; a partial MP4 never appears at `path`.

    `frames` is uint8 (T, H, W, 3) RGB, or frames still arriving from the decode (`h3gen.run.arriving`); `audio` is float
    (2, N) in [-1, 1], or a callable that gives it once the frames are through. Identical inputs give byte-identical
    files. `cancelled()` is polled per frame: when it turns true the write stops with `MuxCancelled` and leaves
    nothing behind. `comment` goes into the MP4's comment tag (h3gen stores the clip's render fingerprint there);
    `tags` are more of the container's tags ({"title": ...}), any but comment.
    `audio_ahead()` gives the soundtrack before the frames when it is in by then, else None: it is encoded while the
    frames arrive, and its packets go after the video's all the same, so the file is the same bytes.
    """
    import av  # PyAV when a clip is muxed, not when the stage registers

    _check_frames(frames)
    tags = tags or {}
    if "comment" in tags:
        raise ValueError("the comment tag holds h3gen's stamp (write_mp4's comment); give the text another tag")
    unknown = sorted(set(tags) - set(MP4_TAGS))
    if unknown:  # the MP4 muxer drops them without a word
        raise ValueError(f"MP4 has no tag {unknown[0]!r}; its text tags: {', '.join(MP4_TAGS)}")
    path = Path(path)
    partial = partial_mp4(path)
    try:
        with av.open(str(partial), "w", format="mp4", options=_BITEXACT) as container:
            if comment:
                container.metadata["comment"] = comment
            container.metadata.update(tags)
            video = _add_video_stream(container, frames, fps, crf, preset, x264_threads)
            sound = _add_audio_stream(container, sample_rate)
            soundtrack = audio if not callable(audio) else audio_ahead()
            packets = _encode_audio(sound, soundtrack, sample_rate) if soundtrack is not None else None
            _encode_video(container, video, frames, cancelled)
            container.mux(packets if packets is not None else _encode_audio(sound, audio(), sample_rate))
        _fsync(partial)
        os.replace(partial, path)
        _fsync(path.parent)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise


def _check_frames(frames) -> None:
    if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != 3:
        raise ValueError(f"frames must be uint8 (T, H, W, 3), got {frames.dtype} {frames.shape}")


def _check_audio(audio) -> None:
    if audio.ndim != 2 or audio.shape[0] != 2:
        raise ValueError(f"audio must be (2, N), got {audio.shape}")


def _add_video_stream(container, frames, fps, crf, preset, threads):
    stream = container.add_stream("libx264", rate=fps)
    stream.width, stream.height = frames.shape[2], frames.shape[1]
    stream.pix_fmt = "yuv420p"
    stream.time_base = Fraction(1, fps)
    stream.codec_context.time_base = Fraction(1, fps)
    stream.codec_context.thread_count = threads
    stream.options = {"crf": str(crf), "preset": preset, "x264-params": _X264_PARAMS}
    return stream


def _add_audio_stream(container, sample_rate):
    import av

    stream = container.add_stream("aac", rate=sample_rate, layout="stereo")
    # Plain C float DSP instead of CPU-specific SIMD, so the AAC bits do not
    # depend on the machine.
    stream.codec_context.flags |= av.codec.context.Flags.bitexact
    return stream


class MuxCancelled(Exception):
    """The run is stopping; the clip being written is discarded."""


def _encode_video(container, stream, frames, cancelled):
    from av.video.reformatter import VideoReformatter

    reformatter = VideoReformatter()  # one swscale context and thread pool for the clip
    threads = stream.codec_context.thread_count
    for index, pixels in enumerate(frames):
        if cancelled():
            raise MuxCancelled("stopped while muxing")
        frame = _yuv420p(reformatter, pixels, threads)
        frame.pts = index
        frame.time_base = stream.codec_context.time_base
        container.mux(stream.encode(frame))
    container.mux(stream.encode(None))


def _yuv420p(reformatter, pixels, threads):
    """One RGB frame as the encoder's yuv420p: wrapped without a copy and converted by swscale on `threads` slices.
    Handed RGB, the encoder would copy it and convert it on one thread, to the same bytes."""
    import av

    frame = av.VideoFrame.from_numpy_buffer(np.ascontiguousarray(pixels), format="rgb24")
    return reformatter.reformat(frame, format="yuv420p", threads=threads)


def _encode_audio(stream, audio, sample_rate) -> list:
    """The soundtrack's AAC packets, to mux after the video's."""
    import av

    _check_audio(audio)
    samples = np.clip(audio, -1.0, 1.0).astype(np.float32)
    packets = []
    for start in range(0, samples.shape[1], AAC_FRAME_SAMPLES):
        chunk = np.ascontiguousarray(samples[:, start : start + AAC_FRAME_SAMPLES])
        frame = av.AudioFrame.from_ndarray(chunk, format="fltp", layout="stereo")
        frame.sample_rate = sample_rate
        frame.pts = start
        frame.time_base = Fraction(1, sample_rate)
        packets += stream.encode(frame)
    return packets + stream.encode(None)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# x264's own list (x264_preset_names in x264.h). Asking libx264 instead prints its complaint straight to the
# terminal, past libav's logging.
X264_PRESETS = ("ultrafast", "superfast", "veryfast", "faster", "fast", "medium", "slow", "slower", "veryslow",
                "placebo")


class PyAVMux(Stage):
    kind, name = "mux", "pyav"
    Config = PyAVMuxConfig
    description = "PyAV: H.264 (libx264) + AAC stereo into an MP4, written atomically"
    on_host = True
    background = True  # with mux.workers > 0; `submit` returns None when it is 0

    @classmethod
    def check_config(cls, config) -> None:
        """The encoder's values, before any clip renders rather than at its mux."""
        from h3gen.errors import UsageError

        if not 0 <= config.crf <= 51:
            raise UsageError(f"mux.crf = {config.crf} is outside x264's 0-51",
                             "give 0 (lossless) to 51 (smallest); the default 18 looks lossless")
        if config.x264_threads < 1:
            raise UsageError(f"mux.x264_threads = {config.x264_threads}: the encoder takes a fixed count of threads",
                             "give 1 or more: x264's own 0 picks by the machine, so clips would differ between them")
        if config.workers < 0:
            raise UsageError(f"mux.workers = {config.workers} is below 0",
                             "0 muxes in line, 1 or more in the background")
        if config.x264_preset not in X264_PRESETS:
            raise UsageError(f"mux.x264_preset = {config.x264_preset!r} is not one of x264's presets",
                             f"use one of {', '.join(X264_PRESETS)}")

    def submit(self, clip, stage=None):
        """Mux on a background thread, through `stage` (a wrapper of this mux) or this one; returns a Future of the
        clip, or None when muxing runs in line.

        Threads rather than processes: libx264 and the AAC encoder run outside the GIL, and a thread reads the
        clip's frames where they are instead of copying most of a gigabyte to another process."""
        if self.config.workers <= 0:
            return None
        if self.pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self.pool = ThreadPoolExecutor(self.config.workers, thread_name_prefix="h3gen-mux")
            _switch_interval.pool_started()
        return self.pool.submit(stage or self, clip, False)

    def discard_in_flight(self) -> None:
        """A signal ends the run: the background writes of clips whose frames are not all decoded stop now (their
        partial files removed); those of decoded clips, whose device time is spent, are finished first."""
        self.stopping.set()
        self.unload()

    def unload(self):
        if self.pool is not None:
            self.pool.shutdown(wait=True)
            self.pool = None
            _switch_interval.pool_ended()

    def __init__(self, config, runtime):
        super().__init__(config, runtime)
        self.pool, self.stopping = None, threading.Event()

    def run(self, clip):
        media = clip.arriving  # set when the mux starts with the decode
        frames, audio = (media, media.audio) if media is not None else (clip.frames, clip.audio)
        sample_rate = media.sample_rate if media is not None else clip.sample_rate
        write_mp4(clip.path, frames, audio, sample_rate=sample_rate, crf=self.config.crf,
                  preset=self.config.x264_preset, x264_threads=self.config.x264_threads,
                  cancelled=lambda: self.stopping.is_set() and not decoded(clip),
                  comment=stamp(clip.fingerprint) if clip.fingerprint else "",
                  audio_ahead=media.audio_ahead if media is not None else lambda: None, tags=clip.tags)
        return clip
