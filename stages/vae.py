"""Decode: the video VAE to uint8 frames, the mono audio VAE twice (one stereo channel per batch item).

`reference` is diffusers' decode as shipped. `fast`:
diffusers' AutoencoderKLMiniMaxH3 weights, the tiles of a whole clip batched through the
ViT decoder, frames made uint8 on the device and copied to host memory chunk by chunk while the decode goes on.

Where diffusers' decode spends its time, and what this stage does about it:
- a Python loop of one decoder forward per tile and temporal chunk (392 for the 10 s 1344x768 clip): every tile of
  every chunk has the same shape, so `tile_batch` of them share a forward, sized from free device memory;
- the decoder itself (separate Q/K/V GEMMs, SDPA's default attention pick, unfused elementwise passes): see
  models/vae/vit.py; `exact = true` keeps diffusers' own decoder modules;
- the whole clip decoded to one bf16 tensor, then turned into float, normalized and rounded in several passes, then
  copied to the host at the end: here each chunk's finished frames go through one Triton kernel into uint8 and are
  copied to pinned host memory on a side stream while the next tiles decode;
- the soundtrack decodes first, so a mux started with the decode (h3gen.run.arriving) encodes it while the frames
  decode and little is left to encode when the decode ends.
Blending is diffusers' own arithmetic (models/vae/tiles.py), so batching or splitting the tiles over ranks does not
change the frames.
"""

from __future__ import annotations

import dataclasses

from h3gen.errors import UsageError
from h3gen.models.vae.host_frames import PIXEL_MEAN, PIXEL_STD, HostFrames
from h3gen.stages.base import DAMAGED_WEIGHTS_FIX, ReturnedRefused, Stage, Wrapper


def fold_weight_norms(model):
    """Bake each weight-normed layer's weight in once (the audio VAE's convolutions): the same values its forward
    would compute, computed at load rather than left behind by the first clip's forward."""
    import torch
    from torch.nn.utils import remove_weight_norm
    from torch.nn.utils.weight_norm import WeightNorm

    with torch.no_grad():
        for module in model.modules():
            for hook in [h for h in module._forward_pre_hooks.values() if isinstance(h, WeightNorm)]:
                remove_weight_norm(module, hook.name)
    return model


def finite(tensor) -> bool:
    import torch

    return bool(torch.isfinite(tensor).all())


def denormalized(latents, config):
    """Latents in the VAE's own scale: the sampler's are normalized per channel (dim 1) by the VAE's mean and std."""
    import torch

    shape = (1, -1) + (1,) * (latents.dim() - 2)
    mean = torch.tensor(config.latents_mean, device=latents.device).view(shape)
    std = torch.tensor(config.latents_std, device=latents.device).view(shape)
    return latents * std + mean


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
        self.audio_vae = fold_weight_norms(repo.load("audio_vae", AutoencoderKLMiniMaxH3Audio,
                                                     torch_dtype=torch.float32, device_map=device).eval())
        self.sample_rate = self.audio_vae.config.sampling_rate

    def run(self, clip):
        import torch

        measure = self.runtime.timer.measure
        with torch.inference_mode():
            with measure(clip, "vae_video", report=False):
                frames, frames_finite = self.decode_video(clip.video_latents)
            with measure(clip, "vae_audio", report=False):
                audio = self.decode_audio(clip.audio_latents)
            self.refuse_nonfinite(frames_finite, finite(audio))
            with measure(clip, "transfer", report=False):
                clip.frames, clip.audio = frames.cpu().numpy(), audio.cpu().numpy()
        clip.sample_rate = self.sample_rate
        return clip

    def decode_video(self, latents):
        """(uint8 frames, whether the decoder's output was finite)."""
        import torch

        from h3gen.kernels.frames import frames_reference

        device = self.runtime.device
        video = self.vae.decode(denormalized(latents, self.vae.config).to(self.vae.dtype), return_dict=False)[0]
        # Frames become uint8 once, on the device, in the (T, H, W, RGB) layout the encoder reads.
        pixel_mean, pixel_std = torch.tensor(PIXEL_MEAN, device=device), torch.tensor(PIXEL_STD, device=device)
        return frames_reference(video[0], pixel_mean, pixel_std), finite(video)

    def decode_audio(self, latents):
        audio = self.audio_vae.decode(denormalized(latents.float(), self.audio_vae.config), return_dict=False)[0]
        return audio.float()[:, 0]

    def refuse_nonfinite(self, frames_finite: bool, audio_finite: bool) -> None:
        """A decode of finite latents (the run loop checks them) that gave NaN or infinite values would clamp them
        into black frames or hand the encoder a soundtrack it refuses: the clip is refused, the weights named."""
        broken = [name for name, ok in (("the frames", frames_finite), ("the soundtrack", audio_finite)) if not ok]
        if broken:
            raise ReturnedRefused(f"{self.label()} decoded {' and '.join(broken)} to NaN or infinite values",
                                  DAMAGED_WEIGHTS_FIX)

    def unload(self):
        self.vae = self.audio_vae = None



DIFFUSERS_TILE, DIFFUSERS_OVERLAP = 256, 64


