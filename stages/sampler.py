"""The denoise loop: one DiT forward and one scheduler step per sigma, video and audio on their own schedules.

The packed layout ([text, conditions, audio, video] rows with their rotary positions and modality tags), the noise
draw order (conditioning noise first, one draw per visual condition, then the video latents, then the audio rows,
from one CPU generator) and the Euler step are the reference's, so a clip is reproducible from its seed on any
device. Conditioning rows (fl2va keyframes, ref2va references) lead the video and audio rows and are never stepped.
"""

from __future__ import annotations

import dataclasses
import math

from h3gen.errors import ClipError, UsageError
from h3gen.inputs.request import AUDIO_CHANNELS, AUDIO_LATENT_CHANNELS, VIDEO_LATENT_CHANNELS
from h3gen.models.dit.tags import AUDIO_TAG, VIDEO_TAG
from h3gen.stages.base import Stage
from h3gen.stages.clip import FORWARDS_PART

# The t (= 1 - sigma) a visual condition is held at: H3 was trained with its anchors noised just short of clean
# (diffusers' keyframe_noise_aug). Reference soundtracks ride along clean, at t = 1. Checkpoint contracts, both.
CONDITION_T, AUDIO_CONDITION_T = 0.999, 1.0
# Each task's checkpoint partition: ref2va has a DiT of its own, with the same architecture.
MAX_STEPS = 1000  # H3 takes 50 points; a grid far beyond would only fill memory with its schedule
PARTITIONS = {"t2va": "transformer", "fl2va": "transformer", "ref2va": "transformer_ref"}


@dataclasses.dataclass
class EulerConfig:
    steps: int = 50  # sigma grid points, terminal 0 included: 50 points = 49 forwards
    sigma_positions: list[float] = dataclasses.field(default_factory=list)  # explicit grid before the shift
    video_shift: float = 12.0  # the shift of the video latents' sigma schedule
    audio_shift: float = 3.0  # the shift of the audio latents' sigma schedule
    dit: str = "h3gen"  # "h3gen": h3gen's DiT (fused kernels, AdaLN tables); "diffusers": the reference transformer
    triton: bool = True  # h3gen DiT: Triton kernels for norm/modulate, QK-norm + RoPE, SwiGLU, gated residual
    adaln_table: bool = True  # h3gen DiT: modulation rows precomputed for the schedule, adaln_proj dropped
    compile: bool = False  # h3gen DiT: regional torch.compile of each block
    # h3gen DiT: auto, fa3, flash-attn-4, sdpa-cudnn, sdpa-flash, sdpa, triton-fp8, cudnn-fp8, fa3-fp8 (fa3 and
    # fa3-fp8 fall back to auto's pick where fa3-fwd is missing or refuses, the reason in the run's attention field)
    attention: str = "auto"
    ffn_chunk_rows: int = 0  # h3gen DiT: feed-forward over chunks of this many rows (0: all), less peak memory
    exact_norms: bool = False  # h3gen DiT, Triton: norm statistics from torch, rounding as diffusers does (slower)
    stream_blocks: int = 0  # h3gen DiT: the last N blocks' weights kept in host memory, streamed in as they run
    # what streams them: "h3gen" (its own streamer, AdaLN tables resident) or "diffusers" (diffusers' group
    # offloading over every block, to compare against; the blocks load on the device first)
    stream_with: str = "h3gen"


def sigma_schedule(config: EulerConfig, shift: float):
    """The sigma grid one modality walks: `steps` points of linspace(1, 0), or the explicit positions, shifted."""
    from diffusers import MiniMaxH3Scheduler

    scheduler = MiniMaxH3Scheduler(shift=shift)
    if config.sigma_positions:
        scheduler.set_timesteps(sigmas=shifted_grid(config, shift))
    else:
        scheduler.set_timesteps(config.steps)
    return scheduler


