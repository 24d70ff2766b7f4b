"""Quantization: a load-time transform of the modules other stages load, adapters fused first.

The stage that loads a model hands it to `transform(role, module)` ('dit', 'text_encoder' or 'vae'). The preset's
adapters are fused into the DiT's full-precision weights, then the Linears of the transformer blocks are swapped
for quantized ones where they sit (on the GPU when the model was loaded there), one module at a time. The
checkpoint's fp32 modules (patch projections, time embedder, output heads), the norms, the text encoder's vision
tower and lm_head stay as loaded; so does everything a config lists in `skip`. The video VAE's decoder blocks are
quantized only when `roles` names 'vae': its frames then differ from diffusers' by a tolerance stated in the README.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from h3gen.errors import UsageError
from h3gen.stages.base import Stage

ROLES = ("dit", "text_encoder", "vae")
DEFAULT_ROLES = ("dit", "text_encoder")
# Where the quantized Linears live, per role: the DiT's block stacks, the language layers of Qwen3-VL, the blocks of
# the video VAE's ViT decoder.
SCOPES = {"dit": ("transformer_blocks", "token_refiner"), "text_encoder": ("language_model.layers",),
          "vae": ("decoder.transformer_blocks",)}
MATMULS = ("auto", "scaled_mm", "reference")


@dataclasses.dataclass
class NoQuantConfig:
    pass


@dataclasses.dataclass
class QuantConfig:
    roles: list[str] = dataclasses.field(default_factory=lambda: list(DEFAULT_ROLES))  # which loaded models to quantize
    # Module name parts kept in the checkpoint's precision. adaln_proj turns a timestep into modulation rows: a
    # handful of rows per forward, so quantizing it saves memory (13 B params at full size) but no time.
    skip: list[str] = dataclasses.field(default_factory=lambda: ["adaln_proj"])

    def __post_init__(self):
        unknown = [role for role in self.roles if role not in ROLES]
        if unknown:
            raise UsageError(f"unknown role '{unknown[0]}' in roles", f"roles are {', '.join(ROLES)}")


@dataclasses.dataclass
class FP8RowwiseConfig(QuantConfig):
    # auto: torch._scaled_mm on CUDA (Ada sm89, Hopper sm90+), the dequantizing reference on the CPU; scaled_mm or
    # reference to force
    matmul: str = "auto"
    # scaled_mm's fast accumulation: partial sums kept in the tensor cores' precision (faster, a little less exact)
    fast_accum: bool = False

    def __post_init__(self):
        super().__post_init__()
        if self.matmul not in MATMULS:
            raise UsageError(f"unknown matmul '{self.matmul}'", f"choose {', '.join(MATMULS)}")


class QuantStage(Stage):
    """Base of every quant stage: fuses the preset's adapters into the DiT, then calls `quantize`.

    `config.adapter` is the preset's [adapter] section, handed over by `h3gen.config.preset.resolve` (adapters are
    fused in this same load-time pass, so this stage is where they arrive).
    """

    kind = "quant"
    Config = NoQuantConfig
    quantizes_parts: ClassVar[bool] = False  # takes a model's blocks one by one as they load (`quantize`'s prefix)

    def load(self, repo):
        from h3gen.config.contract import AdapterConfig, find_adapter

        adapter = getattr(self.config, "adapter", None) or AdapterConfig()
        adapters = [find_adapter(name, getattr(repo, "root", None)) for name in adapter.paths]
        self.adapter_deltas = None
        if adapters:
            from h3gen.models.adapters import AdapterDeltas

            self.adapter_deltas = AdapterDeltas(adapters, [adapter.scale_of(i) for i in range(len(adapters))])
        self.quantized: dict[str, list[str]] = {}  # role -> the linears swapped, named as in the whole model
        self.parts: dict[str, list[str]] = {}  # role -> those swapped in parts of a model still loading

    def checkpoint_tensor(self, role: str, key: str, tensor):
        """For loaders that read the checkpoint themselves: `tensor` (checkpoint key `key`) with the adapters fused.
        A DiT that concatenates or drops weights at load (fused QKV, AdaLN tables) takes adapters this way."""
        if role == "dit" and self.adapter_deltas is not None:
            return self.adapter_deltas.apply(key, tensor)
        return tensor

    def transform(self, role: str, module):
        """Called by the stage that loaded `module` (`role`: one of ROLES); returns what runs.
        Adapter deltas the loader did not take through `checkpoint_tensor` are fused into `module` first."""
        if role == "dit" and self.adapter_deltas is not None:
            self.adapter_deltas.fuse_into(module)
        return self.quantize(role, module)

    def quantize(self, role: str, module, prefix: str = ""):
        """`module` for `role` quantized; with `prefix`, a part of the model (a block at "transformer_blocks.3"),
        given as it loads when the stage says `quantizes_parts`, the rest of the model following whole."""
        return module

    def run(self, clip):
        return clip


class NoQuant(QuantStage):
    name = "none"
    description = "keep the checkpoint's precision (adapters are still fused)"


class _LinearSwap(QuantStage):
    Config = QuantConfig
    quantizes_parts = True

    def quantize(self, role: str, module, prefix: str = ""):
        if role not in self.config.roles:
            return module
        from h3gen.models.quant_linear import swap_linears

        keep = set(self.config.skip) | set(getattr(module, "_keep_in_fp32_modules", None) or ())
        names = swap_linears(module, self.make_linear, SCOPES[role], keep, prefix)
        if prefix:  # a part as it loads: the whole model's call follows and takes these names along
            self.parts.setdefault(role, []).extend(names)
        else:
            self.quantized[role] = self.parts.pop(role, []) + names
        return module

    def make_linear(self, linear):
        raise NotImplementedError


class FP8Rowwise(_LinearSwap):
    name = "fp8-rowwise"
    Config = FP8RowwiseConfig
    description = "FP8 e4m3 linears: per-channel weight scales, dynamic per-row activation scales (_scaled_mm on sm89+)"

    def load(self, repo):
        super().load(repo)
        self.matmul = self.config.matmul
        if self.matmul == "auto":
            self.matmul = "scaled_mm" if self.runtime.device.startswith("cuda") else "reference"
        if self.matmul == "scaled_mm" and self.runtime.device.startswith("cuda"):
            refusal = scaled_mm_refusal(self.runtime.device)
            if refusal:
                raise UsageError(refusal, "use quant int8-weight-only, or --set quant.matmul=reference (slow)")

    def make_linear(self, linear):
        from h3gen.models.quant_linear import FP8RowwiseLinear

        return FP8RowwiseLinear.from_linear(linear, self.matmul, self.config.fast_accum)


class Int8WeightOnly(_LinearSwap):
    name = "int8-weight-only"
    description = "int8 weights with per-channel scales, matmuls in the activation dtype (any device)"

    def make_linear(self, linear):
        from h3gen.models.quant_linear import Int8WeightOnlyLinear

        return Int8WeightOnlyLinear.from_linear(linear)


def scaled_mm_refusal(device: str) -> str:
    """Why this GPU cannot run FP8 linears through `torch._scaled_mm` with a scale per row, or "" where it can:
    FP8 tensor cores came with Ada (sm89). Torch's row-wise kernel is built for Hopper (sm90+) and, in some builds,
    for Ada: there one small product is tried to know."""
    import torch

    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) >= (9, 0):
        return ""
    if (major, minor) < (8, 9):
        return (f"fp8-rowwise runs torch._scaled_mm on FP8 tensor cores (Ada sm89, Hopper sm90 or newer); this GPU is "
                f"sm{major}{minor}")
    rows = torch.ones((16, 16), device=device).to(torch.float8_e4m3fn)
    scale = torch.ones((16, 1), device=device)
    try:
        torch._scaled_mm(rows, rows.t(), scale_a=scale, scale_b=scale.t(), out_dtype=torch.bfloat16)
    except RuntimeError as error:
        return f"this torch build has no row-wise torch._scaled_mm for sm{major}{minor} ({str(error)[:120]})"
    return ""
