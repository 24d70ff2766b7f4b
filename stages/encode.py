"""Text encode: Qwen3-VL, read at the unnormalized hidden state after layer 50 (the layers past it never run).

A t2va clip's prompt is encoded alone (and kept in the embedding cache). A conditioned clip's prompt is presented
with its media (so it never reads or fills the prompt-only cache), and its keyframes or references are encoded by
the VAEs into `clip.conditions` (h3gen.models.conditions); "conditions" in the clip's seconds is the time spent on
the media and the VAEs.
"""

from __future__ import annotations

import dataclasses

from h3gen.errors import ClipError, UsageError
from h3gen.models.dit.tags import TEXT_TAG
from h3gen.stages.base import Stage


@dataclasses.dataclass
class Qwen3VLConfig:
    layer: int = 50  # the hidden state H3 reads; the encoder runs one layer past it
    max_tokens: int = 1024  # a prompt of more tokens fails its clip
    cache: bool = True  # prompt embeddings on disk: a rerun over the same prompts never loads the encoder
    cache_dir: str = ""  # where they go; empty: the user cache directory (h3gen/embeddings in it)
    cache_max_gib: float = 8.0  # past it a run removes the least recently used entries; 0: no limit
    stream_layers: bool = False  # the language layers in host memory, each on the device only while it runs


class Qwen3VLEncoder(Stage):
    kind, name = "encode", "qwen3vl"
    Config = Qwen3VLConfig
    output_neutral = ("max_tokens",)  # which prompts fail, never what a clip that renders holds
    text_encoder = media = None  # until `load`
    description = ("Qwen3-VL text encoder (transformers), truncated after the layer H3 reads; fl2va keyframes and "
                   "ref2va references through diffusers' blocks and the VAE encoders")

    @classmethod
    def check_config(cls, config) -> None:
        """The preset's encode values (Stage.check_config)."""
        if config.max_tokens < 1:
            raise UsageError(f"encode.max_tokens is {config.max_tokens}, so every prompt would be over it",
                             "set encode.max_tokens to a positive token count (1024 by default)")
        if not 0 <= config.cache_max_gib < float("inf"):
            raise UsageError(f"encode.cache_max_gib is {config.cache_max_gib:g}, which no cache can be held to",
                             "give GiB above 0, or 0 for no limit")

    @classmethod
    def check_model(cls, config, repo) -> None:
        """The hidden state H3 reads must be one the text encoder has."""
        total = repo.text_encoder_layers()
        if not 0 <= config.layer < total:
            raise UsageError(f"encode.layer is {config.layer}, and the text encoder in {repo.path('text_encoder')} has "
                             f"{total} layers", f"set encode.layer from 0 to {total - 1}; H3 reads 50")

    def load(self, repo):
        """Tokenizer now; the encoder's weights only when a prompt is not in the embedding cache."""
        from transformers import Qwen2TokenizerFast

        from h3gen.models.conditions import MediaConditioner

        self.repo, self.text_encoder, self.encoder_loads = repo, None, 0
        self.media = MediaConditioner(self.runtime, repo)  # loads its VAEs on the first conditioned clip
        self.tokenizer = repo.load("tokenizer", Qwen2TokenizerFast)
        self.cache = None
        if self.config.cache and hasattr(repo, "text_encoder_identity"):
            from pathlib import Path

            from h3gen.run.embedding_cache import EmbeddingCache

            # The device kind too: another device's kernels round differently (and draws other random weights).
            # The quant stage with all its knobs: which roles and layers it quantizes decides the embeddings too.
            quant = self.runtime.quant  # its Config is a dataclass, or None where a stage is built by hand
            knobs = dataclasses.asdict(quant.config) if dataclasses.is_dataclass(quant.config) else quant.config
            settings = dict(layer=self.config.layer, dtype=str(self.runtime.dtype), quant=f"{quant.name} {knobs!r}",
                            device=self.runtime.device.split(":")[0])
            self.cache = EmbeddingCache(repo.text_encoder_identity(), settings,
                                        Path(self.config.cache_dir).expanduser() if self.config.cache_dir else None,
                                        int(self.config.cache_max_gib * 2**30))

    def load_encoder(self):
        from transformers import Qwen3VLForConditionalGeneration, Qwen3VLProcessor

        repo = self.repo
        self.encoder_loads += 1
        self.check_model(self.config, repo)
        config = repo.text_encoder_config()
        # One layer past the one H3 reads: hidden_states[layer] is then still unnormalized.
        config.text_config.num_hidden_layers = self.config.layer + 1
        self.processor = repo.load("processor", Qwen3VLProcessor)
        stream = self.config.stream_layers
        self.text_encoder = repo.load("text_encoder", Qwen3VLForConditionalGeneration, config=config,
                                      dtype=self.runtime.dtype, device_map="cpu" if stream else self.runtime.device).eval()
        if stream:
            from h3gen.models.offload import stream_text_encoder

            self.text_encoder = stream_text_encoder(self.text_encoder, self.runtime)
        else:
            self.text_encoder = self.runtime.quantize("text_encoder", self.text_encoder)

    def prompt_tokens(self, prompt: str) -> list[int]:
        token_ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        if len(token_ids) > self.config.max_tokens:
            raise ClipError(f"prompt is {len(token_ids)} tokens, over the encoder limit of {self.config.max_tokens}",
                            "shorten the prompt")
        return token_ids

    def run(self, clip):
        token_ids = self.prompt_tokens(clip.request.prompt)
        if clip.request.task != "t2va":
            return self.run_conditioned(clip)
        cached = self.cache.get(clip.request.prompt) if self.cache else None
        if cached is not None:
            embeds, clip.text_token_tags = cached
            clip.prompt_embeds = embeds.to(self.runtime.device)
            clip.encode_cached = True
            return clip
        import torch

        clip.prompt_embeds = self.hidden_state(token_ids, {})
        clip.text_token_tags = torch.full((len(token_ids),), TEXT_TAG, dtype=torch.long)
        if self.cache:
            self.cache.put(clip.request.prompt, clip.prompt_embeds, clip.text_token_tags)
        return clip

    def run_conditioned(self, clip):
        import torch

        if self.text_encoder is None:
            self.load_encoder()
        request, measure = clip.request, self.runtime.timer.measure
        with measure(clip, "conditions", report=False):
            media = self.media.prepare(request)
        token_ids, clip.text_token_tags, vision = self.media.presentation(self.tokenizer, self.processor,
                                                                          request.prompt, media)
        clip.prompt_embeds = self.hidden_state(token_ids, vision)
        with torch.inference_mode(), measure(clip, "conditions", report=False):
            clip.conditions = self.media.encode(media)
        return clip

    def hidden_state(self, token_ids, vision):
        import torch
        from diffusers.modular_pipelines.minimax_h3.encoders import get_qwen3vl_prompt_embeds

        if self.text_encoder is None:
            self.load_encoder()
        with torch.inference_mode():
            return get_qwen3vl_prompt_embeds(self.text_encoder, self.processor, token_ids, vision,
                                             text_encoder_layer=self.config.layer, device=self.runtime.device,
                                             dtype=self.runtime.dtype)

    def unload(self):
        self.text_encoder = self.processor = None
        if self.media is not None:
            self.media.unload()
