"""Every algorithm cuBLASLt offers for the FP8 GEMMs of the DiT and the video decoder, timed against the one
`torch._scaled_mm` runs (cuBLASLt's first pick).

torch asks cuBLASLt's heuristic for one algorithm and runs it; TunableOp does not tune row-wise `_scaled_mm` on
torch 2.11. This asks the same heuristic for up to `--count` algorithms for the same problem (e4m3 operands, one
fp32 scale per row of the activations and per output channel of the weight, bf16 output, fast accumulation) and
times each, in rounds taking turns, through the library torch itself loaded. Each algorithm's output is checked
against `_scaled_mm`'s, and its kernel's name read from a CUDA profile.

    python3 bench/cublaslt_algos.py [--count 16] [--rounds 2]   # a Hopper GPU; writes $OUT/cublaslt_algos.json
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
from pathlib import Path

import torch

from h3gen.bench.fp8_gemm_tuning import seconds

FP8 = torch.float8_e4m3fn
# (name, rows, in, out) as the FP8 presets run them: the DiT's projections over the whole sequence and its
# feed-forward over 16k-row passes; the video decoder's over a batch of 16 tiles of 1,797 tokens.
SHAPES = [("dit qkv", 73642, 5376, 21504), ("dit out", 73642, 7168, 5376), ("dit up_gate", 16384, 5376, 28672),
          ("dit down", 16384, 14336, 5376), ("decoder qkv", 28752, 2048, 6144), ("decoder out", 28752, 2048, 2048),
          ("decoder up_gate", 28752, 2048, 16384), ("decoder down", 28752, 8192, 2048)]

# cublasLt.h (CUDA 12.9 and 13): attribute and enum values.
COMPUTE_32F, R_32F, R_16BF, R_8F_E4M3 = 68, 0, 14, 28
DESC_TRANSA, DESC_TRANSB, DESC_A_SCALE_POINTER, DESC_B_SCALE_POINTER = 3, 4, 17, 18
DESC_FAST_ACCUM, DESC_A_SCALE_MODE, DESC_B_SCALE_MODE = 25, 31, 32
SCALE_OUTER_VEC_32F, OP_N, OP_T = 3, 0, 1
PREF_MAX_WORKSPACE_BYTES = 1
WORKSPACE = 32 << 20


class HeuristicResult(ctypes.Structure):
    _fields_ = [("algo", ctypes.c_uint64 * 8), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


def library():
    """The cuBLASLt torch loaded (by its soname once torch has run an FP8 GEMM), else the one in its wheels."""
    import glob
    import sys

    x = torch.zeros(16, 16, device="cuda").to(FP8)
    one = torch.tensor(1.0, device="cuda")
    torch._scaled_mm(x, x.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    names = ["libcublasLt.so.13", "libcublasLt.so.12"]
    for folder in sys.path:
        for pattern in ("nvidia/cu*/lib/libcublasLt.so*", "nvidia/cublas/lib/libcublasLt.so*"):
            names += sorted(glob.glob(os.path.join(folder, pattern)))
    for name in names:
        try:
            return ctypes.CDLL(name)
        except (OSError, TypeError):
            continue
    raise SystemExit("libcublasLt not found")


def check(status, what):
    if status != 0:
        raise RuntimeError(f"{what} failed with cublasStatus {status}")


class Problem:
    """One row-wise FP8 GEMM y (M, N) = x (M, K) W^T with cuBLASLt's descriptors, column-major as cuBLAS sees it:
    D (N x M) = W (K x N)^T x (K x M), the weight's scales on op(A)'s rows, the activations' on op(B)'s columns."""

    def __init__(self, lt, handle, x, w, x_scale, w_scale):
        self.lt, self.handle = lt, handle
        (m, k), n = x.shape, w.shape[0]
        self.x, self.w, self.scales = x, w, (w_scale, x_scale)
        self.out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        self.workspace = torch.empty(WORKSPACE, device="cuda", dtype=torch.uint8)
        self.desc = ctypes.c_void_p()
        check(lt.cublasLtMatmulDescCreate(ctypes.byref(self.desc), COMPUTE_32F, R_32F), "cublasLtMatmulDescCreate")
        self.set(DESC_TRANSA, ctypes.c_int32(OP_T))
        self.set(DESC_TRANSB, ctypes.c_int32(OP_N))
        self.set(DESC_A_SCALE_POINTER, ctypes.c_void_p(w_scale.data_ptr()))
        self.set(DESC_B_SCALE_POINTER, ctypes.c_void_p(x_scale.data_ptr()))
        self.set(DESC_A_SCALE_MODE, ctypes.c_int32(SCALE_OUTER_VEC_32F))
        self.set(DESC_B_SCALE_MODE, ctypes.c_int32(SCALE_OUTER_VEC_32F))
        self.set(DESC_FAST_ACCUM, ctypes.c_int8(1))
        self.layouts = [self.layout(R_8F_E4M3, k, n, k), self.layout(R_8F_E4M3, k, m, k),
                        self.layout(R_16BF, n, m, n)]

    def set(self, attribute, value):
        check(self.lt.cublasLtMatmulDescSetAttribute(self.desc, attribute, ctypes.byref(value),
                                                     ctypes.c_size_t(ctypes.sizeof(value))),
              f"cublasLtMatmulDescSetAttribute({attribute})")

    def layout(self, dtype, rows, cols, ld):
        layout = ctypes.c_void_p()
        check(self.lt.cublasLtMatrixLayoutCreate(ctypes.byref(layout), dtype, ctypes.c_uint64(rows),
                                                 ctypes.c_uint64(cols), ctypes.c_int64(ld)),
              "cublasLtMatrixLayoutCreate")
        return layout

    def algorithms(self, count):
        preference = ctypes.c_void_p()
        check(self.lt.cublasLtMatmulPreferenceCreate(ctypes.byref(preference)), "cublasLtMatmulPreferenceCreate")
        size = ctypes.c_uint64(WORKSPACE)
        check(self.lt.cublasLtMatmulPreferenceSetAttribute(preference, PREF_MAX_WORKSPACE_BYTES, ctypes.byref(size),
                                                           ctypes.c_size_t(ctypes.sizeof(size))),
              "cublasLtMatmulPreferenceSetAttribute")
        results, found = (HeuristicResult * count)(), ctypes.c_int(0)
        a, b, d = self.layouts
        check(self.lt.cublasLtMatmulAlgoGetHeuristic(self.handle, self.desc, a, b, d, d, preference, count, results,
                                                     ctypes.byref(found)), "cublasLtMatmulAlgoGetHeuristic")
        return [results[i] for i in range(found.value) if results[i].state == 0]

    def run(self, result):
        alpha, beta = ctypes.c_float(1.0), ctypes.c_float(0.0)
        a, b, d = self.layouts
        out = ctypes.c_void_p(self.out.data_ptr())
        check(self.lt.cublasLtMatmul(
            self.handle, self.desc, ctypes.byref(alpha), ctypes.c_void_p(self.w.data_ptr()), a,
            ctypes.c_void_p(self.x.data_ptr()), b, ctypes.byref(beta), out, d, out, d, ctypes.byref(result.algo),
            ctypes.c_void_p(self.workspace.data_ptr()), ctypes.c_size_t(WORKSPACE),
            ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)), "cublasLtMatmul")
        return self.out


def kernel_name(fn) -> str:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type.name == "CUDA"]
    return max(names, key=len) if names else "?"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--count", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--only", default="", help="shapes whose name contains this")
    args = parser.parse_args()
    lt = library()
    handle = ctypes.c_void_p()
    check(lt.cublasLtCreate(ctypes.byref(handle)), "cublasLtCreate")
    report = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                  cublaslt=lt.cublasLtGetVersion() if hasattr(lt, "cublasLtGetVersion") else None, shapes={})
    g = torch.Generator("cuda").manual_seed(0)
    for name, m, k, n in SHAPES:
        if args.only not in name:
            continue
        x = torch.randn(m, k, device="cuda", generator=g).to(FP8)
        w = torch.randn(n, k, device="cuda", generator=g).to(FP8)
        x_scale = torch.rand(m, 1, device="cuda", generator=g) + 0.5
        w_scale = torch.rand(1, n, device="cuda", generator=g) + 0.5
        torch_mm = lambda: torch._scaled_mm(x, w.t(), scale_a=x_scale, scale_b=w_scale, out_dtype=torch.bfloat16,
                                            use_fast_accum=True)
        expected = torch_mm().float()
        problem = Problem(lt, handle, x, w, x_scale, w_scale)
        algorithms = problem.algorithms(args.count)
        rows = [dict(algorithm="torch._scaled_mm", kernel=kernel_name(torch_mm), seconds=[])]
        for i, result in enumerate(algorithms):
            out = problem.run(result).float()
            error = float((out - expected).norm() / expected.norm())
            rows.append(dict(algorithm=i, waves=round(result.waves, 3), workspace=result.workspace_size,
                             kernel=kernel_name(lambda r=result: problem.run(r)), relative_error=error, seconds=[]))
        calls = [torch_mm] + [lambda r=result: problem.run(r) for result in algorithms]
        flop = 2 * m * k * n
        repeat = max(3, int(0.25 / (flop / 1.2e15)))
        for _ in range(args.rounds):
            for row, call in zip(rows, calls):
                row["seconds"].append(seconds(call, repeat))
        for row in rows:
            best = min(row["seconds"])
            row.update(ms=round(best * 1e3, 4), tflops=round(flop / best / 1e12, 1),
                       seconds=[round(s * 1e3, 4) for s in row["seconds"]])
            print(f"{name:16s} {str(row['algorithm']):18s} {row['ms']:9.4f} ms {row['tflops']:7.1f} TFLOP/s  "
                  f"{row.get('relative_error', 0):.1e}  {row['kernel'][:70]}", flush=True)
        report["shapes"][name] = dict(rows=m, k=k, n=n, algorithms=rows)
    out = Path(os.environ.get("OUT", ".")) / "cublaslt_algos.json"
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(out)


if __name__ == "__main__":
    main()
