"""Full (unmasked) self-attention over (B, L, heads, head_dim) tensors, on the fastest backend available."""
import dataclasses
import functools

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from h3gen.kernels.attention_names import BACKENDS

# "auto" on Hopper, fastest first, as measured at L = 73,642, 56 x 128 heads on an H200: FlashAttention-3 (fa3-fwd)
# 693 TFLOP/s and SDPA's cuDNN 560 (bench/results/2026-12-01T2134-fa3-probe.json), flash-attn-4 682 (README); SDPA's
# own default there is its FA2 kernel, 361.
HOPPER_ORDER = ("fa3", "flash-attn-4", "sdpa-cudnn")
# Backends that fall back when their package is missing or their kernel refuses the inputs, and to what: the bf16
# backend "auto" would pick instead, which is also what FP8 presets ran before fa3-fp8 existed.
FALLBACK = {"fa3": "auto", "fa3-fp8": "auto"}
_SDPA_FORCED = {"sdpa-cudnn": SDPBackend.CUDNN_ATTENTION, "sdpa-flash": SDPBackend.FLASH_ATTENTION}


# flash-attn-4's Hopper forward options (`tile_mn`: rows of Q and of K per step, `mma_pv_is_rs`,
# `intra_wg_overlap`); empty keeps the library's choice.
FLASH_ATTN_4_OPTIONS = {}


@functools.cache
def _flash_attn_4():
    try:
        from flash_attn.cute import flash_attn_func
        from flash_attn.cute.interface import _flash_attn_fwd
    except Exception:  # an optional dependency; a broken install counts as absent
        return None
    if not FLASH_ATTN_4_OPTIONS:
        return flash_attn_func
    return functools.partial(_flash_attn_fwd, **FLASH_ATTN_4_OPTIONS)


def optional(module: str, name: str = ""):
    """An optional dependency's module (or one name in it); None when it is missing or its install is broken."""
    import importlib

    try:
        found = importlib.import_module(module)
        return getattr(found, name) if name else found
    except Exception:  # a broken install counts as absent
        return None


@functools.cache
def _fa3():
    return optional("fa3_fwd_interface", "flash_attn_func")


@dataclasses.dataclass(frozen=True)
class Choice:
    """The backend that runs, and why it is not the one asked for (None when it is)."""

    name: str
    fallback_reason: str | None = None

    def describe(self) -> str:
        """The name, and the reason in brackets when this is not the backend asked for."""
        return self.name if self.fallback_reason is None else f"{self.name} ({self.fallback_reason})"


def fa3_refusal(device, dtype, head_dim) -> str | None:
    """Why FlashAttention-3's forward cannot take these inputs, or None. The fa3-fwd build has sm90 kernels for bf16
    and e4m3 only (no fp16, no fp32) and head dims up to 256; every head split, head dim and odd length the DiT
    and the video decoder use was accepted on an H200 (bench/results/2026-12-01T2134-fa3-probe.json)."""
    if _fa3() is None:
        return "fa3-fwd is not installed (pip install 'h3gen[fa3]')"
    device = torch.device(device if device is not None else "cpu")
    if device.type != "cuda":
        return f"FlashAttention-3 runs on CUDA only, not {device.type}"
    major, minor = torch.cuda.get_device_capability(device)
    if major != 9:
        return f"fa3-fwd has Hopper (sm90) kernels only; this GPU is sm{major}{minor}"
    if dtype not in (None, torch.bfloat16):
        return f"fa3-fwd takes bf16 inputs (quantized to e4m3 for fa3-fp8), not {dtype}"
    if head_dim is not None and (head_dim > 256 or head_dim % 8):
        return f"fa3-fwd takes head dims up to 256 in multiples of 8, not {head_dim}"
    return None


# Backends a preset names outright that run on CUDA only (SDPA's flash kernel has a CPU twin), that take half
# precision there (cudnn-fp8 quantizes any input), and the package each needs beyond torch: where one cannot run,
# the run is refused before any weight loads (Stage.check_device).
CUDA_ONLY = ("flash-attn-4", "sdpa-cudnn", "cudnn-fp8")
HALF_ON_CUDA = ("flash-attn-4", "sdpa-cudnn", "sdpa-flash")
PACKAGES = {"flash-attn-4": ("flash-attn-4", "pip install 'h3gen[hopper]'"),
            "cudnn-fp8": ("nvidia-cudnn-frontend", "pip install 'h3gen[fp8-attention]'")}


