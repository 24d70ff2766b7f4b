"""Text encode: Qwen3-VL, read at the unnormalized hidden state after layer 50 (the layers past it never run).

A t2va clip's prompt is kept in the embedding cache. The prompts of a chunk (`prepare_chunk`) that have one token
count and are not in the cache are encoded together, up to `batch_tokens` rows a forward: one forward for several
prompts spends the host's kernel launches once (the encoder waits on them, not on the device), and a prompt's rows
come out as its own forward gives them, to rounding. A conditioned clip's prompt is presented
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
    batch_tokens: int = 1024  # prompts of one token count encoded in one forward of at most this many rows; 0: alone
    cache: bool = True  # prompt embeddings on disk: a rerun over the same prompts never loads the encoder
    cache_dir: str = ""  # where they go; empty: the user cache directory (h3gen/embeddings in it)
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
        if config.batch_tokens < 0:
            raise UsageError(f"encode.batch_tokens is {config.batch_tokens}",
                             "set encode.batch_tokens to a token count (1024 by default), or 0 to encode each prompt "
                             "alone")

    @classmethod
    def check_model(cls, config, repo) -> None:
        """The hidden state H3 reads must be one the text encoder has."""
        total = repo.text_encoder_config().text_config.num_hidden_layers
        if not 0 <= config.layer < total:
            raise UsageError(f"encode.layer is {config.layer}, and the text encoder in {repo.path('text_encoder')} has "
                             f"{total} layers", f"set encode.layer from 0 to {total - 1}; H3 reads 50")

    def load(self, repo):
        """Tokenizer now; the encoder's weights only when a prompt is not in the embedding cache."""
        from transformers import Qwen2TokenizerFast

        from h3gen.models.conditions import MediaConditioner

        self.repo, self.text_encoder, self.encoder_loads = repo, None, 0
        self.ready = {}  # clip index -> its prompt's rows, encoded with others (prepare_chunk)
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
                                        Path(self.config.cache_dir).expanduser() if self.config.cache_dir else None)

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

        ready = self.ready.pop(clip.request.index, None)
        clip.prompt_embeds = ready if ready is not None else self.hidden_state(token_ids, {})
        clip.text_token_tags = torch.full((len(token_ids),), TEXT_TAG, dtype=torch.long)
        if self.cache:
            self.cache.put(clip.request.prompt, clip.prompt_embeds, clip.text_token_tags)
        return clip

    def prepare_chunk(self, clips) -> list:
        """Encode the chunk's t2va prompts that the cache lacks, those of one token count together, `batch_tokens`
        rows a forward (a prompt written twice is one row); `run` then takes each clip's rows. Returns the clips
        served so. A group that fails (out of memory) is left to `run`, each of its prompts alone."""
        from h3gen.errors import ModelError

        self.ready = {}
        for group in self.groups(clips):
            rows = list(dict.fromkeys(tokens for _, tokens in group))
            if len(group) < 2:
                continue  # one clip's prompt: its own forward, diffusers' call, in `run`
            try:
                hidden = self.hidden_states([list(row) for row in rows])
            except ModelError:  # the run stops, as it would at the first prompt alone
                raise
            except Exception:  # each prompt then encodes alone in `run`, where an error fails its own clip
                continue
            self.ready.update({clip.request.index: hidden[rows.index(tokens)][None] for clip, tokens in group})
        return [clip for clip in clips if clip.request.index in self.ready]

    def groups(self, clips) -> list[list]:
        """The (clip, token ids) of the chunk's t2va prompts that the cache lacks, by token count, each group at
        most `batch_tokens` rows of distinct prompts; none with `batch_tokens` 0."""
        by_count = {}
        if self.config.batch_tokens <= 0:
            return []
        for clip in clips:
            request = clip.request
            if request.task != "t2va" or (self.cache and self.cache.holds(request.prompt)):
                continue
            try:
                tokens = tuple(self.prompt_tokens(request.prompt))
            except ClipError:  # its clip fails in `run`
                continue
            by_count.setdefault(len(tokens), []).append((clip, tokens))
        groups = []
        for members in by_count.values():
            per_forward, group, rows = self.config.batch_tokens // max(1, len(members[0][1])), [], set()
            for clip, tokens in members:
                if group and tokens not in rows and len(rows) >= per_forward:
                    groups.append(group)
                    group, rows = [], set()
                group.append((clip, tokens))
                rows.add(tokens)
            groups.append(group)
        return groups

    def hidden_states(self, rows):
        """`hidden_state` for prompts of one token count, in one forward: what diffusers' call does for one."""
        import torch

        if self.text_encoder is None:
            self.load_encoder()
        device = self.runtime.device
        with torch.inference_mode():
            ids = torch.tensor(rows, dtype=torch.long, device=device)
            types = torch.tensor(self.processor.create_mm_token_type_ids(rows), dtype=torch.long, device=device)
            states = self.text_encoder.model(input_ids=ids, attention_mask=torch.ones_like(ids),
                                             mm_token_type_ids=types, use_cache=False, output_hidden_states=True)
            return states.hidden_states[self.config.layer].to(dtype=self.runtime.dtype)

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
        self.ready = {}
        if self.media is not None:
            self.media.unload()

