"""Each Triton kernel of the FP8 forward and of the video decoder at its full-size shape: milliseconds a call, the
bytes it must move, and the rate that makes, beside a plain torch copy of the same bytes (the memory's rate for
that access pattern). Variants with parts switched off (no RoPE, no norm) tell arithmetic from memory.

    python3 bench/triton_rates.py            # writes $OUT/triton_rates.json
"""
import json
import os
from pathlib import Path

import torch
import triton.testing


from h3gen.kernels import (head_amax, qk_norm_rope, qk_norm_rope_fp8, quantize_rows, residual_rmsnorm,
                           rmsnorm_modulate, swiglu)
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


def fp8_launch_shapes(label, args, moved_bytes):
    """The e4m3 Q/K/V kernel per launch shape (rows, heads, warps a program), against the default shape's bytes."""
    old = qk_norm_rope_fp8.qk_norm_rope_fp8_triton(*args)
    for rows in (1, 2, 4, 8):
        for heads_block in (8, 16, 32):
            for warps in (2, 4, 8):
                if rows * heads_block > 128:
                    continue
                run = lambda: qk_norm_rope_fp8.qk_norm_rope_fp8_triton(*args, rows_block=rows, heads_block=heads_block,
                                                                      num_warps=warps)
                out = rate(f"{label} fp8 r{rows}h{heads_block}w{warps}", run, moved_bytes)
                results[f"{label} fp8 r{rows}h{heads_block}w{warps}"]["bytes_differing"] = sum(
                    int((a.view(torch.uint8) != b.view(torch.uint8)).sum()) for a, b in zip(out[:3], old[:3]))
                assert all(torch.equal(a, b) for a, b in zip(out[3:], old[3:]))