def refusal(device, requested, dtype=None) -> str | None:
    """Why `requested`, a backend named outright that does not fall back, cannot run on `device` with inputs of
    `dtype` (a torch dtype or its name; None: any); None when it can, or for "auto" and the backends that fall back
    (FALLBACK)."""
    device = torch.device(device if device is not None else "cpu")
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    if requested in CUDA_ONLY and device.type != "cuda":
        return f"it runs on CUDA GPUs only, and this run is on {device.type}"
    if requested in HALF_ON_CUDA and device.type == "cuda" and dtype not in (None, torch.bfloat16, torch.float16):
        return f"on a GPU it takes bf16 or fp16 inputs, and this run is in {str(dtype).removeprefix('torch.')}"
    from h3gen.kernels.attention_cudnn_fp8 import cudnn_module

    if requested == "flash-attn-4" and _flash_attn_4() is None or requested == "cudnn-fp8" and cudnn_module() is None:
        package, install = PACKAGES[requested]
        return f"{package} is not installed, and `{install}` installs it"
    return None


def check_runs(key: str, requested: str, device, dtype=None) -> None:
    """UsageError naming `key` when the backend it asks for cannot run here (`refusal`)."""
    why = refusal(device, requested, dtype)
    if why:
        from h3gen.errors import UsageError

        raise UsageError(f"{key} = {requested} cannot run here: {why}",
                         f"set {key} = auto, which picks the fastest backend this machine runs")


def choose_backend(device=None, requested="auto", dtype=None, head_dim=None) -> Choice:
    """The backend `attention` runs on `device` for `requested` ("auto" or one of BACKENDS), inputs of `dtype` (None:
    the half-precision types the models run in) and `head_dim` (None: any)."""
    if requested not in ("auto", *BACKENDS):
        raise ValueError(f"unknown attention backend {requested!r}; choose 'auto' or one of {BACKENDS}")
    if requested in FALLBACK:
        refusal = fa3_refusal(device, dtype, head_dim)
        if refusal is None:
            return Choice(requested)
        fallback = choose_backend(device, FALLBACK[requested], dtype, head_dim).name
        return Choice(fallback, f"{requested} not used, {fallback} instead: {refusal}")
    if requested != "auto":
        return Choice(requested)
    device = torch.device(device if device is not None else "cpu")
    # The fast kernels take bf16 / fp16 only; fp32 (tests, CPU-exact runs) goes to SDPA's own choice.
    if device.type != "cuda" or dtype not in (None, torch.bfloat16, torch.float16):
        return Choice("sdpa")
    major, _ = torch.cuda.get_device_capability(device)
    installed = {"fa3": fa3_refusal(device, dtype, head_dim) is None, "flash-attn-4": _flash_attn_4() is not None,
                 "sdpa-cudnn": True}
    if major == 9:
        return Choice(next(name for name in HOPPER_ORDER if installed[name]))
    return Choice("flash-attn-4" if major == 10 and installed["flash-attn-4"] else "sdpa")


def backend_name(device=None, requested="auto", dtype=None, head_dim=None):
    """Name of the backend `choose_backend` picks."""
    return choose_backend(device, requested, dtype, head_dim).name


@torch.compiler.disable
def attention(q, k, v, backend="auto"):
    """`q`, `k`, `v` (B, L, heads, head_dim) -> (B, L, heads, head_dim), softmax scale 1/sqrt(head_dim)."""
    name = backend_name(q.device, backend, q.dtype, q.shape[-1])
    if name == "fa3":
        return _fa3()(q, k, v)
    if name == "fa3-fp8":
        from h3gen.kernels.attention_fa3_fp8 import attention_fa3_fp8
        return attention_fa3_fp8(q, k, v)
    if name == "triton-fp8":
        from h3gen.kernels.attention_fp8 import attention_fp8
        return attention_fp8(q, k, v)
    if name == "cudnn-fp8":
        from h3gen.kernels.attention_cudnn_fp8 import attention_fp8_cudnn
        return attention_fp8_cudnn(q, k, v)
    if name == "flash-attn-4":
        out = _flash_attn_4()(q, k, v)
        return out[0] if isinstance(out, tuple) else out
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    if name in _SDPA_FORCED:
        with sdpa_kernel([_SDPA_FORCED[name]]):
            out = F.scaled_dot_product_attention(q, k, v)
    else:
        out = F.scaled_dot_product_attention(q, k, v)
    return out.transpose(1, 2)
