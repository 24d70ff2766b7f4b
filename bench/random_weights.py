"""Full-size MiniMax-H3 components with random weights, built directly on the device.

Real weights cannot be had everywhere a benchmark runs; timing does not depend on weight values, only on
shapes and dtypes. The VAEs are constructed under the device and the target dtype and initialized by their own
init (random, never zeros). The DiT and the text encoder, tens of GB each, are constructed with their parameters
on the meta device and made one module at a time on the GPU, by each module's `reset_parameters` under a seed of
its own name: the same weights wherever they end up (resident, in host memory to stream, or read block by block
into h3gen's DiT), made at the GPU's speed rather than the host's. The tokenizer and processor come from the tiny
model: a benchmark fixes the token count, not the text.
"""

from __future__ import annotations

import contextlib
import copy
import zlib

# Qwen3-VL-32B's text stack: what MiniMax-H3 conditions on (hidden size 5120 = the DiT's text_dim).
QWEN3VL_32B_TEXT = dict(hidden_size=5120, intermediate_size=25600, num_hidden_layers=64, num_attention_heads=64,
                        num_key_value_heads=8, head_dim=128, vocab_size=151936, rope_theta=5000000.0,
                        rope_scaling={"rope_type": "default", "mrope_section": [24, 20, 20],
                                      "mrope_interleaved": True})
QWEN3VL_32B_VISION = dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, out_hidden_size=5120,
                          patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
                          deepstack_visual_indexes=[8, 16, 24])


@contextlib.contextmanager
def built_on(device, dtype):
    import torch

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(previous)


class FullSizeRandom:
    """Stands in for a `ModelRepo`: same `load` interface, full-size random components."""

    def __init__(self, tiny_repo, seed: int = 1101):
        self.tiny_repo, self.seed = tiny_repo, seed
        self.root = None  # no repository directory: stages fall back to the released model's defaults

    def text_dim(self) -> int:
        return QWEN3VL_32B_TEXT["hidden_size"]

    def transformer_config(self) -> dict:
        """diffusers' MiniMaxH3Transformer3DModel defaults: the released DiT's shape."""
        import torch
        from diffusers import MiniMaxH3Transformer3DModel

        with torch.device("meta"):
            return dict(MiniMaxH3Transformer3DModel().config)

    def weight_bytes(self, component: str) -> int:
        """A component's bytes in bf16, from its parameter count (built on the meta device)."""
        import torch
        from diffusers import AutoencoderKLMiniMaxH3, AutoencoderKLMiniMaxH3Audio, MiniMaxH3Transformer3DModel

        classes = {"vae": AutoencoderKLMiniMaxH3, "audio_vae": AutoencoderKLMiniMaxH3Audio,
                   "transformer": MiniMaxH3Transformer3DModel}
        with torch.device("meta"):
            if component == "text_encoder":
                from transformers import Qwen3VLForConditionalGeneration

                model = Qwen3VLForConditionalGeneration(self.text_encoder_config())
            else:
                model = classes[component]()
        return 2 * sum(p.numel() for p in model.parameters())

    def text_encoder_identity(self) -> str:
        """The embedding cache's key: the random encoder is fixed by its architecture, seed and tokenizer."""
        import hashlib
        import json

        spec = json.dumps(dict(text=QWEN3VL_32B_TEXT, vision=QWEN3VL_32B_VISION, seed=self.seed), sort_keys=True)
        tokenizer = self.tiny_repo.text_encoder_identity()
        return hashlib.sha256(f"full-size random, made per module\0{spec}\0{tokenizer}".encode()).hexdigest()

    def text_encoder_layers(self) -> int:
        return QWEN3VL_32B_TEXT["num_hidden_layers"]

    def text_encoder_config(self):
        from transformers import Qwen2TokenizerFast, Qwen3VLConfig

        tokenizer = self.tiny_repo.load("tokenizer", Qwen2TokenizerFast)
        ids = {n: tokenizer.convert_tokens_to_ids(f"<|{n}|>") for n in ("image_pad", "video_pad", "vision_start",
                                                                          "vision_end")}
        # Deep copies: transformers rewrites the nested rope settings in place, which would change this module's
        # constants (and the embedding cache's key with them) after the first load.
        text, vision = copy.deepcopy(QWEN3VL_32B_TEXT), copy.deepcopy(QWEN3VL_32B_VISION)
        return Qwen3VLConfig(text_config=text, vision_config=vision,
                             image_token_id=ids["image_pad"], video_token_id=ids["video_pad"],
                             vision_start_token_id=ids["vision_start"], vision_end_token_id=ids["vision_end"])

    def load(self, component: str, cls, torch_dtype=None, dtype=None, device_map="cpu", config=None, **kwargs):
        import torch

        if component in ("tokenizer", "processor"):
            return self.tiny_repo.load(component, cls)
        if getattr(cls, "h3gen_loader", False):
            from diffusers import MiniMaxH3Transformer3DModel

            device = kwargs.pop("device", device_map)
            reference = made_empty(MiniMaxH3Transformer3DModel, device, dtype)
            read = MadeOnRead(reference, device, self.seed)
            return cls.from_tensors(dict(reference.config), read, device, **kwargs)
        dtype = torch_dtype or dtype or torch.bfloat16
        if component in ("text_encoder", "transformer", "transformer_ref"):
            args = (config or self.text_encoder_config(),) if component == "text_encoder" else ()
            model = made_empty(cls, device_map, dtype, *args)
            MadeOnRead(model, device_map, self.seed).make_all()
            return model
        torch.manual_seed(self.seed)
        with built_on(device_map, dtype):
            if component == "audio_vae":
                model = cls(latents_mean=[0.1] * 32, latents_std=[1.1] * 32)
            elif component == "vae":
                model = cls(latents_mean=[0.1] * 24, latents_std=[1.1] * 24)
            else:
                model = cls()
        keep = keep_fp32(cls)
        for name, param in model.named_parameters():
            if keep & set(name.split(".")):
                param.data = param.data.float()
        return model


