"""Building blocks of h3gen's MiniMax-H3 DiT: fused projections, one op set per kernel switch."""
import math
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

from h3gen.kernels.attention import attention, choose_backend
from h3gen.kernels.attention_fa3_fp8 import attend_fp8
from h3gen.kernels.gated_residual import gated_residual, gated_residual_reference
from h3gen.kernels.norm_statistic import torch_rstd
from h3gen.kernels.qk_norm_rope import qk_norm_rope, qk_norm_rope_reference, split_qkv
from h3gen.kernels.qk_norm_rope_fp8 import qk_norm_rope_fp8
from h3gen.kernels.rmsnorm_modulate import (gated_residual_rmsnorm_modulate, rmsnorm_modulate,
                                            rmsnorm_modulate_quantized, rmsnorm_modulate_reference)
from h3gen.kernels.swiglu import swiglu, swiglu_reference
from h3gen.models.dit.tags import MODALITIES
from h3gen.models.quant_linear import FP8Rows, FP8RowwiseLinear, project, swiglu_linear

# Each packed row picks its AdaLN row by (timestep, modality): 0 video, 1 text, 2 audio.

# `qk_norm_rope_fp8`: the kernel that writes q, k, v in e4m3 for fa3-fp8 (None: attention quantizes bf16 inputs).
# `rmsnorm_modulate_fp8`: the norm that writes an FP8 linear's input rows directly (None: the linear quantizes them).
# `gated_residual_norm`: a gated residual add and the modulated norm of its sum in one pass (None: the two ops).
REFERENCE_OPS = SimpleNamespace(rmsnorm_modulate=rmsnorm_modulate_reference, gated_residual=gated_residual_reference,
                                qk_norm_rope=qk_norm_rope_reference, swiglu=swiglu_reference, qk_norm_rope_fp8=None,
                                rmsnorm_modulate_fp8=None, gated_residual_norm=None)
TRITON_OPS = SimpleNamespace(rmsnorm_modulate=rmsnorm_modulate, gated_residual=gated_residual,
                             qk_norm_rope=qk_norm_rope, swiglu=swiglu, qk_norm_rope_fp8=qk_norm_rope_fp8,
                             rmsnorm_modulate_fp8=rmsnorm_modulate_quantized,
                             gated_residual_norm=gated_residual_rmsnorm_modulate)


def rmsnorm_modulate_exact(x, weight, eps, *modulation):
    return rmsnorm_modulate(x, weight, eps, *modulation, rstd=torch_rstd(x, eps))


def qk_norm_rope_exact(qkv, heads, q_weight, k_weight, eps, cos=None, sin=None, in_place=False):
    q, k, _ = split_qkv(qkv, heads)
    return qk_norm_rope(qkv, heads, q_weight, k_weight, eps, cos, sin, in_place,
                        rstd=(torch_rstd(q, eps), torch_rstd(k, eps)))


# The Triton kernels with every norm's statistic computed by torch: the forward rounds exactly as diffusers' does, so
# with the same attention kernel the two are bit-equal, for one more read of each normed tensor.
EXACT_NORM_OPS = SimpleNamespace(rmsnorm_modulate=rmsnorm_modulate_exact, gated_residual=gated_residual,
                                 qk_norm_rope=qk_norm_rope_exact, swiglu=swiglu, qk_norm_rope_fp8=None,
                                 rmsnorm_modulate_fp8=None, gated_residual_norm=None)


def fp8_input(ops, linear) -> bool:
    """Whether `linear` takes a norm as FP8 rows written by the norm kernel itself."""
    return isinstance(linear, FP8RowwiseLinear) and ops.rmsnorm_modulate_fp8 is not None


