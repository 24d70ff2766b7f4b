"""Probe a rendered clip and list what is wrong with it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import av
import numpy as np

DURATION_TOLERANCE_S = 0.1
# The frame counts H3 renders: 17n+5, which the video VAE encodes to 5n+2 latent frames (124 at 5 s, 243 at 10 s).
FRAMES_PER_LATENT, FIRST_FRAMES = 17, 5
SILENCE_RMS = 1e-4


@dataclass(frozen=True)
class ClipInfo:
    video_streams: int = 0
    audio_streams: int = 0
    video_codec: str | None = None
    frames: int = 0
    width: int = 0
    height: int = 0
    fps: float | None = None
    pixel_variance: float | None = 0.0  # None: not measured
    audio_codec: str | None = None
    audio_channels: int = 0
    sample_rate: int = 0
    audio_samples: int = 0
    audio_rms: float = 0.0

    @property
    def video_duration(self) -> float:
        return self.frames / self.fps if self.fps else 0.0

    @property
    def audio_duration(self) -> float:
        return self.audio_samples / self.sample_rate if self.sample_rate else 0.0


def probe_clip(path: Path, pictures: bool = True) -> ClipInfo:
    """Decode the whole clip once; raises av.FFmpegError or OSError if unreadable, UnicodeDecodeError if its
    metadata is damaged. Without `pictures` the video's frames are counted from its packets, not decoded (nor their
    variance measured): what a rerun needs of a clip it stamped, at a small part of the cost."""
    with av.open(str(path)) as container:
        video = next(iter(container.streams.video), None)
        audio = next(iter(container.streams.audio), None)
        pixels, sound = _PixelStats(measured=pictures), _SoundStats()
        streams = [stream for stream in (video, audio) if stream is not None]
        for packet in container.demux(streams) if streams else ():
            if packet.stream.type == "video" and not pictures:
                pixels.frames += packet.size > 0  # the demuxer's last packet per stream is an empty flush
                continue
            stats = pixels if packet.stream.type == "video" else sound
            for frame in packet.decode():
                stats.add(frame)
        return ClipInfo(
            video_streams=len(container.streams.video),
            audio_streams=len(container.streams.audio),
            **_video_fields(video, pixels),
            **_audio_fields(audio, sound),
        )


def validate_clip(
    path: Path,
    expected_frames: int | None = None,
    fps: int = 24,
    sample_rate: int = 32000,
    pictures: bool = True,
) -> list[str]:
    """Human-readable problems with the clip at `path`; empty when it is valid. Without `pictures`, everything but
    the pictures themselves (see probe_clip): a blank video passes."""
    try:
        truncated = box_problem(Path(path))
        if truncated:
            return [truncated]
        if is_quicktime(path):
            return [QUICKTIME]
        info = probe_clip(path, pictures)
    except av.FFmpegError as error:  # its strerror: FFmpeg's own error number and log are noise to a user
        return [f"cannot read {path}: {error.strerror or error}"]
    except OSError as error:
        return [f"cannot read {path}: {error}"]
    except UnicodeDecodeError:  # PyAV decodes every metadata tag as it opens the file
        return ["its metadata is not UTF-8 text (damaged)"]
    return (
        _video_problems(info, expected_frames, fps)
        + _audio_problems(info, sample_rate)
        + _sync_problems(info)
    )


QUICKTIME = "a QuickTime movie (brand 'qt  '), not an MP4"


def not_an_mp4(path: Path) -> bool:
    """Whether the file holds bytes that do not begin as an MP4 does (an ftyp box); an empty file is a clip cut
    short, not another program's file."""
    with open(path, "rb") as f:
        head = f.read(8)
    return bool(head) and head[4:8] != b"ftyp"


def is_quicktime(path: Path) -> bool:
    """Whether the ftyp box's major brand is QuickTime's: the same boxes as an MP4, another format."""
    with open(path, "rb") as f:
        return f.read(12)[8:] == b"qt  "


REQUIRED_BOXES = (b"ftyp", b"moov", b"mdat")


def box_problem(path: Path) -> str:
    """What is wrong with the MP4's top-level boxes ('' when nothing): they must tile the file exactly, so a file cut
    short (a copy that stopped, a disk that filled) is caught even where the decoder reads past the missing end."""
    size, offset, found = path.stat().st_size, 0, set()
    with path.open("rb") as f:
        while offset < size:
            f.seek(offset)
            header = f.read(16)
            if len(header) < 8:
                if offset == 0:
                    return f"not an MP4 ({size} bytes, too short for a box)"
                return (f"truncated, or bytes added after its end: {size - offset} stray byte(s) after the last "
                        f"box at offset {offset}")
            length, kind = int.from_bytes(header[:4], "big"), header[4:8]
            if offset == 0 and kind != b"ftyp":
                return "not an MP4 (it does not start with an ftyp box)"
            if length == 1:  # a 64-bit size follows the type
                length = int.from_bytes(header[8:16], "big") if len(header) == 16 else 0
            elif length == 0:  # the box runs to the end of the file
                length = size - offset
            if length < 8:
                return f"not an MP4 (box at offset {offset} has size {length})"
            if offset + length > size:
                return (f"truncated: box {kind.decode('latin-1')!r} at offset {offset} needs {length} bytes, "
                        f"the file has {size - offset} from there")
            found.add(kind)
            offset += length
    missing = [kind.decode() for kind in REQUIRED_BOXES if kind not in found]
    return f"not a whole MP4 (no {', '.join(missing)} box)" if missing else ""