@dataclasses.dataclass
class FastVAEConfig:
    # diffusers' own decoder modules and default tiling: the reference stage's frames, only batched.
    exact: bool = False
    # A tile's height in pixels (a multiple of 16); diffusers' default keeps its tiling.
    tile_height: int = DIFFUSERS_TILE
    # A tile's width in pixels (a multiple of 16); diffusers' default keeps its tiling.
    tile_width: int = DIFFUSERS_TILE
    # The least overlap of neighbouring tiles in pixels (a multiple of 16, under the tile's sides); diffusers' default
    # keeps its tiling.
    overlap: int = DIFFUSERS_OVERLAP
    # Tiles per decoder forward; 0 picks the most that half the free device memory holds, up to max_tile_batch.
    tile_batch: int = 0
    # The most tiles a forward when tile_batch is 0.
    max_tile_batch: int = 16
    # Attention backend of the fast decoder (h3gen.kernels.attention): sdpa (PyTorch's own pick, the kernel diffusers'
    # decoder runs), auto, fa3, flash-attn-4, sdpa-cudnn, sdpa-flash, and the FP8 ones triton-fp8, cudnn-fp8, fa3-fp8.
    attention: str = "sdpa"
    # torch.compile around one decoder block (one compile serves all blocks; the first clip pays for it). Inductor
    # writes its own norms: it needs exact_norms = false.
    compile: bool = False
    # The residual stream's norms take their statistic from torch: with attention = "sdpa" the frames are diffusers'
    # (measured on an H200, the 10 s clip), for 4 % more time; false leaves a few values a level or two away.
    exact_norms: bool = True


