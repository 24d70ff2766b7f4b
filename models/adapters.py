"""Adapters fused into the DiT's weights at load: LoRA factors and full-rank deltas, several files in order.

Deltas are indexed by the checkpoint key they add to (`transformer_blocks.0.attn.to_q.weight`), so they can be
fused either into a loaded model's parameters or into each tensor as a loader reads it from the checkpoint (a DiT
that concatenates or drops weights at load needs the latter). Each delta is added in fp32 on the device the
tensor sits on, a slice of rows at a time, and the sum is cast back; adapter tensors are read from their files one
at a time. Fusing happens before quantization, so a quantized model carries the adapter at no cost per forward.

Adapter keys name diffusers modules (`transformer_blocks.0.attn.to_q`), optionally prefixed `base_model.model.`,
`transformer.` or `diffusion_model.`:
  `X.lora_A.weight`, `X.lora_B.weight`   W += scale * alpha / rank * B @ A (PEFT also writes `X.lora_A.<name>.weight`)
  `X.alpha`                              alpha of X; else the PEFT folder's adapter_config.json; else alpha = rank
  `X.diff`, `X.diff_b`                   W += scale * diff, b += scale * diff_b
"""

from __future__ import annotations

import dataclasses
import json
import math
import re

import torch

from h3gen.errors import ModelError

PREFIXES = ("base_model.model.", "transformer.", "diffusion_model.")
ROWS_PER_SLICE = 4096


@dataclasses.dataclass
class Delta:
    """One adapter's addition to one checkpoint tensor: `scale * B @ A` (LoRA) or `scale * diff`."""

    tensors: object  # an open safetensors file
    path: object
    key: str  # the adapter key it comes from (lora_B for a LoRA)
    shape: tuple
    scale: float
    down_key: str | None = None  # lora_A

    def rows(self, rows: slice, device) -> torch.Tensor:
        if self.down_key is None:
            return self.tensors.get_slice(self.key)[rows].to(device, torch.float32) * self.scale
        up = self.tensors.get_slice(self.key)[rows].to(device, torch.float32)
        return (up @ self.tensors.get_tensor(self.down_key).to(device, torch.float32)) * self.scale


