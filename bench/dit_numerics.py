"""Where h3gen's DiT block departs from diffusers' in bf16: block 0 at full width and full row count, op by op.

Usage (diffusers importable; h3gen installed):
    python3 bench/dit_numerics.py [--tiny] [--gemm]
Builds diffusers' MiniMaxH3Transformer3DModel with two blocks at full width (random weights as dit_gpu_check.py
draws them), runs the 10 s layout's block 0 op by op the way diffusers' forward does, then feeds each of h3gen's
ops the very same inputs and prints, per op, the relative L2 error and the fraction of values that differ at all.
So a difference is pinned to one op and not smeared through the block. The three op sets (torch references, Triton
kernels, Triton kernels handed torch's norm statistics) and both modulation sources (rows computed per call and the
precomputed table) are checked.
--gemm also times the block's four GEMM shapes with the weight as stored (x @ W^T), transposed once (x @ W), and
(on CUDA) with TunableOp picking among the BLAS libraries' candidates.
Results: $OUT/dit_numerics.json.
"""
import copy
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
import dit_gpu_check as check  # noqa: E402
from op_diff import differ, results_log  # noqa: E402

log = results_log("dit_numerics.json")


def diffusers_block(block, x, temb, index, rotary, backend):
    """diffusers' MiniMaxH3TransformerBlock.forward split into its ops; every intermediate kept."""
    from diffusers.models.transformers.transformer_minimax_h3 import _apply_rotary_emb

    s = {}
    shift1, scale1, gate1, shift2, scale2, gate2 = block.adaln_proj(temb)
    s["modulation"] = block.adaln_proj.linear(F.silu(temb).to(torch.bfloat16)).view(-1, 6 * x.shape[-1])
    s["row_modulation"] = s["modulation"].index_select(0, index)
    s["norm1"] = block.norm1(x)
    s["h1"] = s["norm1"] * (1.0 + scale1.index_select(0, index)) + shift1.index_select(0, index)
    attn = block.attn
    s["q"], s["k"], s["v"] = (lin(s["h1"]).unflatten(-1, (attn.heads, -1)) for lin in (attn.to_q, attn.to_k, attn.to_v))
    s["q_rope"] = _apply_rotary_emb(attn.norm_q(s["q"]), *rotary)
    s["k_rope"] = _apply_rotary_emb(attn.norm_k(s["k"]), *rotary)
    s["attended"] = backend(s["q_rope"], s["k_rope"], s["v"]).flatten(2, 3).type_as(s["q"])
    s["attn_out"] = attn.to_out[0](s["attended"])
    s["x1"] = x + gate1.index_select(0, index) * s["attn_out"]
    s["h2"] = block.norm2(s["x1"]) * (1.0 + scale2.index_select(0, index)) + shift2.index_select(0, index)
    s["up_gate"] = block.ff.net[0].proj(s["h2"])
    s["swiglu"] = block.ff.net[0](s["h2"])
    s["ff_out"] = block.ff(s["h2"])
    s["x2"] = s["x1"] + gate2.index_select(0, index) * s["ff_out"]
    return s


def h3gen_ops(block, s, x, modulation, index, cos, sin, ops, backend):
    """Each of h3gen's block ops on the inputs diffusers' op had, against diffusers' output of that op."""
    from h3gen.kernels.attention import attention

    attn = block.attn
    qkv_weight = torch.cat([attn.to_q.weight, attn.to_k.weight, attn.to_v.weight])
    up_gate_weight = block.ff.net[0].proj.weight
    rows = {}
    rows["modulation"] = differ(modulation.index_select(0, index), s["row_modulation"])
    rows["h1 (rmsnorm_modulate)"] = differ(ops.rmsnorm_modulate(x, block.norm1.weight, block.norm1.eps, modulation,
                                                                index, 0, 1), s["h1"])
    exact_qkv = torch.cat([s[n].flatten(2) for n in "qkv"], dim=-1)
    rows["qkv (fused GEMM)"] = differ(F.linear(s["h1"], qkv_weight), exact_qkv)
    q, k, v = ops.qk_norm_rope(exact_qkv, attn.heads, attn.norm_q.weight, attn.norm_k.weight, attn.norm_q.eps,
                               cos, sin)
    rows["q (qk_norm_rope)"], rows["k (qk_norm_rope)"] = differ(q, s["q_rope"]), differ(k, s["k_rope"])
    rows["attended"] = differ(attention(s["q_rope"], s["k_rope"], s["v"], backend).flatten(2, 3), s["attended"])
    rows["x1 (gated_residual)"] = differ(ops.gated_residual(x, s["attn_out"], modulation, index, 2), s["x1"])
    rows["h2 (rmsnorm_modulate)"] = differ(ops.rmsnorm_modulate(s["x1"], block.norm2.weight, block.norm2.eps,
                                                                modulation, index, 3, 4), s["h2"])
    rows["up_gate (GEMM)"] = differ(F.linear(s["h2"], up_gate_weight), s["up_gate"])
    rows["swiglu"] = differ(ops.swiglu(s["up_gate"]), s["swiglu"])
    rows["x2 (gated_residual)"] = differ(ops.gated_residual(s["x1"], s["ff_out"], modulation, index, 5), s["x2"])
    # The whole block chained, h3gen's ops only, each stage against diffusers'; V as the fused projection leaves it
    # (a strided view) and copied contiguous, the layout diffusers' separate projection gives it.
    for label, v_layout in (("chained", lambda v: v), ("chained, V contiguous", lambda v: v.contiguous())):
        h = ops.rmsnorm_modulate(x, block.norm1.weight, block.norm1.eps, modulation, index, 0, 1)
        q, k, v = ops.qk_norm_rope(F.linear(h, qkv_weight), attn.heads, attn.norm_q.weight, attn.norm_k.weight,
                                   attn.norm_q.eps, cos, sin)
        attended = attention(q, k, v_layout(v), backend).flatten(2, 3).type_as(q)
        x1 = ops.gated_residual(x, attn.to_out[0](attended), modulation, index, 2)
        h = ops.rmsnorm_modulate(x1, block.norm2.weight, block.norm2.eps, modulation, index, 3, 4)
        x2 = ops.gated_residual(x1, block.ff.net[2](ops.swiglu(F.linear(h, up_gate_weight))), modulation, index, 5)
        rows[f"block ({label})"] = {name: differ(a, s[name]) for name, a in
                                     (("q_rope", q), ("attended", attended), ("x1", x1), ("x2", x2))}
    return rows


