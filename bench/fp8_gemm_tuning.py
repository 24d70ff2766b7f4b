"""The DiT's FP8 GEMMs (row-wise `torch._scaled_mm`, fast accumulation) at the 10 s clip's shapes: cuBLAS's own
pick against the kernel TunableOp finds by timing every candidate, alone and in the order a block runs them.
With --bf16, the bf16 presets' GEMMs (`F.linear`, the feed-forward over the whole sequence) instead, also
through cuBLASLt. With --tensorwise, the same FP8 GEMMs in one process, taking turns: row-wise scales with the bias
the model adds in the epilogue, row-wise without it, and one scale per operand (what a GEMM whose scales and bias
were applied by the kernel reading its output would run), with and without the bias.

Usage: python3 bench/fp8_gemm_tuning.py [--bf16 | --tensorwise]   (a Hopper GPU; writes $OUT/fp8_gemm_tuning.json,
$OUT/bf16_gemm_tuning.json or $OUT/fp8_tensorwise_gemm_tuning.json)
"""
import json
import os
import sys
import time
from pathlib import Path

import torch

OUT = Path(os.environ.get("OUT", "."))
FP8 = torch.float8_e4m3fn
# (name, rows, in, out): attention's QKV and output projections over the whole sequence, the feed-forward over
# 16k-row passes as the FP8 presets run it.
SHAPES = [("qkv", 73642, 5376, 21504), ("out", 73642, 7168, 5376), ("up_gate", 16384, 5376, 28672),
          ("down", 16384, 14336, 5376)]
CALLS = {"qkv": 1, "out": 1, "up_gate": 5, "down": 5}  # per block
BF16 = "--bf16" in sys.argv
TENSORWISE = "--tensorwise" in sys.argv
if BF16:
    SHAPES = [(name, 73642, k, n) for name, _, k, n in SHAPES]
    CALLS = dict.fromkeys(CALLS, 1)


def operands(rows, k, n):
    g = torch.Generator("cuda").manual_seed(0)
    if BF16:
        return (torch.randn(rows, k, device="cuda", generator=g, dtype=torch.bfloat16),
                torch.randn(n, k, device="cuda", generator=g, dtype=torch.bfloat16) / k ** 0.5)
    a = torch.randn(rows, k, device="cuda", generator=g).to(FP8)
    b = torch.randn(n, k, device="cuda", generator=g).to(FP8).t()
    return a, b, torch.rand(rows, 1, device="cuda") + 0.5, torch.rand(1, n, device="cuda") + 0.5


def gemm(ops):
    if BF16:
        return torch.nn.functional.linear(*ops)
    a, b, sa, sb = ops
    return torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16, use_fast_accum=True)


def seconds(fn, repeat):
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeat


def measure(inputs, label, gemm=gemm):
    row = {}
    for name, rows, k, n in SHAPES:
        s = seconds(lambda: gemm(inputs[name]), 20)
        row[name] = dict(ms=round(s * 1e3, 3), tflops=round(2 * rows * k * n / s / 1e12, 1))
    # 50 blocks' worth in a block's order: the rate a forward sees under sustained load
    block = lambda: [gemm(inputs[name]) for name, *_ in SHAPES for _ in range(CALLS[name])]
    s = seconds(lambda: [block() for _ in range(10)], 1) * 5
    row["gemm_s_per_forward"] = round(s, 3)
    print(label, json.dumps(row), flush=True)
    return row


def epilogues():
    """--tensorwise: each epilogue's GEMM time per forward, in two alternating rounds on the same operands."""
    base = {name: operands(rows, k, n) for name, rows, k, n in SHAPES}
    one = torch.ones((), device="cuda")
    bias = {name: torch.randn(n, device="cuda", dtype=torch.bfloat16) for name, _, _, n in SHAPES}
    variants = {
        "rowwise_bias": lambda name: (*base[name], bias[name]),
        "rowwise": lambda name: (*base[name], None),
        "tensorwise": lambda name: (base[name][0], base[name][1], one, one, None),
        "tensorwise_bias": lambda name: (base[name][0], base[name][1], one, one, bias[name]),
    }

    def run(ops):
        a, b, sa, sb, add = ops
        return torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, bias=add, out_dtype=torch.bfloat16, use_fast_accum=True)

    results = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    for round_ in range(2):
        for label, make in variants.items():
            inputs = {name: make(name) for name, *_ in SHAPES}
            results.setdefault(label, []).append(measure(inputs, f"{round_} {label}", run))
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "fp8_tensorwise_gemm_tuning.json").write_text(json.dumps(results, indent=1))


def main():
    if TENSORWISE:
        return epilogues()
    inputs = {name: operands(rows, k, n) for name, rows, k, n in SHAPES}
    results = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    expected = {name: gemm(inputs[name]) for name, *_ in SHAPES}
    results["cublas"] = measure(inputs, "cublas")
    if BF16:  # cuBLASLt's pick for the same products (torch calls cuBLAS's gemm for bf16 without a bias)
        torch.backends.cuda.preferred_blas_library("cublaslt")
        lt = {name: gemm(inputs[name]) for name, *_ in SHAPES}
        results["cublaslt_equal"] = {name: bool(torch.equal(lt[name], expected[name])) for name in lt}
        results["cublaslt"] = measure(inputs, "cublaslt")
        torch.backends.cuda.preferred_blas_library("cublas")
    tunable = torch.cuda.tunable
    tunable.enable(True)
    tunable.tuning_enable(True)
    tunable.set_max_tuning_duration(200)
    tunable.set_filename(str(OUT / "tunableop_results.csv"))
    start = time.perf_counter()
    try:
        tuned = {name: gemm(inputs[name]) for name, *_ in SHAPES}
        results["tuning_s"] = round(time.perf_counter() - start, 1)
        results["tuned_equal"] = {name: bool(torch.equal(tuned[name], expected[name])) for name in tuned}
        results["tunableop"] = measure(inputs, "tunableop")
        results["tunableop_picks"] = [list(map(str, pick)) for pick in tunable.get_results()]
    except Exception as exc:
        results["tunableop_error"] = repr(exc)[:400]
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"{'bf16' if BF16 else 'fp8'}_gemm_tuning.json").write_text(json.dumps(results, indent=1, default=str))
    print(json.dumps(results, default=str)[:3000])


if __name__ == "__main__":
    main()
