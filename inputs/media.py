"""The media files a prompts line conditions on, checked while the file is parsed, before any weight loads.

A keyframe or a reference that cannot be read, or that H3 cannot use, stops the run with the line and the file
named. Checks read headers and decode stills; a video is probed, not decoded (its exact length is checked again
when the clip encodes it).
"""

from __future__ import annotations

import importlib.util
import itertools
import math
import warnings
from pathlib import Path

from h3gen.inputs.request import FPS, SAMPLE_RATE, Reference
from h3gen.errors import UsageError

MIN_ASPECT, MAX_ASPECT = 1 / 4, 4
# Qwen3-VL reads a reference video at 2 fps and merges its frames in pairs, so a video has to span one pair:
# 13 frames at 24 fps (diffusers' MiniMaxH3Ref2VATextEncoderStep refuses anything shorter).
MIN_VIDEO_FRAMES = 13
CANVAS_MULTIPLE = 32  # the VAE's 16x compression times the DiT's 2x2 patch


def resolve_path(value: str, base: Path, field: str, where: str) -> Path:
    """A media path as written in the prompts file: absolute, or relative to the prompts file's folder."""
    if not value.strip() or "\0" in value:
        raise UsageError(f"{where}: {field} is not a file path ({value!r:.60})", "write the path of a media file")
    try:
        written = Path(value).expanduser()
        path = (base / written).resolve()
        if not path.is_file():
            problem = ("is a directory" if path.is_dir() else "is not a regular file" if path.exists()
                       else "does not exist")
            raise UsageError(f"{where}: {field} {path} {problem}", "give the path of a media file" if
                             written.is_absolute() else "paths are relative to the prompts file's folder, or "
                             "to the current one for prompts read from a pipe")
    except (OSError, RuntimeError) as e:  # RuntimeError: a symlink loop
        raise UsageError(f"{where}: {field} {value} cannot be read ({getattr(e, 'strerror', None) or e})",
                         "check the path") from None
    return path


def image_size(path: Path, field: str, where: str) -> tuple[int, int] | None:
    """(width, height) as displayed (EXIF orientation applied), decoding the whole image; None if it is not an
    image. An image too large to decode in reason, or one that does not decode (cut short, damaged), is refused."""
    from PIL import Image, ImageOps

    try:
        with warnings.catch_warnings():  # Pillow warns past its pixel limit: refused below, in one line
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(path)
    except Image.DecompressionBombError:
        raise UsageError(f"{where}: {field} {path} has more than {2 * Image.MAX_IMAGE_PIXELS / 1e6:.0f} MP, more "
                         f"than the {Image.MAX_IMAGE_PIXELS / 1e6:.0f} MP h3gen reads", IMAGE_TOO_LARGE_FIX) from None
    except (OSError, ValueError, SyntaxError):  # UnidentifiedImageError included: not an image Pillow knows
        return None
    with image:
        width, height = image.size
        if width * height > Image.MAX_IMAGE_PIXELS:
            raise UsageError(f"{where}: {field} {path} is {width}x{height} ({width * height / 1e6:.0f} MP), more "
                             f"than the {Image.MAX_IMAGE_PIXELS / 1e6:.0f} MP h3gen reads", IMAGE_TOO_LARGE_FIX)
        try:
            image.load()
        except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
            raise UsageError(f"{where}: {field} {path} is a {image.format} image that does not decode ({e})",
                             "the file is cut short or damaged: export it again") from None
        return ImageOps.exif_transpose(image).size


# H3 generates at most 1344x768 (about 1 MP): a keyframe or reference is scaled to that anyway.
IMAGE_TOO_LARGE_FIX = "scale it down, e.g. to 2048 px on its long side"


def check_aspect(size: tuple[int, int], field: str, path: Path, where: str) -> None:
    width, height = size
    if width <= 0 or height <= 0 or not MIN_ASPECT <= width / height <= MAX_ASPECT:
        raise UsageError(f"{where}: {field} {path} is {width}x{height}, outside the 1:4 to 4:1 aspect ratios H3 "
                         "generates", "crop it to a less extreme aspect ratio")


