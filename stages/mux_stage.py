"""Mux stage placeholder while the writer lands."""
import dataclasses
from h3gen.stages.base import Stage

@dataclasses.dataclass
class PyAVMuxConfig:
    crf: int = 18

class PyAVMux(Stage):
    kind, name = "mux", "pyav"
    Config = PyAVMuxConfig
    def run(self, clip):
        from h3gen.stages.mux import write_mp4
        write_mp4(clip.path, clip.frames, clip.audio, crf=self.config.crf)
        return clip
