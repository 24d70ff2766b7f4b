"""A clip's decode beside the next clip's DiT forwards (`runtime.overlap_decode`).

On one device a batch decodes each clip after its forwards, and the next clip's forwards wait for that decode. With
the overlap, the decode runs on a host thread of its own, on a CUDA stream of its own, while the render thread takes
the next clip through the sampler, so the device can fill with one what the other leaves idle. Every kernel sees the
same inputs either way: the clip is the same, only when it is done differs. One decode runs at a time, in the order
of the clips; the render thread records each one's result (`Renderer.land_decoded`) once it has ended.
"""

from __future__ import annotations

import collections
from concurrent.futures import ThreadPoolExecutor

from h3gen.stages.clip import FLOW


def why_not(preset, memory_plan) -> str:
    """Why a run on one device that asks for the overlap decodes after the forwards all the same ('' when it
    overlaps): a memory plan that streams weights leaves no room for a decode beside them, and torch.compile
    (`compile` of the sampler or the vae) is not made to compile on two threads at once."""
    if memory_plan is not None and (memory_plan.streamed or memory_plan.stream_encoder):
        return "the memory plan streams weights, and leaves no room for a decode beside the forwards"
    sampler, vae = preset.stages["sampler"][1], preset.stages["vae"][1]
    compiled = [key for key, config in (("sampler.compile", sampler), ("vae.compile", vae))
                if getattr(config, "compile", False) and getattr(config, "dit", "h3gen") == "h3gen"]
    if compiled:  # a sampler's compile applies to h3gen's DiT only
        return f"torch.compile ({', '.join(compiled)}) compiles on one thread at a time"
    return ""


class DecodeBeside:
    def __init__(self, device: str):
        import torch

        self.device = device
        self.stream = torch.cuda.Stream(device) if device.startswith("cuda") else None
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="h3gen-decode")
        self.in_flight = collections.deque()  # (clip, claim, future, before, refused), in the clips' order

    def submit(self, decode, clip, claim, before, refused: int) -> None:
        """`decode(clip, before)` on the decode thread, once the work queued so far on the render thread's stream
        (the clip's latents) is done; the tensors the vae reads are kept from the render stream's reuse until the
        decode stream is through with them. The decode's (clip, job), or its error, waits in `in_flight` with the
        clip, its claim, the file's state before and the allocator's refusals so far (`Renderer.land_decoded`)."""
        import torch

        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream())
            vae = next(step for step in FLOW if step.kind == "vae")
            for name in vae.reads:
                value = getattr(clip, name)
                if isinstance(value, torch.Tensor) and value.is_cuda:
                    value.record_stream(self.stream)
        future = self.pool.submit(self.run, decode, clip, before)
        self.in_flight.append((clip, claim, future, before, refused))

    def run(self, decode, clip, before):
        if self.stream is None:
            return decode(clip, before)
        import torch

        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            return decode(clip, before)

    def first_ended(self, wait: bool) -> bool:
        """Whether the first decode in flight has ended; with `wait`, once it has (False only when none is in
        flight). A signal while it waits leaves it in flight, for `Renderer.close`."""
        if not self.in_flight:
            return False
        future = self.in_flight[0][2]
        if wait:
            future.exception()
        return future.done()

    def close(self) -> None:
        """Every decode in flight ends (none can be stopped halfway), and the thread with them."""
        self.pool.shutdown(wait=True)
