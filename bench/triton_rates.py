"""Each Triton kernel of the FP8 forward and of the video decoder at its full-size shape: milliseconds a call, the
bytes it must move, and the rate that makes, beside a plain torch copy of the same bytes (the memory's rate for
that access pattern). Variants with parts switched off (no RoPE, no norm) tell arithmetic from memory.

    python3 bench/triton_rates.py [SECTIONS]   # qk,norms,decoder by default; writes $OUT/triton_rates.json
"""
import json
import os
from pathlib import Path

import torch
import triton.testing


from h3gen.kernels import (gated_residual, head_amax, qk_norm_rope, qk_norm_rope_fp8, quantize_rows,
                           residual_rmsnorm, rmsnorm_modulate, swiglu)
from h3gen.models.dit.blocks import rotary_angles, rotary_inv_freq

OUT = Path(os.environ.get("OUT", "."))
results = {}


def rate(name, fn, moved_bytes, expected=None):
    out = fn()
    equal = None
    if expected is not None:
        outs = out if isinstance(out, tuple) else (out,)
        equal = all(torch.equal(a, e) for a, e in zip(outs, expected))
    ms = triton.testing.do_bench(fn, warmup=5, rep=40)
    results[name] = dict(ms=round(ms, 4), gb=round(moved_bytes / 1e9, 3), tb_per_s=round(moved_bytes / ms / 1e9, 2),
                         equal=equal)
    print(f"{name:48s} {ms:8.4f} ms {moved_bytes / 1e9:7.3f} GB {moved_bytes / ms / 1e9:6.2f} TB/s"
          + ("" if equal is None else f"  equal={equal}"), flush=True)
    return out


def fp8_launch_shapes(label, args):
    """The e4m3 Q/K/V kernel per launch shape (rows, heads, warps a program), against the default shape's bytes."""
    old = qk_norm_rope_fp8.qk_norm_rope_fp8_triton(*args)
    for rows, heads_block, warps in qk_norm_rope_fp8.SWEPT_LAUNCH_SHAPES:
        if rows * heads_block > 128:
            continue
        run = lambda: qk_norm_rope_fp8.qk_norm_rope_fp8_triton(*args, rows_block=rows, heads_block=heads_block,
                                                              num_warps=warps)
        out = rate(f"{label} fp8 r{rows}h{heads_block}w{warps}", run, qk_norm_rope_fp8.bytes_moved(args[0]))
        results[f"{label} fp8 r{rows}h{heads_block}w{warps}"]["bytes_differing"] = sum(
            int((a.view(torch.uint8) != b.view(torch.uint8)).sum()) for a, b in zip(out[:3], old[:3]))
        assert all(torch.equal(a, b) for a, b in zip(out[3:], old[3:]))


def modulate_pieces(x, weight, table, rows):
    """The modulated norm with its row in power-of-two pieces (the kernel's default) against one masked block of
    8,192 lanes, bf16 and to FP8 rows, per warp count; `equal` against the default launch."""
    from h3gen.kernels.quantize_rows import FP8
    from h3gen.kernels.rounding import NO_FMA

    count, hidden = x.numel() // x.shape[-1], x.shape[-1]
    kernel = rmsnorm_modulate._rmsnorm_modulate_kernel
    for fp8 in (False, True):
        form = rmsnorm_modulate.rmsnorm_modulate_quantized_triton if fp8 else rmsnorm_modulate.rmsnorm_modulate_triton
        expected = form(x, weight, 1e-5, table, rows, 3, 4)
        expected = expected[0] if fp8 else expected
        for pieces in (dict(PIECE0=4096, PIECE1=1024, PIECE2=256), dict(PIECE0=8192, PIECE1=0, PIECE2=0)):
            for warps in (4, 8, 16):
                out = torch.empty(count, hidden, device="cuda", dtype=FP8 if fp8 else x.dtype)
                scale = torch.empty(count, 1, device="cuda")
                extra = dict(scale_ptr=scale, dtype_max=torch.finfo(x.dtype).max, FP8_OUT=True) if fp8 else {}
                run = lambda: kernel[(count,)](x, weight, table, rows, weight, out, x.shape[-2], hidden,
                                               table.stride(0), 3 * hidden, 4 * hidden, 1e-5, HAS_MODULATION=True,
                                               HAS_RSTD=False, num_warps=warps, **pieces, **extra, **NO_FMA)
                layout = "pieces" if pieces["PIECE1"] else "one block"
                name = f"rmsnorm_modulate {'fp8' if fp8 else 'bf16'} {layout} w{warps}"
                rate(name, run, x.numel() * (3 if fp8 else 4))
                same = out.view(torch.uint8).view(-1).eq(expected.reshape(count, hidden).view(torch.uint8).view(-1)) \
                    if fp8 else out.view(-1).eq(expected.view(-1))
                results[name]["differing"] = int((~same).sum())


