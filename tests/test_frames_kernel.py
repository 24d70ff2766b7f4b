"""kernels/frames.py: the Triton kernel gives the same uint8 values as its torch reference, under Triton's interpreter."""
import os

import pytest
import torch

from conftest import run_parity_under_triton_interpreter

# As in test_kernels.py: Triton decides at import whether to interpret, so the parity cases run in a child pytest.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
parity = pytest.mark.skipif(not INTERPRETED, reason="runs in test_frames_kernel_under_interpreter's child process")

MEAN, STD = torch.tensor((0.485, 0.456, 0.406)), torch.tensor((0.229, 0.224, 0.225))


def test_frames_kernel_under_interpreter():
    if INTERPRETED:
        pytest.skip("this is the child process")
    run_parity_under_triton_interpreter(__file__)


def boundary_video(frames=3, height=5, width=7, dtype=torch.float32):
    """Normalized pixels that land near every rounding boundary k + 0.5 after denormalizing, plus clamped ones."""
    torch.manual_seed(0)
    levels = torch.randint(-20, 276, (3, frames, height, width)).float() + 0.5
    levels += torch.randn(levels.shape) * 1e-4  # within a few fp32 ulps of the tie, either side
    levels[:, 0, 0, :3] = torch.tensor([0.5, 1.5, 254.5])  # exact ties round to even
    video = (levels / 255 - MEAN.view(-1, 1, 1, 1)) / STD.view(-1, 1, 1, 1)
    return video.to(dtype)


@parity
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_parity_frames(dtype):
    from h3gen.kernels import frames as k

    assert type(k._frames_kernel).__name__ == "InterpretedFunction"
    video = boundary_video(dtype=dtype)
    expected = k.frames_reference(video, MEAN, STD)
    assert expected.dtype == torch.uint8 and expected.shape == (3, 5, 7, 3)
    assert torch.equal(k.frames_triton(video, MEAN, STD, block=64), expected)


@parity
def test_parity_frames_strided_into_buffer():
    """A slice of a larger decoded chunk (what the decode hands over) written into a preallocated buffer."""
    from h3gen.kernels import frames as k

    video = boundary_video(frames=6, height=6, width=9)[:, 1:5, 1:, 2:]
    out = torch.zeros((4, 5, 7, 3), dtype=torch.uint8)
    k.frames_triton(video, MEAN, STD, out=out, block=128)
    assert torch.equal(out, k.frames_reference(video, MEAN, STD))


@parity
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf"), None])
def test_parity_frames_flags_what_is_not_finite(value):
    """A NaN or an infinity anywhere sets the flag (in the kernel and the CPU path alike), every other pixel as the
    reference makes it; finite values leave it 0."""
    from h3gen.kernels import frames as k

    video = boundary_video(frames=4, height=6, width=9)
    if value is not None:
        video[2, 3, 5, 8] = value
    expected = k.frames_reference(video, MEAN, STD)
    for convert in (lambda flag: k.frames_triton(video, MEAN, STD, nonfinite=flag, block=64),
                    lambda flag: k.to_frames(video, MEAN, STD, nonfinite=flag)):
        flag = torch.zeros(1, dtype=torch.int32)
        frames = convert(flag)
        frames[3, 5, 8, 2] = expected[3, 5, 8, 2]  # a NaN's pixel is whatever the conversion makes of it
        assert torch.equal(frames, expected)
        assert flag.item() == (value is not None)


def test_reference_is_the_reference_stage_conversion():
    """The reference is the conversion stages/vae.py has always applied, ties and clamping included."""
    from h3gen.kernels.frames import frames_reference, to_frames

    video = boundary_video()
    pixels = (video[None].float() * STD.view(1, -1, 1, 1, 1) + MEAN.view(1, -1, 1, 1, 1)).clamp(0, 1)
    expected = (pixels[0] * 255).round().to(torch.uint8).permute(1, 2, 3, 0)
    assert torch.equal(frames_reference(video, MEAN, STD), expected)
    assert torch.equal(to_frames(video, MEAN, STD), expected)