class Normed:
    """A block's modulated norm of `x`, not yet computed: the linear that takes it decides how. An FP8 linear with
    `ops.rmsnorm_modulate_fp8` gets its input rows in FP8 from the norm kernel itself (the values `quantize_rows`
    makes of the bf16 norm, so the product is the same bit for bit); any other linear gets the bf16 norm."""

    def __init__(self, ops, x, *norm):
        self.ops, self.x, self.norm, self.shape = ops, x, norm, x.shape

    def tensor(self):
        return self.ops.rmsnorm_modulate(self.x, *self.norm)

    def input_for(self, linear):
        """The norm as `linear` takes it: FP8 rows from the norm kernel for an FP8 linear, else the bf16 tensor."""
        if fp8_input(self.ops, linear):
            rows, scale = self.ops.rmsnorm_modulate_fp8(self.x, *self.norm)
            return FP8Rows(rows, scale, self.x.shape, self.x.dtype)
        return self.tensor()

    def into(self, linear):
        return project(linear, self.input_for(linear))


def gated_residual_normed(ops, x, branch, gate_chunk, linear, weight, eps, modulation, row_index, shift_chunk,
                          scale_chunk):
    """(x + gate * branch, the modulated norm of that sum for `linear`). With `ops.gated_residual_norm` one kernel
    writes the sum and the norm as `linear` takes it (the values of the two ops, the sum not read back); without,
    the sum and a `Normed` of it."""
    if ops.gated_residual_norm is None:
        x = ops.gated_residual(x, branch, modulation, row_index, gate_chunk)
        return x, Normed(ops, x, weight, eps, modulation, row_index, shift_chunk, scale_chunk)
    fp8 = fp8_input(ops, linear)
    x, normed = ops.gated_residual_norm(x, branch, modulation, row_index, gate_chunk, weight, eps, shift_chunk,
                                        scale_chunk, fp8=fp8)
    return x, FP8Rows(*normed, x.shape, x.dtype) if fp8 else normed


def take(linear, x):
    """`linear(x)` for a tensor or FP8 rows, `x.into(linear)` for a norm not yet computed."""
    return x.into(linear) if isinstance(x, Normed) else project(linear, x)


def rotary_angles(position_ids, inv_freq):
    """(L, 3) (t, h, w) positions -> cos, sin (L, 6 * len(inv_freq)), in diffusers' op order so fp32 is bit-equal."""
    freqs = position_ids.to(torch.float32).unsqueeze(-1) * inv_freq.view(1, 1, -1)
    freqs = torch.cat(freqs.unbind(dim=1), dim=-1)
    freqs = torch.cat((freqs, freqs), dim=-1)
    return freqs.cos(), freqs.sin()


def rotary_inv_freq(rope_freq_dim, rope_theta):
    # Built on the CPU like the reference buffer: pow differs in the last ulp between devices.
    return 1.0 / (rope_theta ** (torch.arange(0, 2 * rope_freq_dim, 2, dtype=torch.float32) / (2 * rope_freq_dim)))


class TimeEmbedding(nn.Module):
    """Unscaled timesteps in [0, 1] -> sinusoidal (cos, sin) features -> MLP; kept fp32 like the checkpoint."""

    def __init__(self, freq_dim, hidden_dim, out_dim):
        super().__init__()
        self.freq_dim = freq_dim
        self.linear_1 = nn.Linear(freq_dim, hidden_dim)
        self.linear_2 = nn.Linear(hidden_dim, out_dim)

    def forward(self, timesteps):
        half = self.freq_dim // 2
        exponent = -math.log(10000) * torch.arange(half, dtype=torch.float32, device=timesteps.device) / half
        angles = timesteps[:, None].float() * torch.exp(exponent)[None, :]
        features = torch.cat([torch.cos(angles), torch.sin(angles)], dim=-1)
        features = features.to(self.linear_1.weight.dtype)
        return self.linear_2(F.silu(self.linear_1(features)))


