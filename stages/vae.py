"""Decode: the video VAE to uint8 frames, the mono audio VAE twice (one stereo channel per batch item)."""

from __future__ import annotations

from h3gen.stages.base import Stage

# The video VAE works in ImageNet-normalized pixels.
PIXEL_MEAN, PIXEL_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


class ReferenceVAE(Stage):
    kind, name = "vae", "reference"
    description = "diffusers' AutoencoderKLMiniMaxH3 (default tiling) and AutoencoderKLMiniMaxH3Audio, frames to uint8 on the device"

    def load(self, repo):
        from diffusers import AutoencoderKLMiniMaxH3, AutoencoderKLMiniMaxH3Audio

        import torch

        device = self.runtime.device
        vae = repo.load("vae", AutoencoderKLMiniMaxH3, torch_dtype=self.runtime.dtype, device_map=device).eval()
        # The quant stage quantizes the decoder's blocks only when its roles name the VAE.
        self.vae = self.runtime.quantize("vae", vae)
        # The audio VAE is small and decodes in fp32, as the reference does.
        self.audio_vae = repo.load("audio_vae", AutoencoderKLMiniMaxH3Audio, torch_dtype=torch.float32,
                                   device_map=device).eval()
        self.sample_rate = self.audio_vae.config.sampling_rate

    def run(self, clip):
        import torch

        measure = self.runtime.timer.measure
        with torch.inference_mode():
            with measure(clip, "vae_video", report=False):
                frames = self.decode_video(clip.video_latents)
            with measure(clip, "vae_audio", report=False):
                audio = self.decode_audio(clip.audio_latents)
            with measure(clip, "transfer", report=False):
                clip.frames, clip.audio = frames.cpu().numpy(), audio.cpu().numpy()
        clip.notes["sample_rate"] = self.sample_rate
        return clip

    def decode_video(self, latents):
        import torch

        from h3gen.kernels.frames import frames_reference

        device, config = self.runtime.device, self.vae.config
        mean = torch.tensor(config.latents_mean, device=device).view(1, -1, 1, 1, 1)
        std = torch.tensor(config.latents_std, device=device).view(1, -1, 1, 1, 1)
        video = self.vae.decode((latents * std + mean).to(self.vae.dtype), return_dict=False)[0]
        # Frames become uint8 once, on the device, in the (T, H, W, RGB) layout the encoder reads.
        pixel_mean, pixel_std = torch.tensor(PIXEL_MEAN, device=device), torch.tensor(PIXEL_STD, device=device)
        return frames_reference(video[0], pixel_mean, pixel_std)

    def decode_audio(self, latents):
        import torch

        device, config = self.runtime.device, self.audio_vae.config
        mean = torch.tensor(config.latents_mean, device=device).view(1, -1, 1)
        std = torch.tensor(config.latents_std, device=device).view(1, -1, 1)
        audio = self.audio_vae.decode(latents.float() * std + mean, return_dict=False)[0]
        return audio.float()[:, 0]

    def unload(self):
        self.vae = self.audio_vae = None