def keyframe(value: str, base: Path, field: str, where: str) -> tuple[Path, tuple[int, int]]:
    """A first_frame / last_frame: a readable image H3 can generate from; its path and displayed size."""
    path = resolve_path(value, base, field, where)
    size = image_size(path, field, where)
    if size is None:
        raise UsageError(f"{where}: {field} {path} is not an image h3gen can read",
                         "use a PNG, JPEG or WebP file")
    check_aspect(size, field, path, where)
    return path, size


def keyframe_canvas(size: tuple[int, int], width: int, height: int) -> tuple[int, int]:
    """(width, height) for a keyframe's aspect ratio on the preset's canvas: its short edge and its area.
    For 1344x768 this is H3's own rule (768 px short edge, at most 768 * 1344 px), as diffusers resolves it."""
    from diffusers.modular_pipelines.minimax_h3.modular_pipeline import resolve_canvas_size

    out_height, out_width = resolve_canvas_size(size[0], size[1], CANVAS_MULTIPLE, min(width, height), width * height)
    return out_width, out_height


def references(values: list, base: Path, where: str) -> tuple[Reference, ...]:
    """The ref2va references, each classified by what the file holds, within H3's per-kind limits."""
    from diffusers.modular_pipelines.minimax_h3.before_encoder import MiniMaxH3Ref2VASetupStep

    if not values:
        raise UsageError(f"{where}: 'references' is empty", "list at least one image or video, or leave it out")
    found = []
    for index, value in enumerate(values):
        field = f"references[{index}]"
        if not isinstance(value, str):
            raise UsageError(f"{where}: {field} must be a path string, got {value!r:.60}", 'e.g. ["subject.png"]')
        found.append(reference(resolve_path(value, base, field, where), field, where))
    limits = MiniMaxH3Ref2VASetupStep()
    kinds = [r.kind for r in found]
    for kind, limit in (("image", limits.max_images), ("video", limits.max_videos), ("audio", limits.max_audios)):
        if kinds.count(kind) > limit:
            raise UsageError(f"{where}: {kinds.count(kind)} {kind} references, H3 takes at most {limit}",
                             "drop some references")
    if len(kinds) > limits.max_references:
        raise UsageError(f"{where}: {len(kinds)} references, H3 takes at most {limits.max_references}",
                         "drop some references")
    if set(kinds) == {"audio"}:
        raise UsageError(f"{where}: audio references cannot be used on their own",
                         "add an image or video reference beside them")
    return tuple(found)


def reference(path: Path, field: str, where: str) -> Reference:
    size = image_size(path, field, where)
    if size is not None:
        check_aspect(size, field, path, where)
        return Reference("image", path)
    probe = probe_av(path)
    if probe is None:
        container = container_kind(path)
        if container:
            raise UsageError(f"{where}: {field} {path} is {container} file that does not decode",
                             "the file is cut short or damaged: export it again")
        raise UsageError(f"{where}: {field} {path} is not an image, video or audio file h3gen can read",
                         "use PNG/JPEG/WebP images, MP4/MOV/WebM videos, WAV/FLAC/MP3/M4A audio")
    video, audio, empty = probe
    if empty:
        raise UsageError(f"{where}: {field} {path} has an audio stream with no samples in it",
                         "use a recording that holds sound")
    if video is not None:
        frame_rate, size, seconds = video
        if not frame_rate:
            raise UsageError(f"{where}: {field} {path} has no frame rate", "re-encode it at a constant frame rate")
        check_aspect(size, field, path, where)
        if seconds is not None and math.floor(seconds * FPS + 0.5) < MIN_VIDEO_FRAMES:
            raise UsageError(f"{where}: {field} {path} lasts {seconds:.2f} s; H3 reads a video reference at 2 fps "
                             f"in pairs of frames, so it needs {MIN_VIDEO_FRAMES} frames at {FPS} fps (at least "
                             f"{(MIN_VIDEO_FRAMES - 0.5) / FPS:.2f} s)",
                             "use a longer video, or a still of it as an image reference")
    if audio is not None:
        check_soundtrack(audio, field, path, where)
    if video is None and audio is None:
        raise UsageError(f"{where}: {field} {path} has neither a video nor an audio stream", "check the file")
    return Reference("video" if video is not None else "audio", path)


