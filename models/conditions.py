"""What fl2va and ref2va condition on: keyframes and references, prepared and encoded as diffusers 0.42.1 does.

Three steps per clip, each diffusers' own code so the conditioning is the reference's bit for bit:
  media     the files decoded by diffusers' reference classes, put on the canvas by its before-encode blocks
            (MiniMaxH3ResizeStep: keyframes stretched or cover-cropped; MiniMaxH3Ref2VASetupStep: references
            resampled to 24 fps / the audio VAE's rate, resized to the repository's canvas rules);
  text      the presentation Qwen3-VL reads: a "<Picture i>: " / "<Video k>: " / "<Audio j>: " label and a vision
            block per condition, then the prompt (MiniMaxH3Ref2VATextEncoderStep's static helpers);
  latents   the video VAE's sampled, fp16-rounded posterior of every visual condition and the audio VAE's mean of
            every soundtrack (MiniMaxH3KeyframeVaeEncoderStep, MiniMaxH3Ref2VAReferenceEncoderStep).
The sampler then lays the latents out ahead of the generated rows and holds them fixed through the loop.

The VAEs load on the first conditioned clip (a t2va run never loads them), the video VAE without its decoder.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

from h3gen.inputs.request import FPS
from h3gen.errors import ClipError
from h3gen.models.dit.tags import TEXT_TAG, VIDEO_TAG

# What the ref2va layout reads of a reference; the media itself is dropped once encoded.
ReferenceKind = collections.namedtuple("ReferenceKind", "kind has_audio")


@dataclasses.dataclass
class Conditions:
    """A clip's encoded conditioning, in packed order: what the sampler's layout and noise need."""

    task: str
    keyframe_anchors: tuple[str, ...] = ()  # fl2va: "first" / "last" per keyframe
    references: tuple[ReferenceKind, ...] = ()  # ref2va
    video_latents: list = dataclasses.field(default_factory=list)  # (1, 24, F, H, W) per visual condition, clean
    audio_rows: list = dataclasses.field(default_factory=list)  # (N * 2, 32) per reference soundtrack


@dataclasses.dataclass
class Media:
    """A clip's decoded, normalized media: diffusers' keyframe images or reference dataclasses."""

    task: str
    keyframes: list = dataclasses.field(default_factory=list)
    keyframe_anchors: tuple[str, ...] = ()
    references: list = dataclasses.field(default_factory=list)

    def as_references(self) -> list:
        """Keyframes are presented to Qwen3-VL exactly as image references are: a label and a vision block each."""
        if self.task == "ref2va":
            return self.references
        from diffusers.modular_pipelines.minimax_h3 import MiniMaxH3ImageReference

        return [MiniMaxH3ImageReference(image=image) for image in self.keyframes]


def block_pipeline(block_cls, configs: dict, **components):
    """One of diffusers' MiniMax-H3 blocks as a pipeline of its own, with the repository's canvas settings."""
    pipe = block_cls().init_pipeline()
    pipe.update_components(**components, **{k: v for k, v in configs.items() if k in pipe.config})
    return pipe


def canvas_configs(repo) -> dict:
    """The canvas rules a repository declares in its modular_model_index.json; the released model's otherwise."""
    from diffusers.modular_pipelines.minimax_h3.before_encoder import MiniMaxH3Ref2VASetupStep

    configs = {spec.name: spec.default for spec in MiniMaxH3Ref2VASetupStep().expected_configs}
    saved = repo.canvas_rules() if getattr(repo, "root", None) is not None else {}
    for key in configs:
        if isinstance(saved.get(key), int) and not isinstance(saved[key], bool) and saved[key] > 0:
            configs[key] = saved[key]
    return configs