class FastVAE(ReferenceVAE):
    kind, name = "vae", "fast"
    Config = FastVAEConfig
    description = ("AutoencoderKLMiniMaxH3 with the clip's tiles batched, fused QKV and fused kernels rounding as "
                   "diffusers' ops do, uint8 frames on the device copied out chunk by chunk; exact = true runs "
                   "diffusers' own decoder modules")
    hands_over_frames = True  # fills a clip's `arriving` media chunk by chunk, for a mux started with the decode

    def __init__(self, config, runtime):
        super().__init__(config, runtime)
        self.group = None
        self.check_config(config)

    @classmethod
    def check_config(cls, config) -> None:
        from h3gen.kernels.attention_names import check_backend_name

        check_backend_name("vae.attention", config.attention)
        sizes = (config.tile_height, config.tile_width, config.overlap)
        if any(size <= 0 or size % 16 for size in sizes) or config.overlap >= min(sizes[:2]):
            raise UsageError(f"vae tile {config.tile_height}x{config.tile_width} with overlap {config.overlap} "
                             "is not a tiling", "use positive multiples of 16, the overlap smaller than the tile")
        if config.exact and sizes != (DIFFUSERS_TILE, DIFFUSERS_TILE, DIFFUSERS_OVERLAP):
            raise UsageError("vae.exact = true decodes with diffusers' tiling",
                             "leave tile_height, tile_width and overlap at 256, 256, 64, or set exact = false")
        if config.tile_batch < 0 or config.max_tile_batch < 1:
            raise UsageError("vae.tile_batch must be 0 (auto) or more, vae.max_tile_batch 1 or more")
        if config.compile and config.exact_norms and not config.exact:
            raise UsageError("vae.compile = true lets inductor write the decoder's norms, so its frames are not "
                             "diffusers' (vae.exact_norms = true asks for that)",
                             "set vae.exact_norms = false with vae.compile = true, or leave compile off")

    @classmethod
    def check_device(cls, config, device, dtype) -> None:
        """An attention backend named outright that cannot run here (the fast decoder's; exact runs diffusers')."""
        if not config.exact:
            from h3gen.kernels.attention import check_runs

            check_runs("vae.attention", config.attention, device, dtype)

    def load(self, repo):
        from h3gen.models.vae.vit import FastViTDecoder

        super().load(repo)
        vae = self.vae
        if self.config.exact:
            self.decoder = lambda tiles: vae.decoder(vae.post_quant_conv(tiles))
        else:
            self.decoder = FastViTDecoder(vae, self.config.attention, self.config.compile, self.config.exact_norms)

    def load_note(self) -> str:
        """The decoder's attention backend when the preset names one, with the reason when another runs."""
        if self.config.exact or self.config.attention == "sdpa":
            return ""
        return f"decoder attention {self.decoder.attention_used()}"

    def lead(self) -> bool:
        """Whether this rank ends up with the frames: always alone, the group's first rank in a group."""
        from h3gen.parallel.vae_split import is_lead

        return self.group is None or is_lead(self.group)

    def parallelize(self, group) -> None:
        """Split the clip's tile batches over `group`; the group's first rank gathers them and alone gets frames
        and audio (the others get None). The batches are the one-rank decode's, so the frames are identical."""
        self.group = group

    def run(self, clip):
        import torch

        measure = self.runtime.timer.measure
        lead = self.lead()
        media = clip.arriving if lead else None
        with torch.inference_mode():
            with measure(clip, "vae_audio", report=False):  # first: a mux started with the decode encodes it now
                audio = self.decode_audio(clip.audio_latents) if lead else None
                audio_finite = audio is None or finite(audio)
                if media is not None and audio_finite:
                    media.sound(audio.cpu().numpy())
            with measure(clip, "vae_video", report=False):
                frames = self.decode_frames(clip.video_latents, media)
            if lead:  # after the decode: in a group every rank is through its collectives
                self.refuse_nonfinite(frames.finite(), audio_finite)
            if media is not None:  # the mux waits for the frames' copies itself
                media.finish()
            else:
                with measure(clip, "transfer", report=False):
                    clip.frames = frames.wait() if lead else None
                    clip.audio = audio.cpu().numpy() if lead else None
        clip.sample_rate = self.sample_rate
        return clip

    def decode_frames(self, latents, media=None):
        """uint8 frames of `latents` (1, C, T, H, W) on their way to host memory: a `HostFrames` (None off the lead).
        With `media` (`h3gen.run.arriving`), each chunk is handed to the mux as it lands."""
        import torch

        frames = None
        if self.lead():
            frames = HostFrames(self.plan(latents.shape), torch.device(self.runtime.device), media)
            if media is not None:
                media.open(frames.frames.numpy(), self.sample_rate)
        self.decode(latents, frames.write if frames is not None else None)
        return frames

    def plan(self, latent_shape):
        from h3gen.models.vae.tiles import plan_decode

        config = self.config
        return plan_decode(self.vae, latent_shape, config.tile_height, config.tile_width, config.overlap,
                           config.overlap)

    def decode(self, latents, emit) -> None:
        """Decode `latents` (1, C, T, H, W) and hand the frames, in the VAE's normalized pixel space, to
        `emit((3, n, H, W))` in clip order; across a group only the first rank emits (the others pass None)."""
        import torch

        from h3gen.parallel import vae_split
        from h3gen.models.vae.tiles import ChunkJoiner, pad_latents

        vae, plan = self.vae, self.plan(latents.shape)
        # The reference's casts, in its order: the model's dtype, then the first decoder module's.
        latents = denormalized(latents, vae.config).to(vae.dtype).to(vae.post_quant_conv.weight.dtype)
        latents = pad_latents(latents[0], plan)
        batches = self.batches(plan)
        joiner = ChunkJoiner(plan, emit) if emit is not None else None

        def decode(items):
            return self.decoder(torch.stack([plan.latent_tile(latents, i) for i in items]))

        if self.group is not None:
            vae_split.decode_across(self.group, batches, decode, joiner, self.tile_shape(plan))
            return
        for items in batches:
            for item, tile in zip(items, decode(items)):
                joiner.add(item, tile)
        assert joiner.done

    def tile_shape(self, plan):
        """(channels, frames, height, width) and dtype of one decoded tile."""
        decoder = self.vae.decoder
        return (decoder.out_channels, plan.chunk_frames, plan.tile_height, plan.tile_width), decoder.proj_out.weight.dtype

    def batches(self, plan) -> list[range]:
        from h3gen.parallel import vae_split

        size = self.config.tile_batch or self.auto_tile_batch(plan)
        if self.group is not None:
            size = vae_split.agree_tile_batch(size, self.group)
        return [range(start, min(start + size, plan.items)) for start in range(0, plan.items, size)]

    def auto_tile_batch(self, plan) -> int:
        """The most tiles half the free device memory holds (the CPU gains nothing from more than a few)."""
        cap = self.config.max_tile_batch
        if not self.runtime.device.startswith("cuda"):
            return min(cap, 4)
        from h3gen.run.memory import free_bytes

        # within the run's memory budget when it has one: the allocator's cap, not the device's free memory
        return max(1, min(cap, int(free_bytes(self.runtime.device) * 0.5 // self.tile_bytes(plan))))

    def tile_bytes(self, plan) -> int:
        """Peak bytes one tile adds to a forward: about 80 bytes per token and model channel (float32 residual,
        its norm, QKV, float32 Q/K, the 8x-wide SwiGLU input and output), plus the decoded pixels a few times over."""
        decoder, ratio = self.vae.decoder, plan.ratio
        tokens = plan.chunk_latents * (plan.tile_height // ratio) * (plan.tile_width // ratio)
        (channels, frames, height, width), _ = self.tile_shape(plan)
        return tokens * decoder.proj_in.out_features * 80 + channels * frames * height * width * 2 * 4


class FrameFilter(Wrapper):
    """A `vae` that wraps another and changes its frames: subclasses implement `change(frames)`, which rewrites uint8
    (n, H, W, 3) host frames in place. It sees every frame once, whichever path they take: the finished frames of a
    decode, or the chunks a decode hands a background mux as they land (h3gen.run.arriving)."""

    kind = "vae"
    hands_over_frames = True  # the inner decode's, where it has it: `run` filters the chunks as they land

    def change(self, frames) -> None:
        raise NotImplementedError

    def run(self, clip):
        if clip.arriving is not None:
            clip.arriving.filter(self.change)
        clip = self.inner.run(clip)
        if clip.frames is not None:
            self.change(clip.frames)
        return clip
