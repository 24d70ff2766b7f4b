"""diffusers' own MiniMax-H3 modular pipeline blocks, used as shipped, wrapped as h3gen stages.

This is the baseline `h3gen bench` measures every preset against: default attention backend, default VAE tiling,
diffusers' own text encoding, denoise loop and decode. The stages share h3gen's harness (timing, mux), nothing else.
"""

from __future__ import annotations

import dataclasses
import functools

from h3gen.errors import UsageError
from h3gen.stages.base import Stage
from h3gen.stages.clip import FORWARDS_PART


def timed(stage, part, fn):
    """`fn`, timed into the part `part` of the clip `stage` runs (`stage.clip`), with its signature kept: diffusers
    passes a forward the inputs its signature names."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        with stage.runtime.timer.measure(stage.clip, part, report=False):
            return fn(*args, **kwargs)

    return run


def modular_pipeline(block_cls, **components):
    pipe = block_cls().init_pipeline()
    pipe.update_components(**components)
    pipe.set_progress_bar_config(disable=True)
    return pipe


class DiffusersEncode(Stage):
    kind, name = "encode", "diffusers"
    description = "diffusers MiniMaxH3TextEncoderStep as shipped (full Qwen3-VL stack)"

    def load(self, repo):
        from diffusers.modular_pipelines.minimax_h3.encoders import MiniMaxH3TextEncoderStep
        from transformers import Qwen2TokenizerFast, Qwen3VLForConditionalGeneration, Qwen3VLProcessor

        text_encoder = repo.load("text_encoder", Qwen3VLForConditionalGeneration, dtype=self.runtime.dtype,
                                 device_map=self.runtime.device).eval()
        self.pipe = modular_pipeline(MiniMaxH3TextEncoderStep, text_encoder=text_encoder,
                                     tokenizer=repo.load("tokenizer", Qwen2TokenizerFast),
                                     processor=repo.load("processor", Qwen3VLProcessor))

    def run(self, clip):
        if clip.request.task != "t2va":
            from h3gen.errors import ClipError

            raise ClipError(f"the diffusers baseline stages render t2va only, and this clip is {clip.request.task}",
                            "render keyframes and references with a preset built on the qwen3vl and euler stages")
        state = self.pipe(prompt=clip.request.prompt, output=["prompt_embeds", "text_token_tags"])
        clip.prompt_embeds, clip.text_token_tags = state["prompt_embeds"], state["text_token_tags"]
        return clip

    def unload(self):
        self.pipe = None


@dataclasses.dataclass
class DiffusersSamplerConfig:
    steps: int = 50  # diffusers' num_inference_steps
    sdpa_backend: str = "default"  # default (PyTorch picks), flash, cudnn, efficient, math


# SDPA's backends a preset may force: the torch.nn.attention.SDPBackend member of each, and where it runs.
SDPA_BACKENDS = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION", "efficient": "EFFICIENT_ATTENTION",
                 "math": "MATH"}
SDPA_CUDA_ONLY, SDPA_HALF_ON_CUDA = ("cudnn", "efficient"), ("flash", "cudnn")


def sdpa_context(backend: str):
    """PyTorch's own choice by default; one named SDPA backend forced otherwise."""
    import contextlib

    from torch.nn.attention import SDPBackend, sdpa_kernel

    if backend == "default":
        return contextlib.nullcontext()
    return sdpa_kernel([getattr(SDPBackend, SDPA_BACKENDS[backend])])