class MediaConditioner:
    """Prepares and encodes one clip's keyframes or references; holds the VAEs' encoders between clips."""

    def __init__(self, runtime, repo):
        self.runtime, self.repo = runtime, repo
        self.configs = canvas_configs(repo)
        self.vae = self.audio_vae = None
        self.pipes: dict[str, Any] = {}

    def prepare(self, request) -> Media:
        from diffusers.modular_pipelines.minimax_h3.before_encoder import (MiniMaxH3Ref2VASetupStep,
                                                                           MiniMaxH3ResizeStep)

        size = dict(height=request.height, width=request.width)
        try:
            if request.task == "fl2va":
                first, last = (decode_keyframe(path) if path else None
                               for path in (request.first_frame, request.last_frame))
                state = self.pipe("resize", MiniMaxH3ResizeStep)(image=first, last_image=last, **size,
                                                                 output=["keyframes", "keyframe_anchors"])
                return Media("fl2va", keyframes=state["keyframes"], keyframe_anchors=tuple(state["keyframe_anchors"]))
            references = [decode_reference(reference) for reference in request.references]
            normalized = self.pipe("setup", MiniMaxH3Ref2VASetupStep)(references=references, num_frames=request.frames,
                                                                      **size, output="normalized_references")
            return Media("ref2va", references=normalized)
        except (ValueError, ImportError) as e:  # diffusers' own checks of the media (the parser checked them first)
            raise ClipError(f"cannot use the {request.task} media: {e}", "check the files the line names") from None

    def presentation(self, tokenizer, processor, prompt: str, media: Media):
        """(token ids, their modality tags, the vision tensors) of the labelled presentation Qwen3-VL encodes."""
        import torch
        from diffusers.modular_pipelines.minimax_h3.encoders import MiniMaxH3Ref2VATextEncoderStep

        # The block's own helpers (diffusers 0.42.1): the vision features batched per modality, the labels numbered
        # per modality in packed order.
        step = MiniMaxH3Ref2VATextEncoderStep()
        references = media.as_references()
        try:
            vision, image_tokens, video_tokens, video_times = step._gather_vision_features(processor, references, FPS)
        except ValueError as e:  # e.g. a reference video too short for Qwen3-VL's 2 fps frame pairs
            raise ClipError(f"cannot present the references to the text encoder: {e}", "use longer media") from None
        token_ids, token_tags = step._build_presentation(tokenizer, prompt, references, image_tokens, video_tokens,
                                                         video_times, text_tag=TEXT_TAG, video_tag=VIDEO_TAG)
        return token_ids, torch.tensor(token_tags, dtype=torch.long), vision

    def encode(self, media: Media) -> Conditions:
        from diffusers.modular_pipelines.minimax_h3.encoders import (MiniMaxH3KeyframeVaeEncoderStep,
                                                                     MiniMaxH3Ref2VAReferenceEncoderStep)

        if media.task == "fl2va":
            latents = self.pipe("keyframes", MiniMaxH3KeyframeVaeEncoderStep, vae=self.video_vae())(
                keyframes=media.keyframes, output="condition_latents")
            return Conditions("fl2va", keyframe_anchors=media.keyframe_anchors, video_latents=latents)
        # The block reads the audio VAE's normalization even when no reference carries sound.
        state = self.pipe("references", MiniMaxH3Ref2VAReferenceEncoderStep, vae=self.video_vae(),
                          audio_vae=self.load_audio_vae())(normalized_references=media.references,
                                                           output=["condition_latents", "audio_condition_latents"])
        kinds = tuple(ReferenceKind(r.kind, r.has_audio) for r in media.references)
        return Conditions("ref2va", references=kinds, video_latents=state["condition_latents"],
                          audio_rows=state["audio_condition_latents"])

    def pipe(self, name: str, block_cls, **components):
        """The block's pipeline, built once; components given again (a VAE loaded since) are swapped in."""
        if name not in self.pipes:
            self.pipes[name] = block_pipeline(block_cls, self.configs, **components)
        elif any(getattr(self.pipes[name], key, None) is not value for key, value in components.items()):
            self.pipes[name].update_components(**components)
        return self.pipes[name]

    def video_vae(self):
        if self.vae is None:
            from diffusers import AutoencoderKLMiniMaxH3

            vae = self.repo.load("vae", AutoencoderKLMiniMaxH3, torch_dtype=self.runtime.dtype,
                                 device_map=self.runtime.device).eval()
            vae.decoder = None  # conditions only encode; the decode stage holds its own VAE
            self.vae = vae
        return self.vae

    def load_audio_vae(self):
        if self.audio_vae is None:
            import torch
            from diffusers import AutoencoderKLMiniMaxH3Audio

            # fp32, as the reference runs it.
            self.audio_vae = self.repo.load("audio_vae", AutoencoderKLMiniMaxH3Audio, torch_dtype=torch.float32,
                                            device_map=self.runtime.device).eval()
        return self.audio_vae

    def unload(self):
        self.vae = self.audio_vae = None
        self.pipes.clear()


def decode_keyframe(path):
    """A keyframe as diffusers loads an image: EXIF rotation applied, RGB."""
    from diffusers.utils import load_image

    return read_media(path, "keyframe", load_image)


def decode_reference(reference):
    """A reference file as diffusers' reference classes decode it, with the frame and sample rates it carries."""
    from diffusers.modular_pipelines.minimax_h3 import (MiniMaxH3AudioReference, MiniMaxH3ImageReference,
                                                        MiniMaxH3VideoReference)

    classes = {"image": MiniMaxH3ImageReference, "video": MiniMaxH3VideoReference, "audio": MiniMaxH3AudioReference}
    return read_media(reference.path, f"{reference.kind} reference", classes[reference.kind].from_file)


def read_media(path, what: str, reader):
    from pathlib import Path

    if not Path(path).exists():  # it was when the prompts were checked
        raise ClipError(f"{what} {path} was taken away while the run went on", "put it back and run the same command "
                        "again")
    try:
        return reader(str(path))
    except Exception as e:  # PIL, PyAV and diffusers each raise their own kinds; all mean "cannot read this file"
        raise ClipError(f"cannot read {what} {path}: {e}", "check that the file is complete and readable") from None
