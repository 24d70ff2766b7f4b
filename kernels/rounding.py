"""Roundings the Triton kernels share. Triton's interpreter (how the tests run kernels on a CPU) truncates when it
converts fp32 to bf16 and drops the carry when a rounded-up FP8 mantissa overflows into the exponent; with
`EMULATE` these round to nearest even in fp32 bit arithmetic first, so the conversion itself is exact. Compiled
kernels use the hardware's rounding conversions."""
import triton
import triton.language as tl

# Launch option for every kernel that rounds where a chain of torch ops rounds: without it the compiler contracts
# a multiply and an add into one fused multiply-add (in fp32 or bf16) and skips the rounding in between, so a tenth
# to a quarter of the values (measured on an H200) land on the other side of a bf16 rounding boundary.
NO_FMA = dict(enable_fp_fusion=False)


@triton.jit
def _round_mantissa(x, DROPPED_BITS: tl.constexpr):
    """x rounded to nearest even with its lowest DROPPED_BITS mantissa bits cleared (normal numbers)."""
    bits = x.to(tl.uint32, bitcast=True)
    half = (1 << (DROPPED_BITS - 1)) - 1
    kept = 0xFFFFFFFF ^ ((1 << DROPPED_BITS) - 1)
    bits = (bits + half + ((bits >> DROPPED_BITS) & 1)) & kept
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def to_fp8(x, EMULATE: tl.constexpr):
    if EMULATE:
        normal = _round_mantissa(x, 20)  # e4m3 keeps 3 of fp32's 23 mantissa bits
        subnormal = (x + 24576.0) - 24576.0  # below 2^-6 e4m3 steps by 2^-9, the fp32 ulp of 1.5 * 2^14
        x = tl.where(tl.abs(x) < 0.015625, subnormal, normal)
    return x.to(tl.float8e4nv)


@triton.jit
def round_to(x, dtype: tl.constexpr, EMULATE: tl.constexpr):
    """x (fp32) rounded to `dtype` (bf16 or fp32), returned as fp32."""
    if dtype == tl.bfloat16:
        if EMULATE:
            x = _round_mantissa(x, 16)
        x = x.to(tl.bfloat16).to(tl.float32)
    return x