class FusedAttention(nn.Module):
    def __init__(self, hidden_size, heads, head_dim, qk_norm_eps):
        super().__init__()
        self.heads = heads
        self.to_qkv = nn.Linear(hidden_size, 3 * heads * head_dim, bias=False)
        self.norm_q = nn.RMSNorm(head_dim, eps=qk_norm_eps)
        self.norm_k = nn.RMSNorm(head_dim, eps=qk_norm_eps)
        self.to_out = nn.Linear(heads * head_dim, hidden_size, bias=False)
        # With fa3-fp8, q, k and v leave the norm kernel in e4m3 (q's and k's scales bounded by the norm's weight:
        # as accurate as scales from each head's largest value and 3 % faster per forward, README). False: they
        # leave it in bf16 and attention scales each head by its largest value, which a sequence-parallel attend
        # needs (h3gen.parallel.ulysses turns this off).
        self.fp8_from_norm = True

    def forward(self, x, cos, sin, ops, backend):
        qkv = take(self.to_qkv, x)
        del x  # a caller that passes the normed rows straight in gets them freed before attention
        if backend == "fa3-fp8" and self.fp8_from_norm and ops.qk_norm_rope_fp8 is not None:
            return self.to_out(self.attend_from_fp8_norm(qkv, cos, sin, ops))
        # q and k are normalized and rotated over their own part of the projection, where the kernel runs.
        q, k, v = ops.qk_norm_rope(qkv, self.heads, self.norm_q.weight, self.norm_k.weight, self.norm_q.eps, cos,
                                   sin, in_place=True)
        del qkv
        attended = self.attend(q, k, v, backend).flatten(2, 3).type_as(q)
        del q, k, v  # the projection is freed before the output GEMM
        return self.to_out(attended)

    @torch.compiler.disable
    def attend_from_fp8_norm(self, qkv, cos, sin, ops):
        """fa3-fp8 on the norm kernel's e4m3 output; where fa3 cannot run, the backend it falls back to on bf16."""
        args = (qkv, self.heads, self.norm_q.weight, self.norm_k.weight, self.norm_q.eps, cos, sin)
        choice = choose_backend(qkv.device, "fa3-fp8", qkv.dtype, self.norm_q.weight.shape[0])
        if choice.name != "fa3-fp8":
            q, k, v = ops.qk_norm_rope(*args, in_place=True)
            return self.attend(q, k, v, choice.name).flatten(2, 3).type_as(q)
        return attend_fp8(ops.qk_norm_rope_fp8(*args)).flatten(2, 3).to(qkv.dtype)

    def attend(self, q, k, v, backend):
        """The one step that mixes rows: a sequence-parallel form replaces it (h3gen.parallel.ulysses)."""
        return attention(q, k, v, backend)


class SwiGLUFeedForward(nn.Module):
    def __init__(self, hidden_size, ffn_dim):
        super().__init__()
        self.up_gate = nn.Linear(hidden_size, 2 * ffn_dim, bias=False)
        self.down = nn.Linear(ffn_dim, hidden_size, bias=False)
        # Rows per pass (0: all at once). The (rows, 2 * ffn_dim) projection is the largest activation of a block,
        # 4.2 GB at the 10 s clip; passes of 16k rows hold a quarter of it. A GEMM may round differently by its row
        # count, so chunked output is not bit-equal to the reference's.
        self.chunk_rows = 0

    def forward(self, x, ops):
        rows = x.shape[-2]
        if not self.chunk_rows or rows <= self.chunk_rows:
            return swiglu_linear(self.down, take(self.up_gate, x), ops.swiglu)
        if isinstance(x, Normed):  # FP8 rows for the whole sequence at once, a byte a value, then taken in parts
            x = x.input_for(self.up_gate)
        like = x.rows if isinstance(x, FP8Rows) else x
        out = like.new_empty((*x.shape[:-1], self.down.out_features), dtype=x.dtype)
        for start in range(0, rows, self.chunk_rows):
            stop = start + self.chunk_rows
            part = x.part(start, stop) if isinstance(x, FP8Rows) else x[..., start:stop, :]
            swiglu_linear(self.down, project(self.up_gate, part), ops.swiglu, out=out[..., start:stop, :])
        return out


