"""The video VAE's ViT decoder run fast on diffusers' own weights: a batch of tiles per forward, one fused QKV
projection, attention on a chosen backend (by default SDPA's own pick, the kernel diffusers runs), the float32
residual stream and its norms in fused Triton kernels (or, optionally, a compiled block). With `exact_norms` the
residual norms are torch's own, and the decoder's output is diffusers' bit for bit (measured on an H200).

What diffusers' decoder costs, read from its code: one forward per tile (392 for the 10 s 1344x768 clip, each of
only 1797 tokens, so the GEMMs run far from peak and every one of the ~40 kernels per block launches 392 times per
block), three separate Q/K/V GEMMs, attention through SDPA's default pick (FA2 on Hopper), and a float32 residual
stream with its norms, casts, RoPE and scale-adds as separate elementwise passes. The numerics are kept: float32
residual and norms, Q/K normalized in float32 then rounded, RoPE in the compute dtype, as diffusers rounds them.
"""

from __future__ import annotations

import copy
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from h3gen.kernels.attention import attention, choose_backend
from h3gen.kernels.attention_fa3_fp8 import attend_fp8
from h3gen.kernels.qk_norm_rope import qk_norm_rope
from h3gen.kernels.qk_norm_rope_fp8 import qk_norm_rope_fp8
from h3gen.kernels.residual_rmsnorm import residual_rmsnorm, residual_rmsnorm_quantized
from h3gen.kernels.swiglu import swiglu, swiglu_reference
from h3gen.models.quant_linear import FP8Rows, FP8RowwiseLinear, project, swiglu_linear


class BlockWeights(NamedTuple):
    """One decoder block's norms and residual scales, and its projections as modules: `nn.Linear`, or the quant
    stage's quantized linears when it quantizes the VAE."""
    norm1: torch.Tensor
    qkv: nn.Module
    out: nn.Module
    scale1: torch.Tensor
    norm2: torch.Tensor
    up_gate: nn.Module
    down: nn.Module
    scale2: torch.Tensor


class BlockShape(NamedTuple):
    heads: int
    norm_eps: float
    qk_eps: float
    backend: str
    # The residual stream's norms (2048 channels) take their statistic from torch, rounding as diffusers' decoder
    # does. Q/K norms (64 channels, float32) need not: the Q/K kernel at its default launch shape sums them in
    # torch's order (measured on an H200, every value of the 10 s clip's decode; other launch shapes do not,
    # bench/dit_gpu_check.py's kernels phase).
    exact_norms: bool = False


def fuse_linears(linears) -> nn.Module:
    """One linear computing what `linears` (of one type, on the same input) compute, their outputs side by side.
    Every tensor of a linear (weight, per-channel weight scales, bias) is indexed by output channel first, so each
    is concatenated; the originals become views of the fused tensors, so the weights are not held twice."""
    first = linears[0]
    fused = copy.copy(first)
    fused._parameters, fused._buffers = dict(first._parameters), dict(first._buffers)
    for name in (*first._parameters, *first._buffers):
        parts = [getattr(linear, name) for linear in linears]
        if parts[0] is None:
            continue
        joined = torch.cat([part.detach() for part in parts])
        wrap = (lambda t: nn.Parameter(t, requires_grad=False)) if name in first._parameters else (lambda t: t)
        setattr(fused, name, wrap(joined))
        for linear, rows in zip(linears, joined.split([len(part) for part in parts])):
            setattr(linear, name, wrap(rows))
    fused.out_features = sum(linear.out_features for linear in linears)
    return fused


def block_weights(block) -> BlockWeights:
    attn = block.attn
    qkv = fuse_linears([attn.to_q, attn.to_k, attn.to_v])
    return BlockWeights(block.norm1.weight, qkv, attn.to_out[0], block.scale1, block.norm2.weight,
                        block.ff.net[0].proj, block.ff.net[2], block.scale2)


def rotate(x, cos, sin):
    """diffusers' rotate-half RoPE on the leading `cos.shape[-1]` channels, in `x`'s dtype."""
    rotary_dim = cos.shape[-1]
    rotary, passed = x[..., :rotary_dim], x[..., rotary_dim:]
    first, second = rotary.chunk(2, dim=-1)
    rotated = torch.cat((-second, first), dim=-1)
    return torch.cat((rotary * cos + rotated * sin, passed), dim=-1)


