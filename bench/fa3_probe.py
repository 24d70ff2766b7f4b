"""Which shapes FlashAttention-3's forward (PyPI `fa3-fwd`) takes on this GPU, and how to scale its FP8 inputs.

Needs only torch and `fa3_fwd_interface`. Usage: python3 bench/fa3_probe.py [shapes,scales,time,decoder]
  shapes: bf16 and e4m3 (per-head descales) at Ulysses' head splits (56/28/14/7 x 128), the video decoder's
          32 x 64 heads, odd lengths, strided q/k/v views of one projection: accepted or refused (with the
          message), and the error of the accepted ones against fp32 attention.
  scales: FP8 error against fp32 attention per scale scheme (per tensor, per head, per head with the key's mean
          over the sequence taken out, which leaves the softmax unchanged), on three input distributions.
  time:   L = 73,642, 56 x 128: fa3 bf16, fa3 e4m3, SDPA cuDNN, and the per-head quantization pass.
  decoder: the same at the video decoder's forward of 16 tiles: 16 x 1,797 rows (7 latent frames of 16 x 16, 4
          registers and one pad row), 32 x 64.
Results: $OUT/fa3_probe.json, written as it goes.
"""
import json
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

OUT = os.environ.get("OUT", ".")
PHASES = sys.argv[1].split(",") if len(sys.argv) > 1 else ["shapes", "scales", "time"]
FP8, FP8_MAX = torch.float8_e4m3fn, 448.0
results = {}


def log(key, value):
    results[key] = value
    print(f"[{time.strftime('%H:%M:%S')}] {key}: {json.dumps(value)}", flush=True)
    with open(os.path.join(OUT, "fa3_probe.json"), "w") as f:
        json.dump(results, f, indent=1)


def reference(q, k, v, heads=None):
    """fp32 attention of the first `heads` heads (B, L, H, D), memory-efficient SDPA (no L x L matrix)."""
    sl = slice(None, heads)
    q, k, v = (t[:, :, sl].float().transpose(1, 2) for t in (q, k, v))
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
        return F.scaled_dot_product_attention(q, k, v).transpose(1, 2)


def rel_err(out, ref, heads=None):
    out = out[:, :, slice(None, heads)].float()
    return ((out - ref).norm() / ref.norm()).item()


def quantize(x, per_head=True):
    """(B, L, H, D) -> e4m3 tensor and its fp32 descale of shape (B, H)."""
    dims = (1, 3) if per_head else (1, 2, 3)
    amax = x.abs().amax(dim=dims, keepdim=True).float().clamp(min=1e-12)
    x8 = (x.float() * (FP8_MAX / amax)).to(FP8)
    descale = (amax / FP8_MAX).expand(x.shape[0], 1, x.shape[2], 1).reshape(x.shape[0], x.shape[2])
    return x8, descale.contiguous()


def fa3_fp8(fa3, q, k, v, per_head=True, smooth_k=False):
    if smooth_k:  # q . mean(k) is the same for every key of a row: the softmax does not see it
        k = k - k.float().mean(dim=1, keepdim=True).to(k.dtype)
    (q8, qd), (k8, kd), (v8, vd) = (quantize(t, per_head) for t in (q, k, v))
    return fa3(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd)


def draw(batch, length, heads, dim, kind="gauss", device="cuda"):
    """q, k, v bf16 (B, L, H, D). gauss: N(0, 1) (logits ~N(0, 1) at 1/sqrt(D)); x2: twice that; spread: heads of
    magnitude 0.25..4, a few large key channels and a key offset shared by all rows, as normed + rotated keys have."""
    q, k, v = (torch.randn(batch, length, heads, dim, device=device) for _ in range(3))
    if kind == "x2":
        q, k = q * 2 ** 0.5, k * 2 ** 0.5
    if kind == "spread":
        head_scale = torch.logspace(-1, 1, heads, base=4, device=device)[None, None, :, None]
        q, k, v = q * head_scale.sqrt(), k * head_scale.sqrt(), v * head_scale
        k[..., :4] = k[..., :4] * 4 + 3
    return tuple(t.to(torch.bfloat16) for t in (q, k, v))


