"""One request from the prompts file, and the shapes H3 gives it: frames, latent frames, audio latents."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

FPS = 24
SAMPLE_RATE = 32000


MIN_SECONDS, MAX_SECONDS = 5.0, 15.0


def frames_for_duration(seconds: float) -> int:
    """The video VAE needs 17n+5 frames: the smallest such count lasting `seconds`, kept within H3's 5-15 s."""
    frames = 17 * math.ceil((seconds * FPS - 5) / 17) + 5
    if frames > MAX_SECONDS * FPS:
        frames -= 17
    return frames


AUDIO_LATENTS_PER_SECOND = 40
VIDEO_LATENT_CHANNELS, AUDIO_LATENT_CHANNELS, AUDIO_CHANNELS = 24, 32, 2


def latent_frames(frames: int) -> int:
    """17n+5 frames encode to 5n+2 latent frames."""
    return (frames - 5) // 17 * 5 + 2


def audio_latents(frames: int) -> int:
    return int(round(frames / FPS * AUDIO_LATENTS_PER_SECOND))


@dataclasses.dataclass(frozen=True)
class Reference:
    """One ref2va reference: its kind ('image', 'video' or 'audio', from what the file holds) and its path."""

    kind: str
    path: Path


@dataclasses.dataclass(frozen=True)
class Request:
    index: int
    prompt: str
    seed: int
    width: int
    height: int
    frames: int
    id: str | None = None
    line: int = 0
    first_frame: Path | None = None  # fl2va keyframes
    last_frame: Path | None = None
    references: tuple[Reference, ...] = ()  # ref2va, in the order the model reads them

    @property
    def task(self) -> str:
        """H3's task follows from the conditioning the request carries."""
        if self.references:
            return "ref2va"
        return "fl2va" if self.first_frame or self.last_frame else "t2va"

    @property
    def duration(self) -> float:
        return self.frames / FPS

    @property
    def video_latent_shape(self) -> tuple[int, ...]:
        return (1, VIDEO_LATENT_CHANNELS, latent_frames(self.frames), self.height // 16, self.width // 16)

    @property
    def audio_latent_shape(self) -> tuple[int, ...]:
        return (AUDIO_CHANNELS, AUDIO_LATENT_CHANNELS, audio_latents(self.frames))
