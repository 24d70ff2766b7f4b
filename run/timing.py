"""Per-stage timing: CUDA events on a GPU (what the device did), a monotonic clock on the CPU."""

from __future__ import annotations

import contextlib
import time


class StageTimer:
    def __init__(self, device: str, on_stage=None):
        self.cuda = str(device).startswith("cuda")
        self.on_stage = on_stage or (lambda clip, kind, seconds: None)

    @contextlib.contextmanager
    def measure(self, clip, kind: str, report: bool = True, host: bool = False):
        """Add the time of the block to `clip.seconds[kind]`; `report=False` for parts of a reported stage.

        `host=True` for work that never touches the device (muxing), which may run on another thread."""
        if self.cuda and not host:
            import torch

            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1e3
        else:
            began = time.perf_counter()
            yield
            seconds = time.perf_counter() - began
        clip.seconds[kind] = clip.seconds.get(kind, 0.0) + seconds
        if report:
            self.on_stage(clip, kind, seconds)