class DiffusersSampler(Stage):
    kind, name = "sampler", "diffusers"
    Config = DiffusersSamplerConfig
    description = "diffusers MiniMaxH3CoreDenoiseStep as shipped (default attention backend)"

    @classmethod
    def check_config(cls, config) -> None:
        if config.sdpa_backend not in ("default", *SDPA_BACKENDS):
            raise UsageError(f"unknown sampler.sdpa_backend '{config.sdpa_backend}'",
                             f"choose default, {', '.join(SDPA_BACKENDS)}")
        if config.steps < 2:
            raise UsageError(f"sampler.steps is {config.steps}, and diffusers' sigma grid needs at least 2 points",
                             "set sampler.steps >= 2")

    @classmethod
    def check_device(cls, config, device, dtype) -> None:
        backend, fix = config.sdpa_backend, "set sampler.sdpa_backend = default, PyTorch's pick, or math"
        if backend in SDPA_CUDA_ONLY and not device.startswith("cuda"):
            raise UsageError(f"sampler.sdpa_backend = {backend} runs on CUDA GPUs only, and this run is on {device}",
                             fix)
        if backend in SDPA_HALF_ON_CUDA and device.startswith("cuda") and dtype not in ("bfloat16", "float16"):
            raise UsageError(f"sampler.sdpa_backend = {backend} takes bf16 or fp16 inputs on a GPU, and this run is "
                             f"in {dtype}", fix)

    def load(self, repo):
        from diffusers import MiniMaxH3Scheduler, MiniMaxH3Transformer3DModel
        from diffusers.modular_pipelines.minimax_h3.modular_blocks_minimax_h3 import MiniMaxH3CoreDenoiseStep

        transformer = repo.load("transformer", MiniMaxH3Transformer3DModel, torch_dtype=self.runtime.dtype,
                                device_map=self.runtime.device).eval()
        self.pipe = modular_pipeline(MiniMaxH3CoreDenoiseStep, transformer=transformer,
                                     scheduler=MiniMaxH3Scheduler(shift=12.0),
                                     audio_scheduler=MiniMaxH3Scheduler(shift=3.0))
        transformer.forward = timed(self, FORWARDS_PART, transformer.forward)

    def run(self, clip):
        import torch

        request, forwards = clip.request, 0

        def count_forward(*_):
            nonlocal forwards
            forwards += 1
            self.runtime.on_step(clip, forwards, self.config.steps - 1)

        self.clip = clip
        hook = self.pipe.transformer.register_forward_hook(count_forward)
        try:
            with sdpa_context(self.config.sdpa_backend):
                state = self.pipe(prompt_embeds=clip.prompt_embeds.to(self.runtime.device),
                                  text_token_tags=clip.text_token_tags,
                                  height=request.height, width=request.width, num_frames=request.frames,
                                  num_inference_steps=self.config.steps,
                                  generator=torch.Generator("cpu").manual_seed(request.seed),
                                  output=["latents", "audio_latents"])
        finally:
            hook.remove()
        clip.video_latents, clip.audio_latents = state["latents"], state["audio_latents"]
        clip.forwards, clip.attention = forwards, f"sdpa ({self.config.sdpa_backend})"
        return clip

    def unload(self):
        self.pipe = None


class DiffusersDecode(Stage):
    kind, name = "vae", "diffusers"
    description = "diffusers MiniMaxH3DecodeStep as shipped (default VAE tiling)"

    def load(self, repo):
        import torch
        from diffusers import AutoencoderKLMiniMaxH3, AutoencoderKLMiniMaxH3Audio
        from diffusers.modular_pipelines.minimax_h3.modular_blocks_minimax_h3 import MiniMaxH3DecodeStep

        device = self.runtime.device
        self.pipe = modular_pipeline(
            MiniMaxH3DecodeStep,
            vae=repo.load("vae", AutoencoderKLMiniMaxH3, torch_dtype=self.runtime.dtype, device_map=device).eval(),
            audio_vae=repo.load("audio_vae", AutoencoderKLMiniMaxH3Audio, torch_dtype=torch.float32,
                                device_map=device).eval())
        # Time each decoder inside diffusers' block without changing what the block does.
        for part, module in (("vae_video", self.pipe.vae), ("vae_audio", self.pipe.audio_vae)):
            module.decode = timed(self, part, module.decode)

    def run(self, clip):
        import numpy as np

        self.clip = clip
        state = self.pipe(latents=clip.video_latents, audio_latents=clip.audio_latents, output_type="np",
                          output=["videos", "audio", "sampling_rate"])
        # diffusers hands back float frames in [0, 1] on the host; the encoder wants uint8.
        clip.frames = (np.asarray(state["videos"][0]) * 255).round().astype(np.uint8)
        clip.audio = state["audio"][0].cpu().numpy()
        clip.sample_rate = state["sampling_rate"]
        return clip

    def unload(self):
        self.pipe = None
