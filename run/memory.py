"""GPU memory: an estimate of a clip's peak before the run, and giving memory back between clips.

The estimate is deliberately simple: the weights already resident plus the larger of the DiT's activations (linear
in packed rows) and the video decode's (linear in output pixels). The coefficients come from measurements of the
released model's architecture on an H200 (diffusers' full-size classes, random weights): 62.4 GiB of DiT
weights and a 74.8 GiB peak for one forward over 73,642 packed rows; 8.4 GiB peak for the VAE decode of 243 frames
at 1344x768.
"""

from __future__ import annotations

import dataclasses
import gc

from h3gen.inputs.request import AUDIO_CHANNELS, Request

GIB = 2**30
TEXT_ROWS = 256  # prompts are tokenized only after the weights load; text rows are a small share anyway
# Bytes per packed row at the DiT peak, in units of ffn_dim activation values: (74.8 - 62.4) GiB at 73,642 rows
# and ffn_dim 14,336 in bf16 is 6.3 values of ffn width live per row (gate, up, their product, the residuals).
DIT_VALUES_PER_ROW_PER_FFN = 6.3
# h3gen's DiT, measured the same way on an H200 (bench/results/2026-12-02T011926Z.json, 012158Z.json): 47.3 GiB at
# peak over 39.2 GiB of weights and tables in bf16 is 4.1; with the feed-forward in 16k-row passes
# (ffn_chunk_rows), 26.7 over 20.6 GiB is 3.1.
FAST_DIT_VALUES_PER_ROW_PER_FFN, CHUNKED_FFN_VALUES_PER_ROW_PER_FFN = 4.1, 3.1
VAE_BYTES_PER_PIXEL = 36  # 8.4 GiB / (243 * 1344 * 768)
# A run on the CPU: the decode's whole-clip buffers lead (the frames in float, the tiles before they are blended,
# the uint8 frames the mux reads). Measured on the tiny model in fp32 through the reference decode, as the peak
# resident memory above a 32x32 clip's run: 1.55 GiB over 32.5 M pixels (512x512, 124 frames) and 2.84 GiB over
# 63.7 M pixels (243 frames), 51 and 48 bytes a pixel; half for 16-bit types. The libraries a render imports come
# first: that 32x32 run peaked at 0.99 GiB, weights and all.
HOST_VAE_BYTES_PER_PIXEL_FP32 = 52
HOST_LIBRARIES_BYTES = GIB


@dataclasses.dataclass(frozen=True)
class DiTShape:
    ffn_dim: int = 14336
    patch_size: tuple[int, int, int] = (1, 2, 2)

    @classmethod
    def from_dict(cls, config: dict) -> DiTShape:
        return cls(int(config.get("ffn_dim", cls.ffn_dim)), tuple(config.get("patch_size", cls.patch_size)))


def packed_rows(request: Request, shape: DiTShape, text_rows: int = TEXT_ROWS) -> int:
    """Rows of the one sequence the DiT attends over: text, audio (one per latent and channel), video patches."""
    _, _, frames, height, width = request.video_latent_shape
    pt, ph, pw = shape.patch_size
    video = (frames // pt) * (height // ph) * (width // pw)
    return text_rows + request.audio_latent_shape[-1] * AUDIO_CHANNELS + video


def dit_bytes(request: Request, shape: DiTShape, element_bytes: int,
              values_per_row: float = DIT_VALUES_PER_ROW_PER_FFN) -> float:
    """The DiT's activations at its peak for `request`."""
    return packed_rows(request, shape) * shape.ffn_dim * element_bytes * values_per_row


def peak_bytes(request: Request, shape: DiTShape, resident_bytes: int, element_bytes: int = 2,
               values_per_row: float = DIT_VALUES_PER_ROW_PER_FFN) -> int:
    dit = dit_bytes(request, shape, element_bytes, values_per_row)
    vae = request.frames * request.width * request.height * VAE_BYTES_PER_PIXEL
    return int(resident_bytes + max(dit, vae))


def host_peak_bytes(request: Request, shape: DiTShape, weights_bytes: int, element_bytes: int = 4) -> int:
    """A CPU process's peak for `request`: the libraries, the weights (`weights_bytes`, once loaded: 0 for what the
    process holds already) and the larger of the DiT's activations and the decode's buffers."""
    vae = request.frames * request.width * request.height * HOST_VAE_BYTES_PER_PIXEL_FP32 * element_bytes / 4
    return int(HOST_LIBRARIES_BYTES + weights_bytes + max(dit_bytes(request, shape, element_bytes), vae))


def fit_warning(requests: list[Request], shape: DiTShape, resident_bytes: int, available_bytes: int,
                element_bytes: int = 2, memory: str = "the GPU has {:.1f} GiB",
                fix: str = "try an FP8 preset, fewer frames or a smaller size", peak=peak_bytes) -> str | None:
    """A warning naming the largest clip when its estimated peak (`peak(request, shape, resident, element_bytes)`)
    exceeds what the device can give (`memory` says it of the GiB); None if all fit."""
    largest = max(requests, key=lambda r: peak(r, shape, resident_bytes, element_bytes))
    need = peak(largest, shape, resident_bytes, element_bytes)
    limit = resident_bytes + available_bytes
    if need <= limit:
        return None
    loaded = f" ({resident_bytes / GIB:.1f} GiB of weights loaded)" if resident_bytes else ""
    return (f"warning: the largest clip ({clip_named(largest)}) needs "
            f"about {need / GIB:.1f} GiB at peak{loaded}, {memory.format(limit / GIB)}: expect out of memory "
            f"({fix})")


def clip_named(request: Request) -> str:
    """A clip as memory errors name it: 'line 2, 1344x768, 241 frames'."""
    where = f"line {request.line}" if request.line else f"clip {request.index + 1}"
    return f"{where}, {request.width}x{request.height}, {request.frames} frames"


def host_fit_warning(requests: list[Request], transformer_config: dict, element_bytes: int) -> str | None:
    """`fit_warning` for a run on the CPU, weights already loaded: against the host memory free now."""
    from h3gen.run.budget import host_available_bytes

    def beyond_loaded(request, shape, resident, element):  # the libraries and weights are in memory already
        return host_peak_bytes(request, shape, resident, element) - HOST_LIBRARIES_BYTES

    return fit_warning(requests, DiTShape.from_dict(transformer_config), 0, host_available_bytes(), element_bytes,
                       "host memory has {:.1f} GiB free", "try fewer frames or a smaller size", beyond_loaded)


def cuda_index(device=None) -> int:
    """The CUDA device's index ("cuda" is the current device)."""
    import torch

    index = torch.device(device).index if device is not None else None
    return torch.cuda.current_device() if index is None else index


def free_on_device(device=None) -> int:
    """What the CUDA device has free for this process, whatever cap an earlier budget set on its allocator: the
    device's free memory plus what the allocator holds unused."""
    import torch

    device = cuda_index(device)
    free, _ = torch.cuda.mem_get_info(device)
    return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))


