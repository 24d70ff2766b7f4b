"""What flows between stages: a clip, the typed fields each stage reads and writes, and the order they run in.

`FLOW` is the pipeline written once, as data: the order the renderers run the stages in (PIPELINE and the device
stages below derive from it), and what a stage of each kind is handed and must hand on, for a plugin author.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from h3gen.inputs.request import Request


@dataclasses.dataclass(frozen=True)
class Step:
    kind: str
    reads: tuple[str, ...]
    writes: tuple[str, ...]
    on_device: bool  # runs on the clip's device, on every rank of a group; the mux runs on the host, once
    ahead: bool = False  # runs for every prompt of a chunk before the chunk's first clip renders (run.render)


FLOW = (
    Step("encode", reads=("request",), writes=("prompt_embeds", "text_token_tags", "conditions", "encode_cached"),
         on_device=True, ahead=True),
    Step("sampler", reads=("request", "prompt_embeds", "text_token_tags", "conditions", "noise"),
         writes=("video_latents", "audio_latents", "forwards", "forwards_reused", "attention"), on_device=True),
    Step("vae", reads=("video_latents", "audio_latents"), writes=("frames", "audio", "sample_rate", "arriving"),
         on_device=True),
    Step("mux", reads=("frames", "audio", "sample_rate", "arriving", "path", "fingerprint", "tags"), writes=(),
         on_device=False),
)
PIPELINE = tuple(step.kind for step in FLOW)  # quant is applied at load time by the stages that load weights
DEVICE_STAGES = tuple(step.kind for step in FLOW if step.on_device)  # spread over a group (`Stage.parallelize`)
CLIP_DEVICE_STAGES = tuple(step.kind for step in FLOW if step.on_device and not step.ahead)  # clip by clip
# The sampler's DiT forwards alone, a part of its seconds: the rest (the packed layout, the seeded noise, the steps)
# is paid once a clip, whatever the forward count.
FORWARDS_PART = "dit_forwards"


@dataclasses.dataclass
class Clip:
    request: Request
    path: Path
    preset: str = ""
    fingerprint: dict = dataclasses.field(default_factory=dict)  # what decides its bytes (h3gen.run.fingerprint)
    prompt_embeds: Any = None  # (1, tokens, width) text states; on the host between the encode and the sampler
    text_token_tags: Any = None
    conditions: Any = None  # fl2va / ref2va: the prepared media and their latents (h3gen.models.conditions)
    encode_cached: bool = False  # the embeddings came from the embedding cache
    video_latents: Any = None  # (1, 24, latent frames, H/16, W/16) on the device
    audio_latents: Any = None  # (2, 32, audio latents) on the device
    noise: Any = None  # the sampler's seeded draws, started ahead of its run on a host thread (a Future)
    forwards: int = 0  # DiT forwards the sampler ran
    forwards_reused: int = 0  # of those, the ones whose middle blocks a step cache skipped
    attention: str = ""  # the attention backend the DiT ran on
    frames: Any = None  # uint8 (T, H, W, 3) on the host
    audio: Any = None  # float32 (2, N) on the host
    sample_rate: int = 0  # the audio's samples per second
    arriving: Any = None  # frames and audio as the decode hands them to a mux started with it (h3gen.run.arriving)
    peak_gib: float | None = None  # the device's peak memory while the clip rendered (None on the CPU)
    sha256: str = ""  # the MP4's bytes as its mux wrote them, hashed on the thread that muxed it
    tags: dict[str, str] = dataclasses.field(default_factory=dict)  # MP4 tags for the mux to write ("title")
    seconds: dict[str, float] = dataclasses.field(default_factory=dict)

    def drop_tensors(self, keep_media: bool = False) -> None:
        """Let go of what the stages made, so the next clip starts from the same memory."""
        self.prompt_embeds = self.text_token_tags = self.video_latents = self.audio_latents = self.noise = None
        if not keep_media:
            self.frames = self.audio = self.arriving = None


def media_problem(request: Request, frames, audio, sample_rate) -> str:
    """What is wrong with a decode's `frames`, `audio` and `sample_rate` for the clip `request` asks for, said after
    "a clip whose" ('' for nothing): the frames uint8 (T, H, W, 3) at the request's frame count and size, the
    soundtrack float (2, N) as long as the frames within a tenth of a second, as `h3gen validate` takes a clip."""
    import numpy as np

    from h3gen.inputs.request import AUDIO_CHANNELS, FPS

    wanted = (request.frames, request.height, request.width, 3)
    if not isinstance(frames, np.ndarray) or frames.dtype != np.uint8 or frames.shape != wanted:
        return f"frames are {described(frames)}, not uint8 {wanted}"
    if not (isinstance(audio, np.ndarray) and np.issubdtype(audio.dtype, np.floating) and audio.ndim == 2
            and audio.shape[0] == AUDIO_CHANNELS):
        return f"audio is {described(audio)}, not float ({AUDIO_CHANNELS}, N)"
    if not np.isfinite(audio).all():
        return "audio holds NaN or infinite values"
    if isinstance(sample_rate, bool) or not isinstance(sample_rate, int) or sample_rate <= 0:
        return f"sample_rate is {sample_rate!r}, not samples a second"
    seconds, video = audio.shape[1] / sample_rate, request.frames / FPS
    if abs(seconds - video) > 0.1:
        return f"audio lasts {seconds:.3f} s at {sample_rate} Hz, the frames {video:.3f} s"
    return ""


def described(value) -> str:
    shape = getattr(value, "shape", None)
    return f"{value.dtype} {tuple(shape)}" if shape is not None and hasattr(value, "dtype") else type(value).__name__

