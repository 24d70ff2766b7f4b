"""The denoise loop: one DiT forward and one scheduler step per sigma, video and audio on their own schedules.

The packed layout ([text, audio, video] rows with their rotary positions and modality tags), the noise draw order
(video latents first, then audio rows, from one CPU generator) and the Euler step are the reference's, so a clip
is reproducible from its seed on any device.
"""

from __future__ import annotations

import dataclasses

from h3gen.errors import UsageError
from h3gen.clip import AUDIO_CHANNELS, AUDIO_LATENT_CHANNELS, VIDEO_LATENT_CHANNELS
from h3gen.stages.base import Stage

VIDEO_TAG, AUDIO_TAG = 0, 2


@dataclasses.dataclass
class EulerConfig:
    steps: int = 50  # sigma grid points, terminal 0 included: 50 points = 49 forwards
    sigma_positions: list[float] = dataclasses.field(default_factory=list)  # explicit grid before the shift
    video_shift: float = 12.0
    audio_shift: float = 3.0
    dit: str = "diffusers"  # "diffusers": the reference transformer; "h3gen": fused kernels and AdaLN tables
    triton: bool = True  # h3gen DiT: Triton kernels for norm/modulate, QK-norm + RoPE, SwiGLU, gated residual
    adaln_table: bool = True  # h3gen DiT: modulation rows precomputed for the schedule, adaln_proj dropped
    compile: bool = False  # h3gen DiT: regional torch.compile of each block
    attention: str = "auto"  # h3gen DiT: auto, flash-attn-4, sdpa-cudnn, sdpa-flash, sdpa


def sigma_schedule(config: EulerConfig, shift: float):
    """The sigma grid one modality walks: `steps` points of linspace(1, 0), or the explicit positions, shifted."""
    import torch
    from diffusers import MiniMaxH3Scheduler

    scheduler = MiniMaxH3Scheduler(shift=shift)
    if config.sigma_positions:
        base = torch.tensor(config.sigma_positions, dtype=torch.float32)
        scheduler.set_timesteps(sigmas=shift * base / (1 + (shift - 1) * base))
    else:
        scheduler.set_timesteps(config.steps)
    return scheduler


def forwards(config: EulerConfig) -> int:
    return len(sigma_schedule(config, config.video_shift).timesteps)


def schedule_timesteps(config: EulerConfig) -> list[float]:
    """Every timestep value a run's forwards will see: the AdaLN table needs one row set per value."""
    values = {float(t) for shift in (config.video_shift, config.audio_shift)
              for t in sigma_schedule(config, shift).timesteps}
    return sorted(values)