class _PixelStats:
    """Frame count and exact pixel variance (summed over RGB channels)."""

    def __init__(self, measured: bool = True) -> None:
        self.frames = self.count = 0
        self.measured = measured  # False: frames counted from packets, no pixel read
        self.total = np.zeros(3, np.int64)
        self.squares = np.zeros(3, np.int64)

    def add(self, frame: av.VideoFrame) -> None:
        pixels = frame.to_ndarray(format="rgb24").reshape(-1, 3).astype(np.int64)
        self.frames += 1
        self.count += len(pixels)
        self.total += pixels.sum(axis=0)
        self.squares += np.square(pixels).sum(axis=0)

    def variance(self) -> float | None:
        if not self.measured:
            return None
        n = self.count
        spread = sum(n * int(sq) - int(t) ** 2 for t, sq in zip(self.total, self.squares))
        return spread / n**2 if n else 0.0


class _SoundStats:
    """Decoded sample count (per channel) and RMS over all channels."""

    def __init__(self) -> None:
        self.samples, self.energy, self.values = 0, 0.0, 0

    def add(self, frame: av.AudioFrame) -> None:
        pcm = frame.to_ndarray().astype(np.float64)
        self.samples += frame.samples
        self.energy += float(np.square(pcm).sum())
        self.values += pcm.size

    def rms(self) -> float:
        return (self.energy / self.values) ** 0.5 if self.values else 0.0


def _video_fields(stream, pixels: _PixelStats) -> dict:
    if stream is None:
        return {}
    rate = stream.average_rate or stream.guessed_rate
    return dict(
        video_codec=stream.codec_context.name,
        frames=pixels.frames,
        width=stream.codec_context.width,
        height=stream.codec_context.height,
        fps=float(rate) if rate else None,
        pixel_variance=pixels.variance(),
    )


def _audio_fields(stream, sound: _SoundStats) -> dict:
    if stream is None:
        return {}
    return dict(
        audio_codec=stream.codec_context.name,
        audio_channels=stream.codec_context.channels,
        sample_rate=stream.codec_context.sample_rate,
        audio_samples=sound.samples,
        audio_rms=sound.rms(),
    )


def _video_problems(info: ClipInfo, expected_frames: int | None, fps: int) -> list[str]:
    if info.video_streams != 1:
        return [f"expected exactly one video stream, found {info.video_streams}"]
    problems = []
    if info.video_codec != "h264":
        problems.append(f"video codec is {info.video_codec}, expected h264")
    if info.fps is None or abs(info.fps - fps) > 1e-3:
        problems.append(f"video runs at {info.fps} fps, expected {fps}")
    if expected_frames is not None and info.frames != expected_frames:
        problems.append(f"video has {info.frames} frames, expected {expected_frames}")
    elif expected_frames is None and (info.frames < FIRST_FRAMES or (info.frames - FIRST_FRAMES) % FRAMES_PER_LATENT):
        problems.append(f"video has {info.frames} frame{'s' if info.frames != 1 else ''}, not a count H3 renders "
                        f"({FRAMES_PER_LATENT}n+{FIRST_FRAMES})")
    if info.pixel_variance == 0:  # None (not measured) is not 0
        problems.append("video is constant (zero pixel variance)")
    return problems


def _audio_problems(info: ClipInfo, sample_rate: int) -> list[str]:
    if info.audio_codec is None:
        return ["no audio stream"]
    problems = [] if info.audio_streams == 1 else [f"expected exactly one audio stream, found {info.audio_streams}"]
    if info.audio_codec != "aac":
        problems.append(f"audio codec is {info.audio_codec}, expected aac")
    if info.audio_channels != 2:
        problems.append(f"audio has {info.audio_channels} channel{'s' if info.audio_channels != 1 else ''}, "
                        "expected 2")
    if info.sample_rate != sample_rate:
        problems.append(f"audio sample rate is {info.sample_rate} Hz, expected {sample_rate}")
    if info.audio_rms <= SILENCE_RMS:
        problems.append(f"audio is silent (RMS {info.audio_rms:.2e})")
    return problems


def _sync_problems(info: ClipInfo) -> list[str]:
    if info.video_streams != 1 or info.audio_codec is None:
        return []
    gap = abs(info.audio_duration - info.video_duration)
    if gap > DURATION_TOLERANCE_S:
        return [
            f"audio lasts {info.audio_duration:.3f} s but video {info.video_duration:.3f} s"
        ]
    return []