def main(sections):
    g = torch.Generator("cuda").manual_seed(0)
    rnd = lambda *shape, dtype=torch.bfloat16: torch.randn(*shape, device="cuda", generator=g).to(dtype)
    seq, hidden, heads = 73642, 5376, 56
    inner = heads * 128
    if "qk" in sections:
        print("DiT, 73,642 rows")
        qkv = rnd(1, seq, 3 * inner)
        w = 1 + 0.1 * rnd(128)
        cos, sin = rotary_angles(torch.randint(0, 300, (seq, 3), device="cuda"), rotary_inv_freq(16, 1e4).cuda())
        qk_bytes = 2 * seq * inner * 2  # q and k, one of them: seq * inner * 2 bytes
        rate("qk_norm_rope bf16, rope", lambda: qk_norm_rope.qk_norm_rope_triton(qkv, heads, w, w, 1e-5, cos, sin),
             2 * qk_bytes)
        rate("qk_norm_rope bf16, no rope", lambda: qk_norm_rope.qk_norm_rope_triton(qkv, heads, w, w, 1e-5),
             2 * qk_bytes)
        rate("qk_norm_rope fp8 (q, k, v and v's amax), rope",
             lambda: qk_norm_rope_fp8.qk_norm_rope_fp8_triton(qkv, heads, w, w, 1e-5, cos, sin),
             qk_norm_rope_fp8.bytes_moved(qkv))
        fp8_launch_shapes("dit", (qkv, heads, w, w, 1e-5, cos, sin))
        v = qkv[..., 2 * inner:].unflatten(-1, (heads, 128))
        rate("head_amax of v", lambda: head_amax.head_amax(v), seq * inner * 2)
        del qkv, v
    if "norms" in sections:
        x = rnd(1, seq, hidden)
        table, rows = 0.5 * rnd(6, 6 * hidden), torch.randint(0, 6, (seq,), device="cuda")
        weight = 1 + 0.1 * rnd(hidden)
        rate("rmsnorm (no modulation) bf16", lambda: rmsnorm_modulate.rmsnorm_modulate_triton(x, weight, 1e-5),
             x.numel() * 4)
        rate("quantize_rows 5376 wide", lambda: quantize_rows.quantize_rows_triton(x[0]), x.numel() * 3)
        modulate_pieces(x, weight, table, rows)
        y = rnd(1, seq, hidden)
        rate("gated_residual", lambda: gated_residual.gated_residual_triton(x, y, table, rows, 5), x.numel() * 6)
        rate("torch add (same bytes)", lambda: torch.add(x, y), x.numel() * 6)
        # The gated residual and the next norm in one pass: x, y read, the sum and the norm written; `equal` to the
        # two kernels' outputs chained.
        flat = lambda total, norm: (total, norm[0].view(torch.uint8), norm[1]) if isinstance(norm, tuple) \
            else (total, norm)
        for fp8 in (False, True):
            total = gated_residual.gated_residual_triton(x, y, table, rows, 2)
            norm = (rmsnorm_modulate.rmsnorm_modulate_quantized_triton if fp8
                    else rmsnorm_modulate.rmsnorm_modulate_triton)(total, weight, 1e-5, table, rows, 3, 4)
            run = lambda: flat(*rmsnorm_modulate.gated_residual_rmsnorm_modulate_triton(
                x, y, table, rows, 2, weight, 1e-5, 3, 4, fp8=fp8))
            rate(f"gated_residual + rmsnorm_modulate {'fp8' if fp8 else 'bf16'} in one pass", run,
                 x.numel() * (7 if fp8 else 8), flat(total, norm))
            del total, norm
        up_gate = rnd(16384, 2 * 14336)
        rate("swiglu to fp8 rows (16k-row pass)", lambda: swiglu.swiglu_quantized_triton(up_gate),
             up_gate.numel() * 2.5)
        del x, y, up_gate
    if "decoder" in sections:
        print("video decoder, a batch of 16 tiles of 1,797 tokens")
        tokens, width, dheads = 16 * 1797, 2048, 32
        dqkv = rnd(1, tokens, 3 * width)
        ones = torch.ones(64, device="cuda")
        dcos, dsin = (t.float() for t in rnd(2, tokens, 48))
        dq_bytes = 2 * tokens * width * 2
        fp8_launch_shapes("decoder", (dqkv, dheads, ones, ones, 1e-5, dcos, dsin))
        expected = qk_norm_rope.qk_norm_rope_triton(dqkv, dheads, ones, ones, 1e-5, dcos, dsin)
        rate("decoder qk_norm_rope bf16 h8w4 (torch's order)",
             lambda: qk_norm_rope.qk_norm_rope_triton(dqkv, dheads, ones, ones, 1e-5, dcos, dsin), dq_bytes * 2,
             expected)
        hidden32 = torch.randn(tokens, width, device="cuda", generator=g)
        branch = rnd(tokens, width)
        scale, nw = 0.1 * rnd(width), 1 + 0.1 * rnd(width)
        rate("decoder residual_rmsnorm to fp8 rows (fp32 stream)",
             lambda: residual_rmsnorm.residual_rmsnorm_quantized_triton(hidden32, branch, scale, nw),
             tokens * width * 11)
        dug = rnd(tokens, 2 * 8192)
        rate("decoder swiglu to fp8 rows", lambda: swiglu.swiglu_quantized_triton(dug), dug.numel() * 2.5)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "triton_rates.json").write_text(json.dumps(dict(device=torch.cuda.get_device_name(), results=results),
                                                      indent=1))


if __name__ == "__main__":
    import sys

    main(sys.argv[1].split(",") if len(sys.argv) > 1 else ["qk", "norms", "decoder"])
