"""Full (unmasked) self-attention over (B, L, heads, head_dim) tensors, on the fastest backend available."""
import functools

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

BACKENDS = ("flash-attn-4", "sdpa-cudnn", "sdpa-flash", "sdpa", "triton-fp8", "cudnn-fp8")
# FP8 attention trades accuracy for speed, so "auto" never picks it: a preset or --set asks for it by name.
FP8_BACKENDS = ("triton-fp8", "cudnn-fp8")
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


def attention_backend(device=None, requested="auto", dtype=None):
    """Name of the backend `attention` runs on `device` for `requested` ("auto" or one of BACKENDS) and inputs of
    `dtype` (None: the half-precision types the models run in)."""
    if requested != "auto":
        if requested not in BACKENDS:
            raise ValueError(f"unknown attention backend {requested!r}; choose 'auto' or one of {BACKENDS}")
        return requested
    device = torch.device(device if device is not None else "cpu")
    # flash-attn-4 and cuDNN take bf16 / fp16 only; fp32 (tests, CPU-exact runs) goes to SDPA's own choice.
    if device.type != "cuda" or dtype not in (None, torch.bfloat16, torch.float16):
        return "sdpa"
    major, _ = torch.cuda.get_device_capability(device)
    if major in (9, 10) and _flash_attn_4() is not None:
        return "flash-attn-4"
    # SDPA picks its FA2 kernel on Hopper by default; cuDNN's is about 1.6x faster there at H3's shapes.
    return "sdpa-cudnn" if major == 9 else "sdpa"


@torch.compiler.disable
def attention(q, k, v, backend="auto"):
    """`q`, `k`, `v` (B, L, heads, head_dim) -> (B, L, heads, head_dim), softmax scale 1/sqrt(head_dim)."""
    name = attention_backend(q.device, backend, q.dtype)
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