def shifted_grid(config: EulerConfig, shift: float):
    """The sigma grid before the scheduler collapses float32 collisions: the positions (or `steps` points of
    linspace(1, 0)) through H3's shift, sigma' = shift * sigma / (1 + (shift - 1) * sigma), in float32."""
    import torch

    base = (torch.tensor(config.sigma_positions, dtype=torch.float32) if config.sigma_positions
            else torch.linspace(1.0, 0.0, config.steps, dtype=torch.float32))
    return shift * base / (1 + (shift - 1) * base)


def grid_problem(config: EulerConfig, shift: float) -> str:
    """Why the shifted grid cannot drive one forward per point but the last ('' when it can): a value that is not
    finite, or two points (or their timesteps, 1 - sigma) that float32 cannot tell apart."""
    import torch

    sigmas = shifted_grid(config, shift)
    if not torch.isfinite(sigmas).all():
        return "gives sigmas that are not finite"
    timesteps = 1 - sigmas[:-1]
    if (sigmas[1:] >= sigmas[:-1]).any() or (timesteps[1:] <= timesteps[:-1]).any():
        return f"gives {len(sigmas)} points that float32 cannot all tell apart"
    return ""


def forwards(config) -> int:
    """DiT forwards a sampler config runs (this stage's or diffusers'): one per sigma grid point but the terminal 0."""
    return (len(getattr(config, "sigma_positions", None) or ()) or config.steps) - 1


def forward_timesteps(config: EulerConfig) -> list[list[float]]:
    """What each t2va forward gets as `timestep`: its distinct (video, audio) values in float32, sorted. The AdaLN
    table embeds each such group in a batch of its own, so its rows are the reference's rows bit for bit."""
    import torch

    video, audio = (sigma_schedule(config, shift).timesteps for shift in (config.video_shift, config.audio_shift))
    return [torch.unique(torch.tensor([float(t), float(a)], dtype=torch.float32)).tolist()
            for t, a in zip(video, audio)]