def shapes(fa3):
    cases = [(1, 73642, h, 128) for h in (56, 28, 14, 7)] + [(1, 1797, 56, 128), (1, 73, 56, 128), (1, 1, 56, 128),
                                                            (2, 1797, 28, 128), (4, 4096, 32, 64), (1, 1797, 32, 64),
                                                            (1, 73, 32, 64)]
    for batch, length, heads, dim in cases:
        q, k, v = draw(batch, length, heads, dim)
        ref = reference(q, k, v, heads=min(heads, 4))
        for dtype in ("bf16", "e4m3"):
            key = f"shape {dtype} B{batch} L{length} H{heads} D{dim}"
            try:
                out = fa3(q, k, v) if dtype == "bf16" else fa3_fp8(fa3, q, k, v)
                torch.cuda.synchronize()
                log(key, {"ok": True, "rel_err": rel_err(out, ref, min(heads, 4)), "dtype": str(out.dtype)})
            except Exception as error:  # the refusal is the finding
                log(key, {"ok": False, "error": str(error).splitlines()[0][:300]})
        del q, k, v, ref
    # q, k, v as views of one (B, L, 3 * inner) projection, as the DiT hands them over; and v from its own plane.
    qkv = torch.randn(1, 1797, 3 * 56 * 128, device="cuda", dtype=torch.bfloat16)
    q, k, v = (t.unflatten(-1, (56, 128)) for t in qkv.chunk(3, dim=-1))
    ref = reference(q, k, v, heads=4)
    for dtype in ("bf16", "e4m3"):
        try:
            if dtype == "bf16":
                out = fa3(q, k, v)
            else:
                (q8, qd), (k8, kd), (v8, vd) = (quantize(t) for t in (q, k, v))
                both = torch.empty(1, 1797, 2, 56, 128, device="cuda", dtype=FP8)  # q8, k8 interleaved per row
                both[:, :, 0], both[:, :, 1] = q8, k8
                out = fa3(both[:, :, 0], both[:, :, 1], v8, q_descale=qd, k_descale=kd, v_descale=vd)
            torch.cuda.synchronize()
            log(f"strided views {dtype}", {"ok": True, "rel_err": rel_err(out, ref, 4)})
        except Exception as error:
            log(f"strided views {dtype}", {"ok": False, "error": str(error).splitlines()[0][:300]})


def scales(fa3):
    for length in (16384, 73642):
        for kind in ("gauss", "x2", "spread"):
            q, k, v = draw(1, length, 56, 128, kind)
            heads = 56 if length <= 16384 else 8
            ref = reference(q, k, v, heads=heads)
            row = {"bf16": rel_err(fa3(q, k, v), ref, heads)}
            for name, kwargs in (("per_tensor", dict(per_head=False)), ("per_head", {}),
                                 ("per_head_smooth_k", dict(smooth_k=True))):
                row[name] = rel_err(fa3_fp8(fa3, q, k, v, **kwargs), ref, heads)
            log(f"scales L{length} {kind}", row)
            del q, k, v, ref


def median_ms(fn, warmup=3, reps=10):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def timing(fa3, batch=1, length=73642, heads=56, dim=128, label=""):
    flop = 4 * batch * length * length * heads * dim
    q, k, v = draw(batch, length, heads, dim)
    (q8, qd), (k8, kd), (v8, vd) = (quantize(t) for t in (q, k, v))
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))

    def cudnn():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return F.scaled_dot_product_attention(qt, kt, vt)

    variants = {"fa3 bf16": lambda: fa3(q, k, v),
                "fa3 e4m3 (inputs quantized)": lambda: fa3(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd),
                "sdpa cudnn bf16": cudnn}
    for name, fn in variants.items():
        ms = median_ms(fn)
        log(f"time{label} {name}", {"ms": round(ms, 2), "tflops": round(flop / ms / 1e9, 1)})
    ms = median_ms(lambda: quantize(q))
    log(f"time{label} per-head quantize of one {tuple(q.shape)} tensor (torch)",
        {"ms": round(ms, 3), "gbps": round(q.numel() * 3 / ms / 1e6, 1)})


def decoder(fa3):
    timing(fa3, batch=16, length=7 * 16 * 16 + 4 + 1, heads=32, dim=64, label=" decoder")


def main():
    import fa3_fwd_interface
    fa3 = fa3_fwd_interface.flash_attn_func
    log("device", {"name": torch.cuda.get_device_name(), "torch": torch.__version__})
    for phase, fn in (("shapes", shapes), ("scales", scales), ("time", timing), ("decoder", decoder)):
        if phase in PHASES:
            fn(fa3)


if __name__ == "__main__":
    main()
