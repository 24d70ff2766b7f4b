"""Where h3gen's fast video decoder departs from diffusers' on the GPU: decoder block 0 at full width, op by op.

Usage (diffusers importable; h3gen installed):
    python3 bench/vae_numerics.py [--tiny]
Builds the full-size AutoencoderKLMiniMaxH3 (random weights as vae_gpu_check.py draws them), decodes one batch of the
fast stage's latent tiles at the 10 s clip's shape (16 tiles of 7 latent frames of 16 x 16), runs decoder block 0 op
by op the way diffusers' block does, then feeds each of h3gen's ops diffusers' own inputs and prints, per op, the relative L2 error and the
fraction of values that differ at all, with and without torch's norm statistics handed to the kernels; and the whole
decoder's output on the batch, both ways.
Results: $OUT/vae_numerics.json.
"""
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
import vae_gpu_check as check  # noqa: E402
from op_diff import differ, results_log  # noqa: E402

OUT = Path(os.environ.get("OUT", "."))
log = results_log("vae_numerics.json")


def diffusers_block(block, hidden, rotary):
    """diffusers' MiniMaxH3VideoTransformerBlock.forward and its attention processor split into their ops."""
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    s, attn, dtype = {}, block.attn, block.attn.to_q.weight.dtype
    s["norm1"] = block.norm1(hidden.float()).to(dtype)
    q, k, s["v"] = (lin(s["norm1"]).unflatten(2, (attn.heads, -1)) for lin in (attn.to_q, attn.to_k, attn.to_v))
    s["qkv"] = torch.cat([q, k, s["v"]], dim=2).flatten(2)
    q, k = attn.norm_q(q.float()).to(dtype), attn.norm_k(k.float()).to(dtype)
    cos, sin = (t.to(dtype) for t in rotary)
    half = cos.shape[-1]
    for name, x in (("q", q), ("k", k)):
        first, second = x[..., :half].chunk(2, dim=-1)
        rotated = torch.cat([-second, first], dim=-1)
        s[name] = torch.cat([x[..., :half] * cos + rotated * sin, x[..., half:]], dim=-1)
    s["attended"] = dispatch_attention_fn(s["q"], s["k"], s["v"], attn_mask=None).flatten(2, 3)
    s["attn_out"] = attn.to_out[0](s["attended"])
    s["hidden1"] = hidden + s["attn_out"] * block.scale1
    s["norm2"] = block.norm2(s["hidden1"].float()).to(dtype)
    s["up_gate"] = block.ff.net[0].proj(s["norm2"])
    s["swiglu"] = block.ff.net[0](s["norm2"])
    s["ff_out"] = block.ff(s["norm2"])
    s["hidden2"] = s["hidden1"] + s["ff_out"] * block.scale2
    return s