class EulerSampler(Stage):
    kind, name = "sampler", "euler"
    Config = EulerConfig
    description = "rectified-flow Euler over diffusers' MiniMaxH3Transformer3DModel (the reference DiT)"

    def load(self, repo):
        if len(self.config.sigma_positions) == 1 or (not self.config.sigma_positions and self.config.steps < 2):
            raise UsageError("the sigma grid needs at least 2 points", "set sampler.steps >= 2")
        if self.config.dit == "h3gen":
            dit = self.load_fast_dit(repo)
        elif self.config.dit == "diffusers":
            from diffusers import MiniMaxH3Transformer3DModel

            dit = repo.load("transformer", MiniMaxH3Transformer3DModel, torch_dtype=self.runtime.dtype,
                            device_map=self.runtime.device)
            self.attention_backend = "sdpa (PyTorch's choice)"
        else:
            raise UsageError(f"unknown sampler.dit '{self.config.dit}'", "choose diffusers or h3gen")
        self.dit = self.runtime.quant.transform("dit", dit.eval())
        self.patch_size = tuple(self.dit.config.patch_size)

    def load_fast_dit(self, repo):
        from h3gen.stages.fast_dit import FastH3Transformer

        config = self.config
        timesteps = schedule_timesteps(config) if config.adaln_table else None
        dit = repo.load("transformer", FastH3Transformer, dtype=self.runtime.dtype, device=self.runtime.device,
                        adaln_timesteps=timesteps, use_triton=config.triton, adaln_table=config.adaln_table,
                        compile_blocks=config.compile, attention_backend=config.attention)
        self.attention_backend = dit.attention_backend_name()
        return dit

    def run(self, clip):
        import torch

        with torch.inference_mode():
            layout = self.layout(clip)
            video_rows, audio_rows = self.noise(clip, layout)
            video_rows, audio_rows = self.denoise(clip, layout, video_rows, audio_rows)
            clip.video_latents, clip.audio_latents = self.unpack(layout, video_rows, audio_rows)
        return clip

    def layout(self, clip) -> dict:
        from diffusers.modular_pipelines.minimax_h3.before_denoise import MiniMaxH3PrepareLayoutStep

        _, _, frames, height, width = clip.request.video_latent_shape
        shape = dict(latent_frames=frames, latent_height=height, latent_width=width,
                     audio_latents=clip.request.audio_latent_shape[-1])
        position_ids, token_tags, video_indices, audio_indices, text_indices, _, _ = (
            MiniMaxH3PrepareLayoutStep.build_packed_sequence(
                clip.text_token_tags, shape["latent_frames"], shape["latent_height"], shape["latent_width"],
                shape["audio_latents"], self.patch_size, AUDIO_CHANNELS, AUDIO_TAG, VIDEO_TAG, ()))
        device = self.runtime.device
        return dict(shape, position_ids=position_ids.to(device), token_tags=token_tags.to(device),
                    video_indices=video_indices.to(device), audio_indices=audio_indices.to(device),
                    text_indices=text_indices.to(device))

    def noise(self, clip, layout):
        import torch
        from diffusers.modular_pipelines.minimax_h3.before_denoise import patchify_video_latents

        generator = torch.Generator("cpu").manual_seed(clip.request.seed)
        video = torch.randn(clip.request.video_latent_shape, generator=generator, dtype=torch.float32)
        audio_rows = torch.randn((layout["audio_latents"] * AUDIO_CHANNELS, AUDIO_LATENT_CHANNELS),
                                 generator=generator, dtype=torch.float32)
        device = self.runtime.device
        return patchify_video_latents(video, self.patch_size).to(device), audio_rows.to(device)

    def denoise(self, clip, layout, video_rows, audio_rows):
        from diffusers.modular_pipelines.minimax_h3.before_denoise import MiniMaxH3SetTimestepsStep

        video_schedule = sigma_schedule(self.config, self.config.video_shift)
        audio_schedule = sigma_schedule(self.config, self.config.audio_shift)
        steps = len(video_schedule.timesteps)
        # Both DiTs return the (video, audio) velocities first: diffusers' as an output tuple, h3gen's as a pair.
        for i, (t, audio_t) in enumerate(zip(video_schedule.timesteps, audio_schedule.timesteps)):
            timestep, timestep_indices = MiniMaxH3SetTimestepsStep.build_row_timesteps(
                layout["video_indices"], layout["audio_indices"], 0, 0, layout["text_indices"].numel(),
                float(t), float(audio_t), float(t), 1.0)
            video_velocity, audio_velocity = self.dit(
                hidden_states=video_rows[None], audio_hidden_states=audio_rows[None],
                encoder_hidden_states=clip.prompt_embeds, timestep=timestep.to(self.runtime.device),
                timestep_indices=timestep_indices.to(self.runtime.device), token_tags=layout["token_tags"],
                position_ids=layout["position_ids"], video_indices=layout["video_indices"],
                audio_indices=layout["audio_indices"], text_indices=layout["text_indices"])[:2]
            video_rows = video_schedule.step(video_velocity[0].float(), t, video_rows, return_dict=False)[0]
            audio_rows = audio_schedule.step(audio_velocity[0].float(), audio_t, audio_rows, return_dict=False)[0]
            self.runtime.on_step(clip, i + 1, steps)
        clip.notes.update(forwards=steps, attention=self.attention_backend)
        return video_rows, audio_rows

    def unpack(self, layout, video_rows, audio_rows):
        """Rows back to latents: video (1, 24, F, H, W), audio (2, 32, N) for the mono audio VAE."""
        patch_t, patch_h, patch_w = self.patch_size
        rows = video_rows.reshape(1, layout["latent_frames"] // patch_t, layout["latent_height"] // patch_h,
                                  layout["latent_width"] // patch_w, VIDEO_LATENT_CHANNELS, patch_t, patch_h, patch_w)
        video = rows.permute(0, 4, 1, 5, 2, 6, 3, 7).reshape(
            1, VIDEO_LATENT_CHANNELS, layout["latent_frames"], layout["latent_height"], layout["latent_width"])
        audio = audio_rows.reshape(AUDIO_CHANNELS, layout["audio_latents"], AUDIO_LATENT_CHANNELS).permute(0, 2, 1)
        return video.contiguous(), audio.contiguous()

    def unload(self):
        self.dit = None
