"""Quantized stand-ins for `nn.Linear`, swapped in one module at a time (the gpt-fast way).

Weights get one scale per output channel, computed on the device the weight already sits on. The swap walks the
model by name and replaces one Linear before touching the next, so besides the model itself memory only ever
holds one module's quantized copy and a bounded fp32 working slice: never a second copy of the model.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from h3gen.kernels.quantize_rows import quantize_rows

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
INT8_MAX = 127
ROWS_PER_SLICE = 4096  # weight rows turned to fp32 at once while quantizing: bounds the working copy


def quantize_weight(weight: torch.Tensor, qmax: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(quantized weight, fp32 scale per output channel): weight ~= quantized * scale[:, None]."""
    quantized = torch.empty(weight.shape, dtype=dtype, device=weight.device)
    scale = torch.empty(weight.shape[0], dtype=torch.float32, device=weight.device)
    for start in range(0, weight.shape[0], ROWS_PER_SLICE):
        rows = weight[start:start + ROWS_PER_SLICE].float()
        row_scale = rows.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / qmax
        scaled = (rows / row_scale).clamp(-qmax, qmax)
        quantized[start:start + ROWS_PER_SLICE] = scaled.round() if dtype == torch.int8 else scaled
        scale[start:start + ROWS_PER_SLICE] = row_scale[:, 0]
    return quantized, scale


def frozen(tensor: torch.Tensor) -> nn.Parameter:
    """A quantized weight or its scales as a parameter, not a buffer: what moves a model's weights between devices
    moves these too (diffusers' group offloading, with a side stream, returns a module's parameters to host memory
    after it runs but leaves its buffers on the device)."""
    return nn.Parameter(tensor, requires_grad=False)


class FP8RowwiseLinear(nn.Module):
    """y = x W^T + b with W in fp8 e4m3 (scale per output channel) and x quantized per row on the fly.

    `matmul="scaled_mm"` runs `torch._scaled_mm` (Hopper); `"reference"` dequantizes into an fp32 matmul with the
    same rounding, for machines without fp8 tensor cores and for checking numerics. `fast_accum` lets the Hopper
    GEMM keep its partial sums in the tensor cores' own precision instead of promoting them to fp32 as it goes
    (faster, a little less accurate; the reference path has no such mode). The fp8 weight is stored as its bytes
    (uint8) so that casting the whole model (`model.to(torch.bfloat16)`) cannot reinterpret it.
    """

    def __init__(self, in_features: int, out_features: int, weight_bits, weight_scale, bias, matmul: str,
                 fast_accum: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        # The bias is registered first: diffusers reads a module's dtype from its first floating parameter.
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None
        self.weight_bits, self.weight_scale = frozen(weight_bits), frozen(weight_scale)
        if matmul == "scaled_mm" and (in_features % 16 or out_features % 16):
            matmul = "reference"  # _scaled_mm needs both weight dimensions in multiples of 16
        self.matmul, self.fast_accum = matmul, fast_accum

    @classmethod
    def from_linear(cls, linear: nn.Linear, matmul: str, fast_accum: bool = False) -> FP8RowwiseLinear:
        quantized, scale = quantize_weight(linear.weight.detach(), FP8_MAX, FP8)
        bias = linear.bias.detach() if linear.bias is not None else None
        return cls(linear.in_features, linear.out_features, quantized.view(torch.uint8), scale, bias, matmul,
                   fast_accum)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows, row_scale = quantize_rows(x.reshape(-1, self.in_features))
        return self.project(rows, row_scale, x.dtype).reshape(*x.shape[:-1], self.out_features)

    def project(self, rows: torch.Tensor, row_scale: torch.Tensor, dtype: torch.dtype,
                out: torch.Tensor | None = None) -> torch.Tensor:
        """(M, out_features) in `dtype` from activations already quantized: fp8 `rows` (M, in_features) and their
        fp32 scales (M, 1), as `quantize_rows` makes them. With `out` (M, out_features), contiguous, the product is
        written there (by the GEMM itself on Hopper) and `out` returned."""
        weight, bias = self.weight_bits.view(FP8), self.bias
        # The bias is added to the float32 product before its one rounding, in the GEMM's epilogue on Hopper.
        if self.matmul == "scaled_mm":
            # Row-wise scaling wants bf16 out (and a bf16 bias), the weight column-major (a transposed row-major
            # tensor is) and scales shaped (M, 1) and (1, N).
            args = (rows, weight.t())
            options = dict(scale_a=row_scale, scale_b=self.weight_scale[None, :], out_dtype=torch.bfloat16,
                           bias=None if bias is None else bias.to(torch.bfloat16), use_fast_accum=self.fast_accum)
            if out is not None and out.dtype == torch.bfloat16:
                return torch._scaled_mm(*args, **options, out=out)
            product = torch._scaled_mm(*args, **options).to(dtype)
        else:
            product = F.linear(rows.float(), weight.float()) * row_scale * self.weight_scale[None, :]
            product = (product if bias is None else product + bias.float()).to(dtype)
        return product if out is None else out.copy_(product)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, matmul={self.matmul}"
                + (", fast_accum" if self.fast_accum else ""))