def main():
    torch.set_grad_enabled(False)
    args = type("Args", (), dict(tiny="--tiny" in sys.argv, output=str(OUT / "vae_numerics_build.json")))()
    bench = check.Bench(args)
    vae = check.build_vae(bench)
    if not bench.tiny:  # the fast decoder's compute dtype; the checkpoint's float32 islands stay
        vae.to(torch.bfloat16)
        keep = set(vae._keep_in_fp32_modules)
        for name, param in vae.named_parameters():
            if keep & set(name.split(".")):
                param.data = param.data.float()
    from h3gen.kernels.attention import attention
    from h3gen.kernels.norm_statistic import torch_rstd
    from h3gen.kernels.qk_norm_rope import qk_norm_rope
    from h3gen.kernels.residual_rmsnorm import residual_rmsnorm
    from h3gen.kernels.swiglu import swiglu
    from h3gen.models.vae.vit import FastViTDecoder

    size, batch = (4, 2) if bench.tiny else (16, 16)  # the fast stage's tile batch on an H200
    tiles = torch.randn(batch, 24, 7, size, size, device=bench.device)
    captured = {}
    block = vae.decoder.transformer_blocks[0]
    hook = block.register_forward_hook(lambda m, a, out: captured.update(hidden=a[0].clone(), rotary=a[1],
                                                                         out=out.clone()))
    decoded = vae.decoder(vae.post_quant_conv(tiles.to(vae.post_quant_conv.weight.dtype)))
    hook.remove()
    s = diffusers_block(block, captured["hidden"], captured["rotary"])
    log("diffusers_ops_reproduce_block", differ(s["hidden2"], captured["out"]))
    fast = FastViTDecoder(vae, backend="sdpa")
    w, shape = fast.weights[0], fast.shape
    frames, height, width = tiles.shape[2:]
    cos, sin = (t.reshape(-1, t.shape[-1]) for t in fast.rotary(frames, height, width, tiles.device, fast.dtype))
    log("rotary", dict(cos=differ(cos, captured["rotary"][0][0, :, 0].to(cos.dtype)),
                       sin=differ(sin, captured["rotary"][1][0, :, 0].to(sin.dtype))))
    log("qkv (fused GEMM)", differ(w.qkv(s["norm1"]), s["qkv"]))
    for label, exact in (("", False), (" exact norms", True)):
        qkv = s["qkv"].clone()
        rstd = None
        if exact:
            rstd = tuple(torch_rstd(t.unflatten(-1, (shape.heads, -1)).float(), shape.qk_eps)
                         for t in qkv.chunk(3, dim=-1)[:2])
        q, k, v = qk_norm_rope(qkv, shape.heads, fast.qk_weight, fast.qk_weight, shape.qk_eps, cos, sin,
                               in_place=True, rstd=rstd)
        log(f"q (qk_norm_rope{label})", differ(q, s["q"]))
        log(f"k (qk_norm_rope{label})", differ(k, s["k"]))
    for name in ("sdpa", "sdpa-cudnn", "sdpa-flash"):
        try:
            log(f"attended ({name}, contiguous)", differ(attention(s["q"], s["k"], s["v"], name).flatten(2),
                                                         s["attended"]))
            qkv = torch.cat([s["q"], s["k"], s["v"]], dim=2).flatten(2)
            views = [t.unflatten(-1, (shape.heads, -1)) for t in qkv.chunk(3, dim=-1)]
            log(f"attended ({name}, projection views)", differ(attention(*views, name).flatten(2), s["attended"]))
        except Exception as exc:
            log(f"attended ({name}) error", repr(exc)[:200])
    log("attn_out (GEMM)", differ(w.out(s["attended"]), s["attn_out"]))
    hidden = captured["hidden"].float().clone()
    normed = residual_rmsnorm(hidden, s["attn_out"], w.scale1, w.norm2, shape.norm_eps, s["norm2"].dtype)
    log("hidden1 (residual_rmsnorm)", differ(hidden, s["hidden1"]))
    log("norm2 (residual_rmsnorm)", differ(normed, s["norm2"]))
    log("norm2 (torch on hidden1)", differ(F.rms_norm(s["hidden1"], (hidden.shape[-1],), w.norm2, shape.norm_eps)
                                           .to(s["norm2"].dtype), s["norm2"]))
    log("up_gate (fused GEMM)", differ(w.up_gate(s["norm2"]), s["up_gate"]))
    log("swiglu", differ(swiglu(s["up_gate"]), s["swiglu"]))
    log("ff_out (GEMM)", differ(w.down(s["swiglu"]), s["ff_out"]))
    hidden = s["hidden1"].float().clone()
    residual_rmsnorm(hidden, s["ff_out"], w.scale2)
    log("hidden2 (residual add)", differ(hidden, s["hidden2"]))
    for exact in (False, True):
        whole = FastViTDecoder(vae, backend="sdpa", exact_norms=exact)(tiles)
        log(f"decoder output{' (exact norms)' if exact else ''}", differ(whole, decoded))
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
