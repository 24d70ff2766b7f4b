"""How far a transformed DiT (quantized, or anything else) lands from the reference, on the same weights and inputs.

One forward over a packed [text, audio, video] sequence built the way the sampler builds it; the video and audio
velocities are compared by relative error (||v - v_ref|| / ||v_ref||) and cosine similarity.
"""

from __future__ import annotations

import dataclasses

from h3gen.models.dit.tags import AUDIO_TAG, TEXT_TAG, VIDEO_TAG
from h3gen.inputs.request import AUDIO_CHANNELS, AUDIO_LATENT_CHANNELS, Request, audio_latents



@dataclasses.dataclass
class Probe:
    """The inputs of one DiT forward, kept on the CPU in fp32; `inputs` puts them on a device."""

    tensors: dict

    def inputs(self, device, dtype) -> dict:
        """Latent rows stay fp32 (the model casts them for its fp32 input projections), text states in `dtype`."""
        moved = {key: value.to(device) for key, value in self.tensors.items()}
        moved["encoder_hidden_states"] = moved["encoder_hidden_states"].to(dtype)
        return moved


def make_probe(dit_config, request: Request, text_tokens: int, sigma: float, seed: int = 1101) -> Probe:
    """Random latents and text states for `request`'s shape, every row at noise level `sigma` (t = 1 - sigma)."""
    import torch
    from diffusers.modular_pipelines.minimax_h3.before_denoise import (MiniMaxH3PrepareLayoutStep,
                                                                       MiniMaxH3SetTimestepsStep,
                                                                       patchify_video_latents)

    def field(name):  # diffusers' config is a mapping, h3gen's a dataclass
        return dit_config[name] if isinstance(dit_config, dict) else getattr(dit_config, name)

    patch = tuple(field("patch_size"))
    _, _, frames, height, width = request.video_latent_shape
    audio_count = audio_latents(request.frames)
    text_tags = torch.full((text_tokens,), TEXT_TAG, dtype=torch.long)
    position_ids, token_tags, video_indices, audio_indices, text_indices, _, _ = (
        MiniMaxH3PrepareLayoutStep.build_packed_sequence(text_tags, frames, height, width, audio_count, patch,
                                                         AUDIO_CHANNELS, AUDIO_TAG, VIDEO_TAG, ()))
    timestep, timestep_indices = MiniMaxH3SetTimestepsStep.build_row_timesteps(
        video_indices, audio_indices, 0, 0, text_indices.numel(), 1.0 - sigma, 1.0 - sigma, 1.0 - sigma, 1.0)
    generator = torch.Generator("cpu").manual_seed(seed)
    video = torch.randn(request.video_latent_shape, generator=generator)
    audio = torch.randn((audio_count * AUDIO_CHANNELS, AUDIO_LATENT_CHANNELS), generator=generator)
    text = torch.randn((1, text_tokens, field("text_dim")), generator=generator)
    tensors = dict(hidden_states=patchify_video_latents(video, patch)[None], audio_hidden_states=audio[None],
                   encoder_hidden_states=text, timestep=timestep, timestep_indices=timestep_indices,
                   token_tags=token_tags, position_ids=position_ids, video_indices=video_indices,
                   audio_indices=audio_indices, text_indices=text_indices)
    return Probe(tensors)


def velocity(dit, probe: Probe, device, dtype):
    """(video velocity, audio velocity) of one forward, fp32 on the CPU."""
    import torch

    with torch.inference_mode():
        video, audio = dit(**probe.inputs(device, dtype))[:2]  # diffusers' output object or h3gen's pair
    return video.float().cpu(), audio.float().cpu()


def compare(reference, candidate) -> dict[str, float]:
    """Relative error and cosine similarity of each velocity, and of both together."""
    import torch

    out = {}
    pairs = dict(video=(reference[0], candidate[0]), audio=(reference[1], candidate[1]))
    pairs["all"] = tuple(torch.cat([video.flatten(), audio.flatten()]) for video, audio in (reference, candidate))
    for name, (ref, cand) in pairs.items():
        ref, cand = ref.double().flatten(), cand.double().flatten()
        out[f"{name}_rel_err"] = float((cand - ref).norm() / ref.norm().clamp(min=1e-30))
        out[f"{name}_cosine"] = float(torch.nn.functional.cosine_similarity(ref, cand, dim=0))
    return out


def weight_bytes(module) -> int:
    """Bytes of every parameter and buffer: what the weights cost in memory."""
    return sum(t.numel() * t.element_size() for t in list(module.parameters()) + list(module.buffers()))


def latent_step_error(candidate, reference, noise) -> float:
    """||candidate - reference|| / ||reference - noise||: how far a sampler's output latents land from the
    reference sampler's, relative to how far the reference moved them from the shared starting noise. After one
    forward this is the relative error of the velocity."""
    return float((candidate.double() - reference.double()).norm() / (reference.double() - noise.double()).norm())


def starting_noise(request: Request, seed: int):
    """The video latents a t2va sampler starts from (h3gen's and diffusers' draw them alike)."""
    import torch

    return torch.randn(request.video_latent_shape, generator=torch.Generator("cpu").manual_seed(seed))