def block_forward(hidden, w: BlockWeights, cos, sin, shape: BlockShape):
    """One decoder block on (B, L, dim) in torch ops, the form `compile = true` hands to inductor; `cos`/`sin`
    (1, L, 1, 1, rotary_dim) in the compute dtype."""
    dtype, dim = cos.dtype, hidden.shape[-1]
    normed = F.rms_norm(hidden.float(), (dim,), w.norm1, shape.norm_eps).to(dtype)
    qkv = w.qkv(normed).unflatten(-1, (3, shape.heads, -1))
    # Q and K together: normalized in float32, rounded, rotated in the compute dtype, as diffusers does each.
    qk = F.rms_norm(qkv[:, :, :2].float(), (qkv.shape[-1],), None, shape.qk_eps).to(dtype)
    q, k = rotate(qk, cos, sin).unbind(2)
    attended = attention(q, k, qkv[:, :, 2], shape.backend).flatten(2)
    hidden = torch.addcmul(hidden.float(), w.out(attended), w.scale1)
    normed = F.rms_norm(hidden, (dim,), w.norm2, shape.norm_eps).to(dtype)
    activated = swiglu_reference(w.up_gate(normed))  # the compiled block: inductor fuses it
    return torch.addcmul(hidden, w.down(activated), w.scale2)


def fused_block_forward(hidden, normed, w: BlockWeights, next_norm, qk_weight, cos, sin, shape: BlockShape):
    """`block_forward` in fused kernels (Triton on CUDA, their torch references elsewhere), rounding as diffusers
    does: `hidden` (B, L, dim) float32 is updated in place, `normed` is this block's first norm of it in the compute
    dtype, and the return value is the norm `next_norm` asks for (the next block's first; None after the last).
    Q and K are normalized (`qk_weight`: ones) and rotated over their columns of the projection; `cos`, `sin` (L,
    rotary_dim)."""
    qkv = project(w.qkv, normed)
    attended = attend(qkv, qk_weight, cos, sin, shape).flatten(2)
    del qkv
    dtype = normed.dtype
    normed = residual_norm(hidden, w.out(attended), w.scale1, w.norm2, shape, dtype, w.up_gate)
    branch = swiglu_linear(w.down, project(w.up_gate, normed), swiglu)
    # The next block's projection is quantized as this one's is.
    return residual_norm(hidden, branch, w.scale2, next_norm, shape, dtype, w.qkv)


def attend(qkv, qk_weight, cos, sin, shape: BlockShape):
    """Q and K normed and rotated over their part of the projection `qkv`, then attention. On fa3-fp8 the norm
    kernel writes q, k and v in e4m3 (q's and k's scales bounded by the norm, as in the DiT) instead of bf16 heads
    that attention would read again to scale and quantize."""
    args = (qkv, shape.heads, qk_weight, qk_weight, shape.qk_eps, cos, sin)
    if choose_backend(qkv.device, shape.backend, qkv.dtype, qk_weight.shape[0]).name == "fa3-fp8":
        return attend_fp8(qk_norm_rope_fp8(*args))
    q, k, v = qk_norm_rope(*args, in_place=True)
    return attention(q, k, v, shape.backend)


def residual_norm(hidden, branch, scale, norm_weight, shape: BlockShape, dtype, into=None):
    """`hidden += branch * scale` in place, then `norm_weight`'s RMSNorm of it in `dtype` (None without a norm):
    as FP8 rows from the same kernel when the linear it goes `into` is an FP8 one."""
    if not shape.exact_norms:
        if norm_weight is not None and isinstance(into, FP8RowwiseLinear):
            rows, row_scale = residual_rmsnorm_quantized(hidden, branch, scale, norm_weight, shape.norm_eps, dtype)
            return FP8Rows(rows, row_scale, hidden.shape, dtype)
        return residual_rmsnorm(hidden, branch, scale, norm_weight, shape.norm_eps, dtype)
    residual_rmsnorm(hidden, branch, scale)
    if norm_weight is None:
        return None
    return F.rms_norm(hidden, (hidden.shape[-1],), norm_weight, shape.norm_eps).to(dtype)


