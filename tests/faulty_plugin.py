"""A plugin that injects faults, installed into a test's own site folder as `pip install` would (faulty.install):
a sampler that runs out of GPU memory, a mux and a decoder that take their time where a test wants to signal."""

import dataclasses
import time
from pathlib import Path

import numpy as np

from h3gen.plugins.hookspecs import hookimpl
from h3gen.stages.vae import FastVAE, FastVAEConfig
from h3gen.stages.mux import PyAVMux, PyAVMuxConfig
from h3gen.stages.sampler import EulerConfig, EulerSampler


@dataclasses.dataclass
class OomConfig(EulerConfig):
    fail_ids: list[str] = dataclasses.field(default_factory=list)


class OomSampler(EulerSampler):
    """Runs out of GPU memory on the clips named in fail_ids, after allocating, as a real one would."""
    kind, name = "sampler", "oom"
    Config = OomConfig

    def run(self, clip):
        import torch

        if clip.request.id in self.config.fail_ids:
            clip.video_latents = torch.zeros(1 << 20)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 80.00 GiB")
        return super().run(clip)


class SlowFrames(np.ndarray):
    """Frames the muxer receives one by one, slowly after the first half: by then the encoder has written
    packets (x264 holds its first 40 frames back), and the marker says so."""

    def __iter__(self):
        for index in range(len(self)):
            if index >= len(self) // 2:
                Path(self.marker).touch()
                time.sleep(self.delay)
            yield np.asarray(self[index])


@dataclasses.dataclass
class SlowConfig(PyAVMuxConfig):
    slow_id: str = ""
    delay: float = 0.2
    marker: str = ""
    in_place: bool = False  # the slow clip's first bytes written at its final name, as a careless plugin might


class SlowMux(PyAVMux):
    kind, name = "mux", "slow"
    Config = SlowConfig
    output_neutral = ("slow_id", "delay", "marker", "in_place")  # never different: a rerun without them skips

    def run(self, clip):
        if clip.request.id == self.config.slow_id:
            if self.config.in_place:
                clip.path.write_bytes(b"\0\0\0\x18ftypisom\0\0\0\0isomiso2" + bytes(88))
            clip.frames = clip.frames.view(SlowFrames)
            clip.frames.delay, clip.frames.marker = self.config.delay, self.config.marker
        return super().run(clip)


@dataclasses.dataclass
class SlowDecodeConfig(FastVAEConfig):
    slow_id: str = ""
    marker: str = ""


class SlowDecodeVAE(FastVAE):
    """Hands the first chunk of the slow clip's frames to the mux, says so with the marker, then takes its time."""
    kind, name = "vae", "slow-decode"
    Config = SlowDecodeConfig
    output_neutral = ("slow_id", "marker")

    def decode(self, latents, emit):
        def emit_slowly(video):
            emit(video)
            if self.slow:
                Path(self.config.marker).touch()
                # A minute in short sleeps, as a real decode returns to Python between tile batches: a signal that
                # lands after the marker but before one long sleep begins would otherwise wait the whole minute.
                for _ in range(600):
                    time.sleep(0.1)
        return super().decode(latents, emit_slowly if emit is not None else None)

    def run(self, clip):
        self.slow = clip.request.id == self.config.slow_id
        return super().run(clip)


@hookimpl
def h3gen_register_stages(register):
    register(OomSampler)
    register(SlowMux)
    register(SlowDecodeVAE)