# The first bytes of the containers a video or audio reference comes in: (offset, bytes, what the file is).
CONTAINERS = ((4, b"ftyp", "an MP4/MOV"), (0, b"\x1aE\xdf\xa3", "a WebM/Matroska"), (0, b"RIFF", "a WAV"),
              (0, b"fLaC", "a FLAC"), (0, b"ID3", "an MP3"), (0, b"OggS", "an Ogg"))


def container_kind(path: Path) -> str:
    """What container `path`'s first bytes say it is ('' for none of CONTAINERS): a file that says so and does not
    decode is damaged, not of a kind h3gen cannot read."""
    with open(path, "rb") as f:
        head = f.read(12)
    return next((kind for offset, magic, kind in CONTAINERS if head[offset:offset + len(magic)] == magic), "")


def check_soundtrack(audio: tuple[int, int], field: str, path: Path, where: str) -> None:
    sample_rate, channels = audio
    if channels not in (1, 2):
        raise UsageError(f"{where}: {field} {path} has {channels} audio channels; H3 conditions on mono or stereo",
                         "downmix it to stereo, e.g. with ffmpeg -ac 2")
    if sample_rate != SAMPLE_RATE and importlib.util.find_spec("torchaudio") is None:
        raise UsageError(f"{where}: {field} {path} has audio at {sample_rate} Hz; resampling it to H3's "
                         f"{SAMPLE_RATE} Hz needs torchaudio", f"pip install torchaudio, or convert it first, "
                         f"e.g. with ffmpeg -ar {SAMPLE_RATE}")


def probe_av(path: Path):
    """((frame rate, (width, height), seconds or None) or None, (sample rate, channels) or None, 'audio' when its
    audio stream holds no samples else None), or None when the file is not media PyAV can open and decode."""
    import av
    from av.stream import Disposition

    try:
        with av.open(str(path)) as container:
            video = audio = None
            # Cover art in a music file is a one-picture video stream: the file is still an audio reference.
            if container.streams.video and not container.streams.video[0].disposition & Disposition.attached_pic:
                stream = container.streams.video[0]
                rate = stream.average_rate or stream.guessed_rate
                seconds = None
                if stream.duration is not None and stream.time_base:
                    seconds = float(stream.duration * stream.time_base)
                elif container.duration:
                    seconds = container.duration / av.time_base
                video = (float(rate) if rate else 0.0, (stream.codec_context.width, stream.codec_context.height),
                         seconds)
            if container.streams.audio:
                stream = container.streams.audio[0]
                audio = (int(stream.codec_context.sample_rate or 0), int(stream.codec_context.channels or 0))
        # A header says little: a text file named .png opens as a 0x0 picture stream, a WAV header as audio with no
        # samples. Each stream's first frame must decode.
        for kind, found in (("video", video), ("audio", audio)):
            if found is None:
                continue
            with av.open(str(path)) as container:
                if next(container.decode(**{kind: 0}), None) is None:
                    return None if kind == "video" else (video, audio, "audio")
            if kind == "video" and video[2] is None:  # a raw stream's header has no length: count its frames
                with av.open(str(path)) as container:
                    counted = sum(1 for _ in itertools.islice(container.decode(video=0), MIN_VIDEO_FRAMES))
                if counted < MIN_VIDEO_FRAMES:
                    video = (video[0], video[1], counted / FPS)
        return video, audio, None
    except (av.FFmpegError, OSError, ValueError, UnicodeDecodeError):
        return None