class FP8Rows(NamedTuple):
    """Activation rows a kernel already wrote in FP8 for an FP8 linear: e4m3 `rows` (M, K) and their fp32 `scale`
    (M, 1), as `quantize_rows` makes them, standing for a tensor of `shape` in `dtype`."""

    rows: torch.Tensor
    scale: torch.Tensor
    shape: torch.Size
    dtype: torch.dtype

    def part(self, start: int, stop: int) -> FP8Rows:
        """Rows `start:stop` along the second-last axis of `shape`, as `x[..., start:stop, :]` would take them: each
        row keeps its own scale, so a part is exactly what quantizing that part gives."""
        lead, width = self.shape[:-1], self.shape[-1]
        rows = self.rows.view(*lead, width)[..., start:stop, :]
        # The scales copied (4 bytes a row): a GEMM's scale vector wants an aligned start, which a view at any row
        # does not give.
        scale = self.scale.view(*lead, 1)[..., start:stop, :].clone()
        return FP8Rows(rows.reshape(-1, width), scale.reshape(-1, 1), torch.Size((*rows.shape[:-1], width)),
                       self.dtype)


def project(linear: nn.Module, x) -> torch.Tensor:
    """`linear(x)`; FP8 rows go to their FP8 linear as they are."""
    if isinstance(x, FP8Rows):
        return linear.project(x.rows, x.scale, x.dtype).reshape(*x.shape[:-1], linear.out_features)
    return linear(x)


def swiglu_linear(linear: nn.Module, up_gate: torch.Tensor, swiglu, out: torch.Tensor | None = None) -> torch.Tensor:
    """`linear(swiglu(up_gate))`, written into `out` (of the result's shape) when given. An FP8 linear gets h3gen's
    SwiGLU as FP8 rows from one fused kernel: the values `quantize_rows` gives on the SwiGLU's output, without that
    output ever being written; its GEMM writes a contiguous `out` itself."""
    if isinstance(linear, FP8RowwiseLinear):
        from h3gen.kernels.swiglu import swiglu_quantized

        rows, row_scale = swiglu_quantized(up_gate)
        if out is not None and out.is_contiguous():
            linear.project(rows, row_scale, up_gate.dtype, out.view(-1, linear.out_features))
            return out
        result = linear.project(rows, row_scale, up_gate.dtype).reshape(*up_gate.shape[:-1], linear.out_features)
    else:
        result = linear(swiglu(up_gate))
    return result if out is None else out.copy_(result)


class Int8WeightOnlyLinear(nn.Module):
    """y = (x W_int8^T) * scale + b: int8 storage, the matmul in the activation's dtype. Works on any device."""

    def __init__(self, in_features: int, out_features: int, weight_int8, weight_scale, bias):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None
        self.weight_int8, self.weight_scale = frozen(weight_int8), frozen(weight_scale)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8WeightOnlyLinear:
        quantized, scale = quantize_weight(linear.weight.detach(), INT8_MAX, torch.int8)
        bias = linear.bias.detach() if linear.bias is not None else None
        return cls(linear.in_features, linear.out_features, quantized, scale, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight_int8.to(x.dtype)) * self.weight_scale.to(x.dtype)
        return out + self.bias.to(x.dtype) if self.bias is not None else out

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


def in_scope(name: str, scopes) -> bool:
    """Whether module `name` lies under one of `scopes` (dotted module paths matched on whole name parts)."""
    return any(f".{scope}." in f".{name}." for scope in scopes)


def swap_linears(model: nn.Module, make, scopes, skip, prefix: str = "") -> list[str]:
    """Replace every nn.Linear under `scopes` whose name has no part in `skip` by `make(linear)`; returns the names.
    `model` may be a part of the whole one, at `prefix` (a block: "transformer_blocks.3"): names are matched and
    returned as in the whole model.

    Only names are collected up front: each Linear is looked up, replaced and dropped before the next, so its
    full-precision weight is freed as soon as its quantized copy exists.
    """
    skip = set(skip)
    names = [name for name, module in model.named_modules()  # a weight still on the meta device is one to be dropped
             if isinstance(module, nn.Linear) and not module.weight.is_meta and in_scope(f"{prefix}.{name}", scopes)
             and not skip & set(f"{prefix}.{name}".split("."))]
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, child, make(getattr(parent, child)))
    return [f"{prefix}.{name}" if prefix else name for name in names]
