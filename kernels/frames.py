"""Decoded video to uint8 frames in one pass: denormalize, clamp, scale by 255, round, store as (T, H, W, RGB).
A NaN or an infinity would clamp to a valid level (a black or white pixel): the pass flags it instead, so a decoder
with damaged weights is refused rather than written as a black clip.

RGB, not YUV 4:2:0: swscale's rgb24 -> yuv420p costs 0.79 s per 10 s 1344x768 clip on a 2-core CPU, against 7.1 s
for the whole mux, and runs in the background mux, in slices over the encoder's thread count; doing it here would
have to match swscale's fixed-point coefficients and chroma filter bit for bit to keep the MP4 byte-identical.
"""
import torch
import triton
import triton.language as tl

from h3gen.kernels.rounding import NO_FMA

FLOAT32_MAX = tl.constexpr(torch.finfo(torch.float32).max)


def frames_reference(video, mean, std):
    """`video` (3, T, H, W) float in the VAE's normalized space; `mean`, `std` (3,) -> uint8 (T, H, W, 3)."""
    shape = (-1, 1, 1, 1)
    pixels = (video.float() * std.view(shape) + mean.view(shape)).clamp(0, 1)
    return (pixels * 255).round().to(torch.uint8).permute(1, 2, 3, 0).contiguous()


@triton.jit
def _frames_kernel(video_ptr, mean_ptr, std_ptr, out_ptr, nonfinite_ptr, total, height, width,
                   stride_c, stride_t, stride_h, stride_w, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < total
    channel = offsets % 3
    pixel = offsets // 3
    x = pixel % width
    y = (pixel // width) % height
    t = pixel // (width * height)
    source = video_ptr + channel * stride_c + t * stride_t + y * stride_h + x * stride_w
    value = tl.load(source, mask=mask, other=0.0).to(tl.float32)
    # Every program that meets a NaN or an infinity writes the same 1 to the flag.
    tl.store(nonfinite_ptr + offsets * 0, 1, mask=mask & ((value != value) | (tl.abs(value) > FLOAT32_MAX)))
    mean = tl.load(mean_ptr + channel, mask=mask, other=0.0)
    std = tl.load(std_ptr + channel, mask=mask, other=1.0)
    value = tl.minimum(tl.maximum(value * std + mean, 0.0), 1.0) * 255.0
    # Adding 2**23 to a value in [0, 2**23) leaves no fraction bits, so the add itself rounds to the nearest
    # integer, ties to even, as torch.round does; subtracting it again is exact.
    value = (value + 8388608.0) - 8388608.0
    tl.store(out_ptr + offsets, value.to(tl.uint8), mask=mask)


def frames_triton(video, mean, std, out=None, nonfinite=None, block=1024):
    """Same contract as `frames_reference`; `video` may be any strided view, `out` a uint8 (T, H, W, 3) buffer,
    `nonfinite` an int32 (1,) flag on the device set to 1 where `video` holds a NaN or an infinity."""
    channels, frames, height, width = video.shape
    assert channels == 3, video.shape
    if out is None:
        out = torch.empty((frames, height, width, 3), dtype=torch.uint8, device=video.device)
    assert out.is_contiguous() and out.shape == (frames, height, width, 3)
    total = out.numel()
    mean, std = mean.float().contiguous(), std.float().contiguous()
    if nonfinite is None:
        nonfinite = torch.zeros(1, dtype=torch.int32, device=video.device)
    _frames_kernel[(triton.cdiv(total, block),)](video, mean, std, out, nonfinite, total, height, width,
                                                  *video.stride(), BLOCK=block, num_warps=4, **NO_FMA)
    return out


def to_frames(video, mean, std, out=None, nonfinite=None):
    """uint8 frames on `video`'s device: the kernel on CUDA, the reference elsewhere; `nonfinite` as
    `frames_triton` takes it."""
    if video.is_cuda:
        return frames_triton(video, mean, std, out, nonfinite)
    if nonfinite is not None and not torch.isfinite(video).all():
        nonfinite.fill_(1)
    frames = frames_reference(video, mean, std)
    return frames if out is None else out.copy_(frames)