class RefinerBlock(nn.Module):
    """Plain pre-norm block over the text rows: no AdaLN, no rotary embedding."""

    def __init__(self, cfg):
        super().__init__()
        self.norm1 = nn.RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.attn = FusedAttention(cfg.hidden_size, cfg.num_attention_heads, cfg.attention_head_dim, cfg.qk_norm_eps)
        self.norm2 = nn.RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.ff = SwiGLUFeedForward(cfg.hidden_size, cfg.ffn_dim)
        self.ops, self.attention_backend = REFERENCE_OPS, "auto"

    def forward(self, x):
        ops = self.ops
        h = ops.rmsnorm_modulate(x, self.norm1.weight, self.norm1.eps)
        x = ops.gated_residual(x, self.attn(h, None, None, ops, self.attention_backend))
        h = ops.rmsnorm_modulate(x, self.norm2.weight, self.norm2.eps)
        return ops.gated_residual(x, self.ff(h, ops))


class H3Block(nn.Module):
    """Pre-norm self-attention + SwiGLU, both modulated by per-row AdaLN rows of `modulation`.

    `modulation` is (rows, 6 * hidden) in (shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp) order,
    either computed from `temb` by `adaln_rows` or read from the precomputed `adaln_table`.
    """

    def __init__(self, cfg):
        super().__init__()
        self.hidden_size = cfg.hidden_size
        self.norm1 = nn.RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.attn = FusedAttention(cfg.hidden_size, cfg.num_attention_heads, cfg.attention_head_dim, cfg.qk_norm_eps)
        self.norm2 = nn.RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.ff = SwiGLUFeedForward(cfg.hidden_size, cfg.ffn_dim)
        self.adaln_proj = nn.Linear(cfg.time_embed_dim, 6 * cfg.hidden_size * MODALITIES)
        self.register_buffer("adaln_table", None, persistent=False)
        self.ops, self.attention_backend = REFERENCE_OPS, "auto"

    def adaln_rows(self, temb, weight=None, bias=None):
        """(n_timesteps, time_embed_dim) fp32 -> (n_timesteps * MODALITIES, 6 * hidden) in the projection's dtype."""
        if weight is None:
            weight, bias = self.adaln_proj.weight, self.adaln_proj.bias
        # silu at temb's fp32 precision, cast after: the reference rounds only the projection's input.
        return F.linear(F.silu(temb).to(weight.dtype), weight, bias).view(-1, 6 * self.hidden_size)

    def forward(self, x, modulation, adaln_index, cos, sin):
        ops = self.ops
        # The normed rows go straight into attention's projection, which frees them once projected.
        attended = self.attn(Normed(ops, x, self.norm1.weight, self.norm1.eps, modulation, adaln_index, 0, 1),
                             cos, sin, ops, self.attention_backend)
        x, h = gated_residual_normed(ops, x, attended, 2, self.ff.up_gate, self.norm2.weight, self.norm2.eps,
                                     modulation, adaln_index, 3, 4)
        del attended
        return ops.gated_residual(x, self.ff(h, ops), modulation, adaln_index, 5)


class OutputNorm(nn.Module):
    """Final RMSNorm, shift/scale modulated per timestep (not per modality)."""

    def __init__(self, cfg):
        super().__init__()
        self.norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.final_norm_eps)
        self.linear = nn.Linear(cfg.time_embed_dim, 2 * cfg.hidden_size)

    def forward(self, x, temb, timestep_indices, ops):
        modulation = self.linear(F.silu(temb).to(self.linear.weight.dtype))
        return ops.rmsnorm_modulate(x, self.norm.weight, self.norm.eps, modulation, timestep_indices, 0, 1)