def gemm_layouts(tiny):
    rows_count, hidden, inner, ffn = (512, 64, 256, 128) if tiny else (73642, 5376, 7168, 14336)
    shapes = {"qkv": (hidden, 3 * inner), "attn_out": (inner, hidden), "up_gate": (hidden, 2 * ffn),
              "down": (ffn, hidden)}
    for name, (k, n) in shapes.items():
        x = torch.randn(rows_count, k, device=check.DEVICE, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=check.DEVICE, dtype=torch.bfloat16) * 0.02
        wt = w.t().contiguous()
        flop = 2 * rows_count * k * n
        row = {}
        for label, fn in (("x@W^T", lambda: F.linear(x, w)), ("x@W", lambda: x @ wt)):
            fn()
            _, seconds = check.timed(lambda: [fn() for _ in range(10)])
            row[label] = dict(ms=round(seconds / 10 * 1e3, 2), tflops=round(flop * 10 / seconds / 1e12, 1))
        row["equal"] = bool(torch.equal(F.linear(x, w), x @ wt))
        if check.DEVICE.type == "cuda":  # TunableOp: the fastest of the BLAS libraries' candidates for this shape
            torch.cuda.tunable.enable(True)
            torch.cuda.tunable.tuning_enable(True)
            tuned = F.linear(x, w)
            _, seconds = check.timed(lambda: [F.linear(x, w) for _ in range(10)])
            torch.cuda.tunable.enable(False)
            row["x@W^T_tunableop"] = dict(ms=round(seconds / 10 * 1e3, 2), tflops=round(flop * 10 / seconds / 1e12, 1),
                                          equal=bool(torch.equal(tuned, F.linear(x, w))))
        log(f"gemm_{name}", row)


def main():
    tiny = check.TINY
    torch.set_grad_enabled(False)
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    from h3gen.models.dit.transformer import FastH3Transformer
    from h3gen.models.dit.blocks import EXACT_NORM_OPS, REFERENCE_OPS, TRITON_OPS, rotary_angles

    if "--gemm" in sys.argv:
        gemm_layouts(tiny)
    config = check.full_size_config() | (check.TINY_CONFIG if tiny else {})
    config["num_layers"] = 2
    model = check.random_reference(config)
    inputs, schedule = check.layout_inputs(config)
    captured = {}
    hook = model.transformer_blocks[0].register_forward_hook(
        lambda module, args, out: captured.update(x=args[0].clone(), temb=args[1].clone(), index=args[2].clone(),
                                                  rotary=tuple(t.clone() for t in args[3]), out=out.clone()))
    model(**inputs, return_dict=False)
    hook.remove()
    block, x, temb, index = model.transformer_blocks[0], captured["x"], captured["temb"], captured["index"]
    backend = "sdpa" if tiny else "sdpa-cudnn"
    sdpa = lambda q, k, v: dispatch_attention_fn(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False)
    s = diffusers_block(block, x, temb, index, captured["rotary"], sdpa)
    log("diffusers_ops_reproduce_block", differ(s["x2"], captured["out"]))
    cos, sin = rotary_angles(inputs["position_ids"], model.rope.inv_freq)
    log("rotary_cos", differ(cos, captured["rotary"][0]))
    # How torch rounds a bf16 RMSNorm here: once at the end, or after the normalization and again after the weight.
    weight, eps, xf = block.norm1.weight, block.norm1.eps, x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    log("rms_norm_rounded_once", differ((xf * rstd * weight.float()).to(x.dtype), s["norm1"]))
    log("rms_norm_rounded_twice", differ((xf * rstd).to(x.dtype) * weight, s["norm1"]))
    # The modulation the table path reads, built as the sampler builds it (one batch per forward's timesteps).
    fast = FastH3Transformer.from_reference(copy.deepcopy(model), use_triton=False)
    fast.precompute_adaln(schedule)
    table_index, from_table = fast.adaln_index(inputs["timestep"], inputs["timestep_indices"], inputs["token_tags"])
    assert from_table
    table = fast.transformer_blocks[0].adaln_table
    from h3gen.kernels.attention import attention
    for name in () if tiny else ("flash-attn-4", "sdpa-flash"):
        try:
            log(f"attended_{name}", differ(attention(s["q_rope"], s["k_rope"], s["v"], name).flatten(2, 3),
                                           s["attended"]))
        except Exception as exc:
            log(f"attended_{name}_error", repr(exc)[:200])
    for ops_name, ops in (("torch", REFERENCE_OPS), ("triton", TRITON_OPS), ("triton_exact_norms", EXACT_NORM_OPS)):
        if tiny and ops_name != "torch":
            continue
        log(f"ops_{ops_name}_rows", h3gen_ops(block, s, x, s["modulation"], index, cos, sin, ops, backend))
        log(f"ops_{ops_name}_table", h3gen_ops(block, s, x, table, table_index, cos, sin, ops, backend)
            ["block (chained)"] | {"modulation": differ(table.index_select(0, table_index), s["row_modulation"])})
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