def keep_fp32(cls) -> set:
    """The checkpoint's fp32 islands stay fp32, as diffusers' loading keeps them: every parameter with one of the
    class's `_keep_in_fp32_modules` names among its dotted parts (the VAE's nested norms and scales too)."""
    return set(getattr(cls, "_keep_in_fp32_modules", None) or ())


def made_empty(cls, device, dtype, *args):
    """`cls(*args)` with its parameters on the meta device and its buffers made on `device` (rotary frequencies
    and the like, computed as the constructor computes them)."""
    from accelerate import init_empty_weights

    with built_on(device, dtype), init_empty_weights(include_buffers=False):
        return cls(*args)


class MadeOnRead:
    """The parameters of a `made_empty` model, each module's made when one of them is first read: on the GPU
    where there is one, by the module's own `reset_parameters` (ones for a norm without one, else N(0, 0.02))
    under `seed` and a hash of the module's name, then moved to `device`. As a `read(key)` for
    `FastH3Transformer.from_tensors`, each tensor is handed over and dropped, so at most one module's weights
    exist beyond what the reader keeps."""

    def __init__(self, model, device, seed: int):
        import torch

        self.model, self.device, self.seed = model, torch.device(device), seed
        self.build = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        self.keep = keep_fp32(type(model))

    def __call__(self, key: str):
        import torch

        owner, _, name = key.rpartition(".")
        module = self.model.get_submodule(owner)
        if module._parameters[name].is_meta:
            self.make(owner, module)
        param = module._parameters[name]
        tensor = param.data
        param.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
        return tensor

    def make_all(self) -> None:
        for owner, module in self.model.named_modules():
            if any(param is not None and param.is_meta for param in module._parameters.values()):
                self.make(owner, module)

    def make(self, owner: str, module) -> None:
        import torch

        torch.manual_seed(self.seed ^ zlib.crc32(owner.encode()))
        for name, param in module._parameters.items():  # the buffers stay as the constructor made them
            if param is not None:
                module._parameters[name] = torch.nn.Parameter(torch.empty_like(param, device=self.build),
                                                              requires_grad=False)
        with torch.no_grad():
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()
            else:
                for param in module._parameters.values():
                    if param is not None:
                        param.fill_(1.0) if param.dim() == 1 else param.normal_(0.0, 0.02)
            fp32 = bool(self.keep & set(owner.split(".")))
            for name, param in module._parameters.items():
                if param is not None:
                    param.data = param.data.to(self.device, torch.float32 if fp32 else param.dtype)