class EulerSampler(Stage):
    kind, name = "sampler", "euler"
    Config = EulerConfig
    description = ("rectified-flow Euler over h3gen's DiT (dit = \"h3gen\") or diffusers' "
                   "MiniMaxH3Transformer3DModel (dit = \"diffusers\")")
    splits_clip = True
    group = None  # the process group the DiT is sequence-parallel over, once `parallelize` has run

    @classmethod
    def refuses_split(cls, config) -> str:
        if config.dit != "h3gen":
            return (f"Ulysses sequence parallelism (one clip across devices) needs sampler.dit = \"h3gen\", not "
                    f"\"{config.dit}\"")
        return ""

    @classmethod
    def refuses_cache(cls, config) -> str:
        return "" if config.dit == "h3gen" else (f'the step cache runs on sampler.dit = "h3gen" (--set sampler.dit=h3gen), '
                                                 f'and this preset has "{config.dit}"')

    def load_note(self) -> str:
        return f"attention {self.attention_used}"

    def __init__(self, config, runtime):
        super().__init__(config, runtime)
        self.check_config(config)
        self.drawing = None  # the host thread `prepare` draws noise on

    @classmethod
    def check_config(cls, config) -> None:
        """The preset's sampler values (Stage.check_config)."""
        from h3gen.kernels.attention_names import check_backend_name

        positions = config.sigma_positions
        listed = "list the positions from the highest to 0, each one below the last, e.g. [0.999, 0.5, 0]"
        if len(positions) == 1:
            raise UsageError(f"sampler.sigma_positions {positions} is one point, and the sigma grid needs at least 2",
                             listed)
        if not positions and config.steps < 2:
            raise UsageError("the sigma grid needs at least 2 points", "set sampler.steps >= 2")
        if max(config.steps, len(positions)) > MAX_STEPS:
            raise UsageError(f"the sigma grid has {max(config.steps, len(positions))} points, more than "
                             f"h3gen runs ({MAX_STEPS})", f"set sampler.steps to at most {MAX_STEPS}; H3 takes 50")
        if any(not 0 <= p <= 1 for p in positions) or any(a <= b for a, b in zip(positions, positions[1:])):
            raise UsageError(f"sampler.sigma_positions {positions} is not a decreasing grid within 0 to 1", listed)
        if positions and positions[-1] != 0:
            raise UsageError(f"sampler.sigma_positions {positions} does not end at 0, where the clip is clean", listed)
        for key in ("video_shift", "audio_shift"):
            shift = getattr(config, key)
            if not 0 < shift < math.inf:  # nan fails this too
                raise UsageError(f"sampler.{key} is {shift}, and a sigma shift must be above 0 and finite",
                                 f"set sampler.{key} to a positive number (H3: video 12, audio 3)")
            problem = grid_problem(config, shift)
            if problem:
                raise UsageError(f"sampler.{key} = {shift} {problem}, so the sampler would run fewer "
                                 f"forwards than its {forwards(config)}",
                                 f"set sampler.{key} nearer 1 (H3: video 12, audio 3), or take fewer steps")
        if config.dit not in ("h3gen", "diffusers"):
            raise UsageError(f"unknown sampler.dit '{config.dit}'", "choose diffusers or h3gen")
        if config.stream_blocks < 0:
            raise UsageError(f"sampler.stream_blocks is {config.stream_blocks}",
                             "set it to 0 to keep every block resident, or to a count of blocks to stream")
        if config.stream_blocks and config.dit != "h3gen":
            raise UsageError('sampler.stream_blocks streams the blocks of h3gen\'s DiT', 'set sampler.dit = "h3gen"')
        if config.stream_with not in ("h3gen", "diffusers"):
            raise UsageError(f"unknown sampler.stream_with '{config.stream_with}'", "choose h3gen or diffusers")
        check_backend_name("sampler.attention", config.attention)
        if config.ffn_chunk_rows < 0:
            raise UsageError(f"sampler.ffn_chunk_rows is {config.ffn_chunk_rows}",
                             "set it to 0 (all rows at once) or a positive row count")

    @classmethod
    def check_device(cls, config, device, dtype) -> None:
        """An attention backend named outright that cannot run here (h3gen's DiT; diffusers' runs SDPA)."""
        if config.dit == "h3gen":
            from h3gen.kernels.attention import check_runs

            check_runs("sampler.attention", config.attention, device, dtype)

    @classmethod
    def check_model(cls, config, repo) -> None:
        """Blocks to stream must be blocks the DiT has."""
        blocks = repo.transformer_config().get("num_layers", 0)
        if config.stream_blocks > blocks:
            raise UsageError(f"sampler.stream_blocks is {config.stream_blocks}, and the DiT in "
                             f"{repo.path('transformer')} has {blocks} blocks",
                             f"set sampler.stream_blocks from 0 to {blocks}; {blocks} streams every block")

    def load(self, repo):
        self.repo, self.partition = repo, None
        self.use_partition("transformer")

    def use_partition(self, partition: str) -> None:
        """Make `partition` the resident DiT. One at a time: each is the whole 33 B DiT, so a run that mixes ref2va
        with the other tasks reloads at every switch (keep the ref2va lines together)."""
        if partition == self.partition:
            return
        if partition == "transformer_ref":
            self.check_ref_partition()
        if self.partition is not None:
            from h3gen.run import memory

            self.dit = self.partition = None
            memory.settle(self.runtime.device)
        dit = self.load_fast_dit(partition) if self.config.dit == "h3gen" else self.load_reference_dit(partition)
        self.dit = self.runtime.quantize("dit", dit.eval())
        if self.config.stream_blocks and self.config.stream_with == "diffusers":
            from h3gen.models.offload import group_offload_blocks

            group_offload_blocks(self.dit, self.runtime.device)
        if self.group is not None:
            from h3gen.parallel.ulysses import apply_ulysses

            apply_ulysses(self.dit, self.group)
        self.patch_size = tuple(self.dit.config.patch_size)
        self.partition = partition

    def parallelize(self, group) -> None:
        """Ulysses sequence parallelism: each rank runs the DiT blocks over a slice of the packed rows and gets the
        full velocities back, so noise, Euler steps and latents are the same on every rank."""
        refusal = self.refuses_split(self.config)
        if refusal:
            raise UsageError(refusal, "set sampler.dit=\"h3gen\", or render on one device")
        from h3gen.parallel.ulysses import apply_ulysses

        apply_ulysses(self.dit, group)
        self.group = group

    def check_ref_partition(self) -> None:
        if getattr(self.runtime.quant, "adapter_deltas", None) is not None:
            # diffusers: a LoRA trained on one partition loads into the other and degrades its output.
            raise ClipError("the preset's adapters were trained on transformer/, and ref2va runs transformer_ref/",
                            "render ref2va with a preset without adapters, or give the adapter a tasks contract")
        root = getattr(self.repo, "root", None)
        if root is None:
            return
        if not (root / "transformer_ref").is_dir():
            raise ClipError(f"ref2va runs the transformer_ref/ partition, which {root} does not have",
                            "download transformer_ref/ of MiniMaxAI/MiniMax-H3 into the model directory")
        from h3gen.models.repo import ModelRepo

        ModelRepo(root, components=("transformer_ref",))  # safetensors only, complete and readable

    def load_reference_dit(self, partition: str):
        from diffusers import MiniMaxH3Transformer3DModel

        self.attention_used = "sdpa (PyTorch's choice)"
        return self.repo.load(partition, MiniMaxH3Transformer3DModel, torch_dtype=self.runtime.dtype,
                              device_map=self.runtime.device)

    def load_fast_dit(self, partition: str):
        from h3gen.models.dit.transformer import FastH3Transformer

        config = self.config
        # The conditioning levels are a group of their own; fl2va and ref2va forwards find each of their values in
        # some group, t2va forwards find the group built for them.
        timesteps = (*forward_timesteps(config), [CONDITION_T, AUDIO_CONDITION_T]) if config.adaln_table else None
        quant = self.runtime.quant
        dit = self.repo.load(partition, FastH3Transformer, dtype=self.runtime.dtype, device=self.runtime.device,
                             adaln_timesteps=timesteps, use_triton=config.triton, adaln_table=config.adaln_table,
                             compile_blocks=config.compile, attention_backend=config.attention,
                             ffn_chunk_rows=config.ffn_chunk_rows, exact_norms=config.exact_norms,
                             # each block quantized as it loads, then (the last stream_blocks) moved to host memory
                             place_block=lambda index, block: self.runtime.quantize_part(
                                 "dit", block, f"transformer_blocks.{index}"),
                             stream_blocks=config.stream_blocks if config.stream_with == "h3gen" else 0,
                             # adapters are added per checkpoint tensor, before Q, K, V are fused and the AdaLN
                             # tables built
                             checkpoint_tensor=lambda key, tensor: quant.checkpoint_tensor("dit", key, tensor))
        self.attention_used = dit.attention_used()
        return dit

    def run(self, clip):
        import torch

        self.use_partition(PARTITIONS[clip.request.task])
        with torch.inference_mode():
            layout = self.layout(clip)
            video_rows, audio_rows = self.noise(clip, layout)
            video_rows, audio_rows = self.denoise(clip, layout, video_rows, audio_rows)
            clip.video_latents, clip.audio_latents = self.unpack(layout, video_rows, audio_rows)
        return clip

    def layout(self, clip) -> dict:
        """The packed sequence from diffusers' own builders: [text | keyframes | audio | video] for t2va and fl2va,
        [text | one block per reference | audio | video] for ref2va."""
        from diffusers.modular_pipelines.minimax_h3.before_denoise import (MiniMaxH3PrepareLayoutStep,
                                                                           MiniMaxH3Ref2VAPrepareLayoutStep)

        _, _, frames, height, width = clip.request.video_latent_shape
        shape = dict(latent_frames=frames, latent_height=height, latent_width=width,
                     audio_latents=clip.request.audio_latent_shape[-1])
        target = (frames, height, width, shape["audio_latents"], self.patch_size, AUDIO_CHANNELS, AUDIO_TAG,
                  VIDEO_TAG)
        conditions = clip.conditions
        if clip.request.task == "ref2va":
            packed = MiniMaxH3Ref2VAPrepareLayoutStep.build_ref2va_packed_sequence(
                clip.text_token_tags, conditions.references, conditions.video_latents, conditions.audio_rows, *target)
        else:
            anchors = conditions.keyframe_anchors if conditions is not None else ()
            packed = MiniMaxH3PrepareLayoutStep.build_packed_sequence(clip.text_token_tags, *target, anchors)
        position_ids, token_tags, video_indices, audio_indices, text_indices, held_video, held_audio = packed
        device = self.runtime.device
        return dict(shape, position_ids=position_ids.to(device), token_tags=token_tags.to(device),
                    video_indices=video_indices.to(device), audio_indices=audio_indices.to(device),
                    text_indices=text_indices.to(device), condition_video_rows=held_video,
                    condition_audio_rows=held_audio)

    def prepare(self, clip) -> None:
        """Draw the clip's seeded noise on a host thread now, while the device still works on the clip before it:
        `run` takes the draws instead of the device waiting for them (0.1-0.15 s for a 10 s clip on an H200's
        host, bench/results/2026-12-03T002640Z.json)."""
        if clip.noise is not None:
            return
        if self.drawing is None:
            from concurrent.futures import ThreadPoolExecutor

            self.drawing = ThreadPoolExecutor(1, thread_name_prefix="h3gen-noise")
        clip.noise = self.drawing.submit(self.draw, clip)

    def draw(self, clip):
        """The clip's noise on the host in the order its seed draws it (the order is part of what a seed means):
        each visual condition's, then the video's as rows, then the audio's rows."""
        import torch
        from diffusers.modular_pipelines.minimax_h3.before_denoise import patchify_video_latents

        generator = torch.Generator("cpu").manual_seed(clip.request.seed)
        held = clip.conditions.video_latents if clip.conditions is not None else ()
        conditions = [torch.randn(latents.shape, generator=generator, dtype=torch.float32) for latents in held]
        video = torch.randn(clip.request.video_latent_shape, generator=generator, dtype=torch.float32)
        audio_rows = torch.randn((clip.request.audio_latent_shape[-1] * AUDIO_CHANNELS, AUDIO_LATENT_CHANNELS),
                                 generator=generator, dtype=torch.float32)
        return conditions, patchify_video_latents(video, self.patch_size), audio_rows

    def noise(self, clip, layout):
        """The generated rows drawn from the request's seed, behind the conditioning rows the layout reserved."""
        import torch

        device = self.runtime.device
        drawn, clip.noise = (clip.noise.result() if clip.noise is not None else self.draw(clip)), None
        condition_noise, video_rows, audio_rows = drawn
        condition_rows = self.condition_rows(clip, condition_noise)
        video_rows, audio_rows = video_rows.to(device), audio_rows.to(device)
        if clip.conditions is None:
            return video_rows, audio_rows
        video_rows = torch.cat(condition_rows + [video_rows])
        audio_rows = torch.cat([rows.to(device) for rows in clip.conditions.audio_rows] + [audio_rows])
        if (video_rows.shape[0], audio_rows.shape[0]) != (layout["video_indices"].numel(),
                                                          layout["audio_indices"].numel()):
            raise ClipError("the encoded conditions do not fill the rows the layout reserved for them",
                            "the encode stage and the sampler disagree on the conditioning; report this")
        return video_rows, audio_rows

    def condition_rows(self, clip, noises) -> list:
        """Each visual condition noised to CONDITION_T with its own draw (`noises`), in packed order, as rows."""
        from diffusers import MiniMaxH3Scheduler
        from diffusers.modular_pipelines.minimax_h3.before_denoise import patchify_video_latents

        if clip.conditions is None:
            return []
        device, rows = self.runtime.device, []
        for latents, noise in zip(clip.conditions.video_latents, noises):
            noise = noise.to(device)
            # Mixed on the device, as the reference mixes them: a GPU's fused multiply-add rounds unlike the CPU.
            noised = MiniMaxH3Scheduler().scale_noise(latents.to(device), CONDITION_T, noise)
            rows.append(patchify_video_latents(noised, self.patch_size))
        return rows

    def denoise(self, clip, layout, video_rows, audio_rows):
        from diffusers.modular_pipelines.minimax_h3.before_denoise import MiniMaxH3SetTimestepsStep

        video_schedule = sigma_schedule(self.config, self.config.video_shift)
        audio_schedule = sigma_schedule(self.config, self.config.audio_shift)
        steps = len(video_schedule.timesteps)
        held_video, held_audio = layout["condition_video_rows"], layout["condition_audio_rows"]
        prompt_embeds = clip.prompt_embeds.to(self.runtime.device)  # encoded for every prompt first, kept on the host
        cache = self.runtime.cache
        step_cache = cache.session(steps, self.group, self.runtime.timer) if cache is not None else None
        reuse = {"step_cache": step_cache} if step_cache is not None else {}
        # Both DiTs return the (video, audio) velocities first: diffusers' as an output tuple, h3gen's as a pair.
        for i, (t, audio_t) in enumerate(zip(video_schedule.timesteps, audio_schedule.timesteps)):
            timestep, timestep_indices = MiniMaxH3SetTimestepsStep.build_row_timesteps(
                layout["video_indices"], layout["audio_indices"], held_video, held_audio,
                layout["text_indices"].numel(), float(t), float(audio_t), max(float(t), CONDITION_T),
                AUDIO_CONDITION_T)
            with self.runtime.timer.measure(clip, FORWARDS_PART, report=False):
                video_velocity, audio_velocity = self.dit(
                    hidden_states=video_rows[None], audio_hidden_states=audio_rows[None],
                    encoder_hidden_states=prompt_embeds, timestep=timestep.to(self.runtime.device),
                    timestep_indices=timestep_indices.to(self.runtime.device), token_tags=layout["token_tags"],
                    position_ids=layout["position_ids"], video_indices=layout["video_indices"],
                    audio_indices=layout["audio_indices"], text_indices=layout["text_indices"], **reuse)[:2]
            # Only the generated rows step: the conditioning rows ahead of them stay as they were drawn.
            video_rows[held_video:] = video_schedule.step(video_velocity[0, held_video:].float(), t,
                                                          video_rows[held_video:], return_dict=False)[0]
            audio_rows[held_audio:] = audio_schedule.step(audio_velocity[0, held_audio:].float(), audio_t,
                                                          audio_rows[held_audio:], return_dict=False)[0]
            self.runtime.on_step(clip, i + 1, steps)
        clip.forwards, clip.attention = steps, self.attention_used
        clip.forwards_reused = step_cache.reused if step_cache is not None else 0
        if step_cache is not None:
            clip.seconds.update(step_cache.seconds)
        return video_rows, audio_rows

    def unpack(self, layout, video_rows, audio_rows):
        """Generated rows back to latents: video (1, 24, F, H, W), audio (2, 32, N) for the mono audio VAE."""
        video_rows = video_rows[layout["condition_video_rows"]:]
        audio_rows = audio_rows[layout["condition_audio_rows"]:]
        patch_t, patch_h, patch_w = self.patch_size
        rows = video_rows.reshape(1, layout["latent_frames"] // patch_t, layout["latent_height"] // patch_h,
                                  layout["latent_width"] // patch_w, VIDEO_LATENT_CHANNELS, patch_t, patch_h, patch_w)
        video = rows.permute(0, 4, 1, 5, 2, 6, 3, 7).reshape(
            1, VIDEO_LATENT_CHANNELS, layout["latent_frames"], layout["latent_height"], layout["latent_width"])
        audio = audio_rows.reshape(AUDIO_CHANNELS, layout["audio_latents"], AUDIO_LATENT_CHANNELS).permute(0, 2, 1)
        return video.contiguous(), audio.contiguous()

    def unload(self):
        self.dit = self.partition = None
        if self.drawing is not None:
            self.drawing.shutdown(wait=True)
            self.drawing = None