class FastViTDecoder:
    """`post_quant_conv` + ViT decoder of a loaded `AutoencoderKLMiniMaxH3`, on (B, C, T, h, w) latent tiles."""

    def __init__(self, vae, backend: str = "auto", compile: bool = False, exact_norms: bool = False):
        decoder = vae.decoder
        self.vae, self.decoder = vae, decoder
        blocks = decoder.transformer_blocks
        self.weights = [block_weights(block) for block in blocks]
        attn = blocks[0].attn
        self.shape = BlockShape(attn.heads, blocks[0].norm1.eps, attn.norm_q.eps, backend, exact_norms)
        # The compute dtype: the projections' bias keeps it when the quant stage quantizes their weights.
        self.dtype = attn.to_q.bias.dtype
        self.rotary_tables = {}
        # Compiled: inductor fuses `block_forward`'s reference ops. Eager: h3gen's fused kernels.
        self.block = torch.compile(block_forward, dynamic=False) if compile else None
        # The decoder's Q/K norms have no weight: the fused kernel gets ones.
        self.qk_weight = torch.ones(attn.dim_head, device=attn.to_q.bias.device)

    def attention_used(self) -> str:
        """The backend the blocks run, with the reason when it is not the one asked for."""
        return choose_backend(self.qk_weight.device, self.shape.backend, self.dtype, self.qk_weight.shape[0]).describe()

    def rotary(self, frames: int, height: int, width: int, device, dtype):
        """cos, sin for one tile's token grid plus the register and zero tokens (all at position 0)."""
        key = (frames, height, width, str(device), dtype)
        if key not in self.rotary_tables:
            self.rotary_tables[key] = self._rotary(frames, height, width, device, dtype)
        return self.rotary_tables[key]

    def _rotary(self, frames, height, width, device, dtype):
        grids = [2.0 * (torch.arange(0.5, size, dtype=torch.float32, device=device) / size) - 1.0
                 for size in (frames, height, width)]
        positions = torch.stack(torch.meshgrid(*grids, indexing="ij"), dim=-1).flatten(0, 2)
        suffix = positions.new_zeros((self.decoder.num_register_tokens + 1, 3))
        cos, sin = self.decoder.rope(torch.cat([positions, suffix])[None])
        return cos.to(dtype).unsqueeze(2), sin.to(dtype).unsqueeze(2)

    def fused_blocks(self, hidden, cos, sin, dtype):
        """Every block on the float32 residual stream `hidden`, updated in place (and returned)."""
        normed = F.rms_norm(hidden, (hidden.shape[-1],), self.weights[0].norm1, self.shape.norm_eps).to(dtype)
        cos, sin = cos.reshape(-1, cos.shape[-1]), sin.reshape(-1, sin.shape[-1])
        for index, weights in enumerate(self.weights):
            next_norm = self.weights[index + 1].norm1 if index + 1 < len(self.weights) else None
            normed = fused_block_forward(hidden, normed, weights, next_norm, self.qk_weight, cos, sin, self.shape)
        return hidden

    def __call__(self, latents):
        decoder = self.decoder
        latents = self.vae.post_quant_conv(latents.to(self.vae.post_quant_conv.weight.dtype))
        batch, channels, frames, height, width = latents.shape
        tokens = decoder.proj_in(latents.permute(0, 2, 3, 4, 1).reshape(batch, -1, channels))
        patches = tokens.shape[1]
        registers = decoder.register_tokens.expand(batch, -1, -1).to(tokens.dtype)
        hidden = torch.cat([tokens, registers, tokens.new_zeros((batch, 1, tokens.shape[-1]))], dim=1)
        dtype = self.dtype
        cos, sin = self.rotary(frames, height, width, latents.device, dtype)
        if self.block is not None:
            for weights in self.weights:
                hidden = self.block(hidden, weights, cos, sin, self.shape)
        else:
            hidden = self.fused_blocks(hidden.float(), cos, sin, dtype)
        hidden = decoder.proj_out(decoder.norm_out(hidden).to(decoder.proj_out.weight.dtype))[:, :patches]
        p, pt = decoder.patch_size, decoder.patch_size_t
        hidden = hidden.view(batch, frames, height, width, decoder.out_channels, pt, p, p)
        return hidden.permute(0, 4, 1, 5, 2, 6, 3, 7).reshape(batch, decoder.out_channels, frames * pt,
                                                                height * p, width * p)
