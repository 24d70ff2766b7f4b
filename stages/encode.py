"""Text encode: Qwen3-VL, read at the unnormalized hidden state after layer 50 (the layers past it never run)."""

from __future__ import annotations

import dataclasses

from h3gen.errors import ClipError, ModelError
from h3gen.stages.base import Stage

TEXT_TAG = 1  # the AdaLN table's modality tag of a text row: a checkpoint contract


@dataclasses.dataclass
class Qwen3VLConfig:
    layer: int = 50
    max_tokens: int = 1024
    cache: bool = True  # prompt embeddings on disk: a rerun over the same prompts never loads the encoder
    cache_dir: str = ""  # where they go; empty: the user cache directory (h3gen/embeddings in it)


class Qwen3VLEncoder(Stage):
    kind, name = "encode", "qwen3vl"
    Config = Qwen3VLConfig
    description = "Qwen3-VL text encoder (transformers), truncated after the layer H3 reads"

    def load(self, repo):
        """Tokenizer now; the encoder's weights only when a prompt is not in the embedding cache."""
        from transformers import Qwen2TokenizerFast

        self.repo, self.text_encoder, self.encoder_loads = repo, None, 0
        self.tokenizer = repo.load("tokenizer", Qwen2TokenizerFast)
        self.cache = None
        if self.config.cache and hasattr(repo, "text_encoder_identity"):
            from pathlib import Path

            from h3gen.embedding_cache import EmbeddingCache

            # The device kind too: another device's kernels round differently (and draws other random weights).
            settings = dict(layer=self.config.layer, dtype=str(self.runtime.dtype), quant=self.runtime.quant.name,
                            device=self.runtime.device.split(":")[0])
            self.cache = EmbeddingCache(repo.text_encoder_identity(), settings,
                                        Path(self.config.cache_dir).expanduser() if self.config.cache_dir else None)

    def load_encoder(self):
        from transformers import Qwen3VLForConditionalGeneration, Qwen3VLProcessor

        repo = self.repo
        self.encoder_loads += 1
        config = repo.text_encoder_config()
        total = config.text_config.num_hidden_layers
        if total <= self.config.layer:
            raise ModelError(f"the text encoder has {total} layers, H3 reads hidden state {self.config.layer}",
                            "use the repository's own text_encoder/")
        # One layer past the one H3 reads: hidden_states[layer] is then still unnormalized.
        config.text_config.num_hidden_layers = self.config.layer + 1
        self.processor = repo.load("processor", Qwen3VLProcessor)
        self.text_encoder = repo.load("text_encoder", Qwen3VLForConditionalGeneration, config=config,
                                      dtype=self.runtime.dtype, device_map=self.runtime.device).eval()
        self.text_encoder = self.runtime.quantize("text_encoder", self.text_encoder)

    def run(self, clip):
        import torch
        from diffusers.modular_pipelines.minimax_h3.encoders import get_qwen3vl_prompt_embeds

        token_ids = self.tokenizer(clip.request.prompt, add_special_tokens=False)["input_ids"]
        if len(token_ids) > self.config.max_tokens:
            raise ClipError(f"prompt is {len(token_ids)} tokens, over the encoder limit of {self.config.max_tokens}",
                            "shorten the prompt")
        cached = self.cache.get(clip.request.prompt) if self.cache else None
        if cached is not None:
            embeds, clip.text_token_tags = cached
            clip.prompt_embeds = embeds.to(self.runtime.device)
            clip.notes["encode_cached"] = True
            return clip
        if self.text_encoder is None:
            self.load_encoder()
        with torch.inference_mode():
            clip.prompt_embeds = get_qwen3vl_prompt_embeds(
                self.text_encoder, self.processor, token_ids, {}, text_encoder_layer=self.config.layer,
                device=self.runtime.device, dtype=self.runtime.dtype)
        clip.text_token_tags = torch.full((len(token_ids),), TEXT_TAG, dtype=torch.long)
        if self.cache:
            self.cache.put(clip.request.prompt, clip.prompt_embeds, clip.text_token_tags)
        return clip

    def unload(self):
        self.text_encoder = self.processor = None
