"""Decoded frames on their way to host memory: uint8 on the device, copied chunk by chunk on a side stream."""

from __future__ import annotations

# The video VAE works in ImageNet-normalized pixels.
PIXEL_MEAN, PIXEL_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def copy_landed(device):
    """A call that returns once the work queued so far on the current stream (a copy to host memory) is done; it sets
    `device` on the thread that waits, which would otherwise open a context on the first GPU."""
    import torch

    event = torch.cuda.Event()
    event.record()

    def wait():
        with torch.cuda.device(device):
            event.synchronize()
    return wait


class HostFrames:
    """uint8 (T, H, W, 3) frames in host memory, filled chunk by chunk as the decode finishes them.

    On CUDA each chunk becomes uint8 on the device (one Triton pass) and is copied on a side stream into pinned
    memory, so the copy overlaps the next tiles' decode; on the CPU the frames are written in place. With `media`
    (`h3gen.run.arriving`), each chunk is announced to the mux as written, with a wait for its copy."""

    def __init__(self, plan, device, media=None):
        import torch

        self.cuda = device.type == "cuda"
        height = plan.row_starts[-1] + plan.tile_height
        width = plan.col_starts[-1] + plan.tile_width
        self.frames = torch.empty((plan.frames, height, width, 3), dtype=torch.uint8, pin_memory=self.cuda)
        self.mean = torch.tensor(PIXEL_MEAN, device=device)
        self.std = torch.tensor(PIXEL_STD, device=device)
        self.copies = torch.cuda.Stream(device) if self.cuda else None
        self.written, self.media = 0, media
        self.nonfinite = torch.zeros(1, dtype=torch.int32, device=device)  # set where a frame held NaN or infinity

    def write(self, video) -> None:
        """`video` (3, n, H, W): the clip's next n frames, in the VAE's normalized pixel space."""
        import torch

        from h3gen.kernels.frames import to_frames

        target = self.frames[self.written:self.written + video.shape[1]]
        self.written += video.shape[1]
        copied = None
        if not self.cuda:
            to_frames(video, self.mean, self.std, out=target, nonfinite=self.nonfinite)
        else:
            staged = to_frames(video, self.mean, self.std, nonfinite=self.nonfinite)
            self.copies.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.copies):
                target.copy_(staged, non_blocking=True)
                if self.media is not None:
                    copied = copy_landed(staged.device)
            staged.record_stream(self.copies)
        if self.media is not None:
            self.media.landed(self.written, copied)

    def finite(self) -> bool:
        """Whether every frame written so far was decoded to finite values (on CUDA it waits for their kernels)."""
        return not self.nonfinite.item()

    def wait(self):
        """The frames as a numpy array, once every copy has landed."""
        import torch

        assert self.written == self.frames.shape[0], (self.written, self.frames.shape)
        if self.cuda:
            # The current stream waits too, so the stage timer's events span the copies.
            torch.cuda.current_stream().wait_stream(self.copies)
            self.copies.synchronize()
        return self.frames.numpy()