class AdapterDeltas:
    """Every adapter's deltas by checkpoint key. Reads file headers at construction, tensors when applied."""

    def __init__(self, adapters, scales: list[float]):
        from safetensors import safe_open

        self.deltas: dict[str, list[Delta]] = {}
        self.applied: set[str] = set()
        for adapter, scale in zip(adapters, scales):
            tensors = safe_open(str(adapter.weights), framework="pt", device="cpu")
            peft = PeftScaling(adapter.peft_config)
            for module, parts in group_keys(tensors.keys(), adapter.weights).items():
                self._add_module(module, parts, tensors, adapter.weights, peft, scale)

    def _add_module(self, module, parts, tensors, path, peft, scale):
        def shape(key):
            return tuple(tensors.get_slice(key).get_shape())

        if "lora_A" in parts or "lora_B" in parts:
            if not {"lora_A", "lora_B"} <= set(parts):
                raise ModelError(f"adapter {path}: {module} has only one of lora_A / lora_B",
                                 "the adapter file is incomplete")
            down, up = shape(parts["lora_A"]), shape(parts["lora_B"])
            rank = down[0]
            alpha = tensors.get_tensor(parts["alpha"]).item() if "alpha" in parts else peft.alpha(module, rank)
            self.deltas.setdefault(f"{module}.weight", []).append(
                Delta(tensors, path, parts["lora_B"], (up[0], down[1]), scale * peft.factor(alpha, rank),
                      parts["lora_A"]))
        for kind, target in (("diff", "weight"), ("diff_b", "bias")):
            if kind in parts:
                self.deltas.setdefault(f"{module}.{target}", []).append(
                    Delta(tensors, path, parts[kind], shape(parts[kind]), scale))

    def pending(self) -> list[str]:
        return [key for key in self.deltas if key not in self.applied]

    @torch.no_grad()
    def apply(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        """Add every delta for checkpoint key `key` to `tensor`, in place (fp32 sum, cast back); returns it."""
        deltas = self.deltas.get(key, [])
        for delta in deltas:
            if tuple(tensor.shape) != delta.shape:
                raise ModelError(f"adapter {delta.path}: '{delta.key}' gives a delta of shape {list(delta.shape)} for "
                                 f"{key} of shape {list(tensor.shape)}", "the adapter was made for another model or size")
        if deltas:
            if key in self.applied:
                raise ModelError(f"adapter delta for {key} would be added twice", "load the DiT once per quant stage")
            for start in range(0, tensor.shape[0], ROWS_PER_SLICE):
                rows = slice(start, start + ROWS_PER_SLICE)
                fused = tensor[rows].float()
                for delta in deltas:
                    fused += delta.rows(rows, tensor.device)
                tensor[rows] = fused.to(tensor.dtype)
            self.applied.add(key)
        return tensor

    def fuse_into(self, model: torch.nn.Module) -> int:
        """Fuse what no loader fused while reading into `model`'s parameters; returns how many tensors changed."""
        pending = self.pending()
        for key in pending:
            module_name, _, name = key.rpartition(".")
            try:
                param = getattr(model.get_submodule(module_name), name)
            except AttributeError:
                param = None
            if not isinstance(param, torch.Tensor):
                delta = self.deltas[key][0]
                raise ModelError(f"adapter {delta.path}: '{delta.key}' adds to {key}, which this DiT does not have",
                                 "use an adapter keyed by diffusers' MiniMaxH3Transformer3DModel names, and "
                                 "sampler.dit = \"diffusers\" unless the DiT's loader fuses adapters as it reads")
            self.apply(key, param.data)
        return len(pending)


def fuse_adapters(model: torch.nn.Module, adapters, scales: list[float]) -> int:
    """Fuse every adapter (a `h3gen.config.contract.AdapterFile`) at its scale; returns how many tensors were changed."""
    return AdapterDeltas(adapters, scales).fuse_into(model)


def group_keys(keys, path) -> dict[str, dict[str, str]]:
    """module name -> {lora_A, lora_B, alpha, diff, diff_b: key in the file}."""
    from h3gen.config.contract import KEY_KINDS, classify_key

    groups: dict[str, dict[str, str]] = {}
    for key in keys:
        classified = classify_key(key)
        if classified is None:
            raise ModelError(f"adapter {path} has tensor '{key}' of a kind h3gen cannot fuse",
                             f"fusable keys end in {', '.join(KEY_KINDS)}")
        module, kind = classified
        module = next((module[len(p):] for p in PREFIXES if module.startswith(p)), module)
        if kind in groups.setdefault(module, {}):
            raise ModelError(f"adapter {path} has two {kind} tensors for {module}", "the adapter file is malformed")
        groups[module][kind] = key
    return groups


class PeftScaling:
    """alpha / rank as PEFT computes it from adapter_config.json (per-module patterns, rsLoRA)."""

    def __init__(self, config_path):
        self.config = json.loads(config_path.read_text()) if config_path is not None else {}
        if self.config.get("use_dora"):
            raise ModelError(f"{config_path}: DoRA adapters cannot be fused as a weight delta",
                             "use a plain LoRA adapter")

    def alpha(self, module_name: str, rank: int) -> float:
        for pattern, alpha in self.config.get("alpha_pattern", {}).items():
            if re.fullmatch(rf"(.*\.)?(?:{pattern})", module_name):
                return float(alpha)
        return float(self.config.get("lora_alpha", rank))

    def factor(self, alpha: float, rank: int) -> float:
        return alpha / math.sqrt(rank) if self.config.get("use_rslora") else alpha / rank