def main():
    g = torch.Generator("cuda").manual_seed(0)
    rnd = lambda *shape, dtype=torch.bfloat16: torch.randn(*shape, device="cuda", generator=g).to(dtype)
    seq, hidden, heads = 73642, 5376, 56
    inner = heads * 128
    qkv = rnd(1, seq, 3 * inner)
    w = 1 + 0.1 * rnd(128)
    cos, sin = rotary_angles(torch.randint(0, 300, (seq, 3), device="cuda"), rotary_inv_freq(16, 1e4).cuda())
    qk_bytes = 2 * seq * inner * 2  # q and k, one of them: seq * inner * 2 bytes
    print("DiT, 73,642 rows")
    copy_dst = torch.empty(1, seq, 2 * inner, device="cuda", dtype=torch.bfloat16)
    rate("copy q and k (strided read, bf16 write)", lambda: copy_dst.copy_(qkv[..., :2 * inner]), 2 * qk_bytes)
    fp8_dst = torch.empty(1, seq, 3 * inner, device="cuda", dtype=torch.float8_e4m3fn)
    rate("copy q, k, v to e4m3 (torch)", lambda: fp8_dst.copy_(qkv), qkv.numel() * 3)
    rate("qk_norm_rope bf16, rope", lambda: qk_norm_rope.qk_norm_rope_triton(qkv, heads, w, w, 1e-5, cos, sin),
         2 * qk_bytes)
    rate("qk_norm_rope bf16, no rope", lambda: qk_norm_rope.qk_norm_rope_triton(qkv, heads, w, w, 1e-5), 2 * qk_bytes)
    rate("qk_norm_rope fp8 (q, k, v and v's amax), rope",
         lambda: qk_norm_rope_fp8.qk_norm_rope_fp8_triton(qkv, heads, w, w, 1e-5, cos, sin),
         qkv.numel() * 3 + seq * inner * 2)
    rate("qk_norm_rope fp8, no rope", lambda: qk_norm_rope_fp8.qk_norm_rope_fp8_triton(qkv, heads, w, w, 1e-5),
         qkv.numel() * 3 + seq * inner * 2)
    fp8_launch_shapes("dit", (qkv, heads, w, w, 1e-5, cos, sin), qkv.numel() * 3 + seq * inner * 2)
    v = qkv[..., 2 * inner:].unflatten(-1, (heads, 128))
    rate("head_amax of v", lambda: head_amax.head_amax(v), seq * inner * 2)
    x = rnd(1, seq, hidden)
    table, rows = 0.5 * rnd(6, 6 * hidden), torch.randint(0, 6, (seq,), device="cuda")
    weight = 1 + 0.1 * rnd(hidden)
    rate("rmsnorm_modulate bf16", lambda: rmsnorm_modulate.rmsnorm_modulate_triton(x, weight, 1e-5, table, rows, 3, 4),
         x.numel() * 4)
    rate("rmsnorm (no modulation) bf16", lambda: rmsnorm_modulate.rmsnorm_modulate_triton(x, weight, 1e-5),
         x.numel() * 4)
    rate("rmsnorm_modulate to fp8 rows",
         lambda: rmsnorm_modulate.rmsnorm_modulate_quantized_triton(x, weight, 1e-5, table, rows, 3, 4), x.numel() * 3)
    rate("quantize_rows 5376 wide", lambda: quantize_rows.quantize_rows_triton(x[0]), x.numel() * 3)
    y = rnd(1, seq, hidden)
    from h3gen.kernels import gated_residual
    rate("gated_residual", lambda: gated_residual.gated_residual_triton(x, y, table, rows, 5), x.numel() * 6)
    rate("torch add (same bytes)", lambda: torch.add(x, y), x.numel() * 6)
    up_gate = rnd(16384, 2 * 14336)
    rate("swiglu to fp8 rows (16k-row pass)", lambda: swiglu.swiglu_quantized_triton(up_gate), up_gate.numel() * 2.5)
    rate("swiglu bf16 (16k-row pass)", lambda: swiglu.swiglu_triton(up_gate), up_gate.numel() * 3)
    del qkv, copy_dst, fp8_dst, x, y, up_gate

    print("video decoder, a batch of 16 tiles of 1,797 tokens")
    tokens, width, dheads = 16 * 1797, 2048, 32
    dqkv = rnd(1, tokens, 3 * width)
    ones = torch.ones(64, device="cuda")
    dcos, dsin = (t.float() for t in rnd(2, tokens, 48))
    dq_bytes = 2 * tokens * width * 2
    fp8_launch_shapes("decoder", (dqkv, dheads, ones, ones, 1e-5, dcos, dsin), dqkv.numel() * 3 + tokens * width * 2)
    rate("decoder copy q and k", lambda: torch.empty(1, tokens, 2 * width, device="cuda",
                                                     dtype=torch.bfloat16).copy_(dqkv[..., :2 * width]), 2 * dq_bytes)
    expected = qk_norm_rope.qk_norm_rope_triton(dqkv, dheads, ones, ones, 1e-5, dcos, dsin)
    rate("decoder qk_norm_rope bf16 h8w4 (torch's order)",
         lambda: qk_norm_rope.qk_norm_rope_triton(dqkv, dheads, ones, ones, 1e-5, dcos, dsin), 2 * dq_bytes, expected)
    rate("decoder qk_norm_rope bf16 h32w2",
         lambda: qk_norm_rope.qk_norm_rope_triton(dqkv, dheads, ones, ones, 1e-5, dcos, dsin, heads_block=32,
                                                  num_warps=2), 2 * dq_bytes, expected)
    rate("decoder qk_norm_rope bf16, no rope",
         lambda: qk_norm_rope.qk_norm_rope_triton(dqkv, dheads, ones, ones, 1e-5), 2 * dq_bytes)
    hidden32 = torch.randn(tokens, width, device="cuda", generator=g)
    branch = rnd(tokens, width)
    scale, nw = 0.1 * rnd(width), 1 + 0.1 * rnd(width)
    rate("decoder residual_rmsnorm to fp8 rows (fp32 stream)",
         lambda: residual_rmsnorm.residual_rmsnorm_quantized_triton(hidden32, branch, scale, nw), tokens * width * 11)
    rate("decoder residual_rmsnorm bf16 (fp32 stream)",
         lambda: residual_rmsnorm.residual_rmsnorm_triton(hidden32, branch, scale, nw), tokens * width * 12)
    dug = rnd(tokens, 2 * 8192)
    rate("decoder swiglu to fp8 rows", lambda: swiglu.swiglu_quantized_triton(dug), dug.numel() * 2.5)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "triton_rates.json").write_text(json.dumps(dict(device=torch.cuda.get_device_name(), results=results),
                                                      indent=1))


if __name__ == "__main__":
    main()
