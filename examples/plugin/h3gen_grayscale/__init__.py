"""A vae stage that wraps the decode a preset would use and turns its frames grayscale.

    pip install ./examples/plugin
    h3gen render prompts.txt -o out/ --preset grayscale                      # tiny, its reference decode wrapped
    h3gen render prompts.txt -o out/ --model DIR --preset h3-base --set vae.use=grayscale  # its fast decode wrapped
"""

import dataclasses
from importlib.resources import files

import numpy as np

from h3gen.plugins.hookspecs import hookimpl
from h3gen.stages.base import Wrapped
from h3gen.stages.vae import FrameFilter

# ITU-R BT.601 luma weights in 1/256ths: 77 + 150 + 29 = 256.
LUMA = np.array([77, 150, 29], dtype=np.uint32)


@dataclasses.dataclass
class GrayscaleConfig:
    mix: float = 1.0  # 1: all gray, 0: the colours as decoded
    wraps: Wrapped = dataclasses.field(default_factory=Wrapped)  # the decode it wraps: filled in by the preset


class Grayscale(FrameFilter):
    kind, name = "vae", "grayscale"
    Config = GrayscaleConfig
    description = "the wrapped decode's frames, turned grayscale"

    def change(self, frames):
        """uint8 (n, H, W, 3) host frames, rewritten in place."""
        luma = ((frames.astype(np.uint32) @ LUMA + 128) >> 8).astype(np.float32)[..., None]
        mix = self.config.mix
        frames[...] = np.clip(np.rint(luma * mix + frames * (1 - mix)), 0, 255).astype(np.uint8)


@hookimpl
def h3gen_register_stages(register):
    register(Grayscale)


@hookimpl
def h3gen_register_presets(register):
    register(files(__name__) / "grayscale.toml")