def free_bytes(device=None) -> int:
    """What this process may still allocate on the CUDA device: `free_on_device` within the per-process cap a
    memory budget sets (runtime.vram_gib)."""
    import torch

    device = cuda_index(device)
    total = torch.cuda.get_device_properties(device).total_memory
    fraction = torch.cuda.get_per_process_memory_fraction(device) if hasattr(
        torch.cuda, "get_per_process_memory_fraction") else 1.0
    return int(max(0, min(free_on_device(device), fraction * total - torch.cuda.memory_allocated(device))))


def cuda_fit_warning(requests: list[Request], transformer_config: dict, element_bytes: int) -> str | None:
    """`fit_warning` with what the current CUDA device reports, weights already loaded."""
    import torch

    return fit_warning(requests, DiTShape.from_dict(transformer_config), torch.cuda.memory_allocated(), free_bytes(),
                       element_bytes)


def refused_allocations(device: str) -> int:
    """How many allocations the CUDA caching allocator has refused on `device` so far (0 on the CPU). A kernel
    library that allocates through torch's stable ABI (fa3-fwd) reports out of memory only as a failed call; the
    allocator counts the refusal all the same."""
    if not str(device).startswith("cuda"):
        return 0
    import torch

    return torch.cuda.memory_stats(cuda_index(device)).get("num_ooms", 0)


def release(device: str) -> None:
    """Return what one clip allocated: drop unreachable tensors, then hand the allocator's cache back on CUDA. cuBLAS
    keeps a workspace per stream and handle in torch's allocator (32 MiB each on Hopper) from the first matrix
    product on: it goes too, and the next product allocates it again.

    The collection walks only what is not held by `settle`: the objects of the clip that just ended, not the half
    million the loaded libraries and weights are made of (a full collection of those takes 0.1-0.3 s, with the
    device idle)."""
    gc.collect()
    if str(device).startswith("cuda"):
        import torch

        clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear_workspaces is not None:
            torch.cuda.synchronize()
            clear_workspaces()
        torch.cuda.empty_cache()


def settle(device: str) -> None:
    """After stages load or unload: `release`, then hold everything still alive out of the collector's reach
    (`gc.freeze`) until the next `settle` or `let_go`. Whatever was unloaded is collected first, reference cycles
    included, since the objects held before are handed back to the collector for that collection."""
    gc.unfreeze()
    release(device)
    gc.freeze()


def exit_soon() -> None:
    """Before the process exits: hold every object still alive out of the collection the interpreter makes as it
    ends, a walk over the million objects torch and the model libraries are made of (0.6 s on a 2-core machine, at
    the end of every command and every worker) that frees nothing the exit would not."""
    gc.freeze()


def let_go(device: str) -> None:
    """The end of a render: every held object back to the collector, and the memory of what was unloaded back."""
    gc.unfreeze()
    release(device)
