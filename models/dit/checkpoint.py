"""The diffusers `transformer/` checkpoint contract: config fields, key mapping onto fused parameters, safetensors IO."""
import dataclasses
import json
import re
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open

# Modules the checkpoint ships in fp32 (diffusers' `_keep_in_fp32_modules`, matched as substrings of the key).
FP32_MODULES = ("proj_in", "audio_proj_in", "time_embedder", "proj_out", "audio_proj_out", "rope")

# fused parameter -> the checkpoint keys concatenated (dim 0) into it; anything unmatched maps to itself.
_FUSED_SOURCES = (
    (re.compile(r"(.*)attn\.to_qkv\.weight$"), (r"\1attn.to_q.weight", r"\1attn.to_k.weight", r"\1attn.to_v.weight")),
    (re.compile(r"(.*)attn\.to_out\.weight$"), (r"\1attn.to_out.0.weight",)),
    # diffusers' SwiGLU projection is already one tensor laid out [up | gate].
    (re.compile(r"(.*)ff\.up_gate\.weight$"), (r"\1ff.net.0.proj.weight",)),
    (re.compile(r"(.*)ff\.down\.weight$"), (r"\1ff.net.2.weight",)),
    (re.compile(r"(.*)adaln_proj\.(weight|bias)$"), (r"\1adaln_proj.linear.\2",)),
)


@dataclasses.dataclass(frozen=True)
class H3DiTConfig:
    num_attention_heads: int = 56
    attention_head_dim: int = 128
    hidden_size: int = 5376
    num_layers: int = 50
    num_refiner_layers: int = 2
    ffn_dim: int = 14336
    in_channels: int = 24
    audio_in_channels: int = 32
    patch_size: tuple = (1, 2, 2)
    text_dim: int = 5120
    freq_dim: int = 256
    time_embed_hidden_dim: int = 5376
    time_embed_dim: int = 2688
    rope_freq_dim: int = 16
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    qk_norm_eps: float = 1e-5
    final_norm_eps: float = 1e-5

    @classmethod
    def from_dict(cls, values):
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(k for k in values if k not in names and not k.startswith("_"))
        if unknown:
            raise ValueError(f"unknown MiniMax-H3 transformer config keys {unknown}; known: {sorted(names)}")
        picked = {k: v for k, v in values.items() if k in names}
        from h3gen.models.repo import mistyped

        problem = mistyped(picked, {f.name: f.default for f in dataclasses.fields(cls)})
        if problem:
            raise ValueError(problem)
        if "patch_size" in picked:
            picked["patch_size"] = tuple(picked["patch_size"])
        return cls(**picked)

    @property
    def video_patch_dim(self):
        return self.in_channels * self.patch_size[0] * self.patch_size[1] * self.patch_size[2]


def checkpoint_sources(fused_key):
    for pattern, sources in _FUSED_SOURCES:
        if pattern.match(fused_key):
            return [pattern.sub(s, fused_key) for s in sources]
    return [fused_key]


def is_fp32_key(key):
    return any(module in key for module in FP32_MODULES)


def fuse(fused_key, read):
    """The fused tensor for `fused_key`, reading checkpoint tensors through `read(checkpoint_key)`."""
    parts = [read(key) for key in checkpoint_sources(fused_key)]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)


def read_config(transformer_dir):
    return H3DiTConfig.from_dict(json.loads((Path(transformer_dir) / "config.json").read_text()))


class SafetensorsCheckpoint:
    """Key -> tensor over one or several (sharded) .safetensors files; never unpickles anything."""

    def __init__(self, transformer_dir, device="cpu"):
        self.dir = Path(transformer_dir)
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = str(device)
        indexes = sorted(self.dir.glob("*.safetensors.index.json"))
        if indexes:
            weight_map = json.loads(indexes[0].read_text())["weight_map"]
            files = [self.dir / name for name in sorted(set(weight_map.values()))]
        else:
            files = sorted(self.dir.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no .safetensors files in {self.dir}")
        self._stack = ExitStack()
        self._file_of = {}
        for path in files:
            handle = self._stack.enter_context(safe_open(str(path), framework="pt", device=self.device))
            self._file_of.update({key: handle for key in handle.keys()})
        self.unread = set(self._file_of)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._stack.close()

    def keys(self):
        return self._file_of.keys()

    def read(self, key):
        if key not in self._file_of:
            raise KeyError(f"checkpoint in {self.dir} has no tensor {key!r}")
        self.unread.discard(key)
        return self._file_of[key].get_tensor(key)
