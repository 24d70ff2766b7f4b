"""The row-wise FP8 GEMMs of the DiT and the video decoder: cuBLAS's kernel (`torch._scaled_mm`, what h3gen runs)
against the fastest Triton kernel inductor's autotuning finds for the same product (`max-autotune`, Triton
templates only, the persistent TMA template included), each shape alone and its difference from cuBLAS's product.

Usage: python3 bench/fp8_gemm_triton.py [dit|vae ...]   (a Hopper GPU; writes $OUT/fp8_gemm_triton.json)
"""
import json
import os
import sys
import time
from pathlib import Path

import torch

from fp8_gemm_tuning import seconds  # bench/ is on sys.path when this script runs

OUT = Path(os.environ.get("OUT", "."))
FP8 = torch.float8_e4m3fn
# (model, name, rows, in, out, bias): the DiT's projections at the 10 s clip (the feed-forward in 16k-row passes),
# the decoder's over a forward of 16 tiles of 1,797 tokens.
SHAPES = [("dit", "qkv", 73642, 5376, 21504, False), ("dit", "out", 73642, 7168, 5376, False),
          ("dit", "up_gate", 16384, 5376, 28672, False), ("dit", "down", 16384, 14336, 5376, False),
          ("vae", "qkv", 28752, 2048, 6144, True), ("vae", "out", 28752, 2048, 2048, True),
          ("vae", "up_gate", 28752, 2048, 16384, True), ("vae", "down", 28752, 8192, 2048, True)]


def operands(rows, k, n, bias):
    g = torch.Generator("cuda").manual_seed(0)
    a = torch.randn(rows, k, device="cuda", generator=g).to(FP8)
    b = torch.randn(n, k, device="cuda", generator=g).to(FP8).t()
    add = torch.randn(n, device="cuda", generator=g).to(torch.bfloat16) if bias else None
    return a, b, torch.rand(rows, 1, device="cuda") + 0.5, torch.rand(1, n, device="cuda") + 0.5, add


def gemm(a, b, sa, sb, add):
    return torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, bias=add, out_dtype=torch.bfloat16, use_fast_accum=True)


def main():
    import torch._inductor.config as inductor

    inductor.max_autotune = True
    inductor.max_autotune_gemm_backends = "TRITON"
    inductor.triton.enable_persistent_tma_matmul = True
    models = sys.argv[1:] or ["dit", "vae"]
    results = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "shapes": {}}
    for model, name, rows, k, n, bias in SHAPES:
        if model not in models:
            continue
        ops = operands(rows, k, n, bias)
        expected = gemm(*ops)
        triton_gemm = torch.compile(gemm, dynamic=False)
        start = time.perf_counter()
        try:
            got = triton_gemm(*ops)
        except Exception as exc:  # no Triton template takes this product
            results["shapes"][f"{model} {name}"] = {"error": repr(exc)[:300]}
            print(model, name, repr(exc)[:300], flush=True)
            torch._dynamo.reset()
            continue
        compile_s = time.perf_counter() - start
        flop = 2 * rows * k * n
        cublas, triton = seconds(lambda: gemm(*ops), 20), seconds(lambda: triton_gemm(*ops), 20)
        cublas_again = seconds(lambda: gemm(*ops), 20)
        row = dict(cublas_ms=round(cublas * 1e3, 3), cublas_again_ms=round(cublas_again * 1e3, 3),
                   triton_ms=round(triton * 1e3, 3), cublas_tflops=round(flop / cublas / 1e12),
                   triton_tflops=round(flop / triton / 1e12), compile_s=round(compile_s, 1),
                   max_rel_diff=float((got.float() - expected.float()).abs().max() / expected.float().abs().max()))
        results["shapes"][f"{model} {name}"] = row
        print(model, name, json.dumps(row), flush=True)
        torch._dynamo.reset()
        OUT.mkdir(parents=True, exist_ok=True)  # after every shape: autotuning one takes minutes
        (OUT / "fp8_gemm_triton.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
