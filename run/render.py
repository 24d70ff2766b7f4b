"""One run: resolve the preset's stages, load them once, and take every request through them in order."""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import shutil
import sys
import time
import traceback
from collections.abc import Iterator
from pathlib import Path

from h3gen.errors import H3genError, ModelError, debugging
from h3gen.inputs.request import Request
from h3gen.run import budget, fingerprint, memory, outputs
from h3gen.run.arriving import ArrivingMedia, decoded
from h3gen.run.outputs import check_disk, write_latents
from h3gen.run.records import ClipResult
from h3gen.run.resume import already_done, clip_name, held_with_other_settings, to_render
from h3gen.run.loop import signals_held
from h3gen.run.timing import StageTimer
from h3gen.stages.base import BUILTIN, DAMAGED_WEIGHTS_FIX, ReturnedRefused, StageFailed
from h3gen.stages.clip import PIPELINE, Clip, described, media_problem

RAW_BYTES_PER_PIXEL = 3  # uint8 RGB frames: more than any MP4 of them takes


@dataclasses.dataclass
class Runtime:
    device: str
    dtype: object
    timer: StageTimer
    quant: object = None
    cache: object = None  # the preset's step cache policy (h3gen.stages.cache), for the sampler
    on_step: object = lambda clip, step, steps: None

    def quantize(self, role: str, module):
        """`module` as the preset's quant stage transforms it for `role`; as loaded for a stage built without one."""
        if self.quant is None:
            return module
        return self.quant_stage_did(lambda: self.quant.transform(role, module), f"quantizing the {role}")

    def quantize_part(self, role: str, module, prefix: str):
        """A part of a model still loading (a block at `prefix`), quantized now when the quant stage takes parts;
        `quantize` on the whole model follows either way."""
        if self.quant is None or not self.quant.quantizes_parts:
            return module
        return self.quant_stage_did(lambda: self.quant.quantize(role, module, prefix), f"quantizing {role} {prefix}")

    def quant_stage_did(self, work, what: str):
        """The quant stage's answer; its failure, or no module, is named as the quant stage's, not the loader's."""
        from h3gen.stages.base import raised

        try:
            module = work()
        except H3genError:
            raise
        except Exception as e:
            raise self.quant.failed(f"raised {raised(e)} {what}", self.quant.broke_fix(e)) from e
        if module is None:
            raise self.quant.failed(f"returned None {what}", "quantize(role, module, prefix) returns the module to run")
        return module


def pick_device(wanted: str) -> str:
    import torch

    if wanted == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return wanted


# Prompts encoded ahead of their clips, a chunk at a time: the first chunk is small, so the first clip starts after a
# few prompts' encoding (8 at 0.22 s each on a CPU, 0.9 s on a busy one), not the whole file's; chunks then double
# up to 64, so a GPU reloads its encoder rarely. At most one chunk of embeddings waits in host memory. The sizes
# depend on the count alone: the ranks of a group cut the same chunks.
FIRST_ENCODE_CHUNK, ENCODE_CHUNK = 8, 64


def chunk_sizes(total: int) -> list[int]:
    sizes, size = [], FIRST_ENCODE_CHUNK
    while sum(sizes) < total:
        sizes.append(min(size, total - sum(sizes)))
        size = min(size * 2, ENCODE_CHUNK)
    return sizes


class Renderer:
    def __init__(self, preset, registry, repo, reporter, memory_plan=None):
        import torch

        self.preset, self.reporter = preset, reporter
        self.memory_plan = memory_plan.record() if memory_plan is not None else None
        device = pick_device(preset.runtime["device"])
        dtype = getattr(torch, preset.runtime["dtype"])
        self.runtime = Runtime(device, dtype, StageTimer(device, reporter.stage_done), on_step=self.stepped)
        budget.hold_to(device, preset.runtime["vram_gib"])
        self.stages = {kind: build(registry.stage(kind, name), config, self.runtime)
                       for kind, (name, config) in preset.stages.items()}
        self.repo, self.encoder_unloaded = repo, False  # unloaded between chunks on a GPU: load it again first
        self.runtime.quant, self.runtime.cache = self.stages["quant"], self.stages["cache"]
        self.run_fields = fingerprint.run_fields(preset, registry, repo)
        for kind in ("quant",) + PIPELINE:
            load(self.stages[kind], repo)
        memory.settle(device)
        # (clip, claim, future, the file's state before the mux) in render order; finished results not yet yielded
        self.muxing, self.done = [], []
        self.claim_on_device = None
        self.discarded = 0  # clips in flight that close(discard=True) dropped
        self.latents_written = set()  # clips whose --save-latents file this run wrote and that are not finished yet
        self.cache_problem_said = False  # the embedding cache's write problem, said once a run
        self.results = []  # every clip this renderer finished, in the order their manifest lines were written
        self.unrecorded = ""  # why the manifest could not take a clip's line: the clips after it are not rendered
        self.bytes_per_pixel = 0.0  # the least an MP4 of this run took per pixel of its frames (check_disk)
        self.unfit_per_pixel = 0.0  # the free space a clip's MP4 did not fit in, per pixel of its frames

    def render(self, requests: list[Request], out_dir: Path, save_latents: bool = False,
               redo: str = "") -> Iterator[ClipResult]:
        """Yield one result per request as it finishes.

        The prompts are encoded a chunk at a time (`chunk_sizes`), and on a GPU the text encoder is freed before the
        DiT loads its activations; then the device renders the chunk's clips one after another while finished clips
        are muxed in the background, and the next chunk is encoded. On the CPU the encoder stays loaded between
        chunks: host memory holds it beside the DiT, and reloading it would cost each chunk its load time."""
        out_dir.mkdir(parents=True, exist_ok=True)
        self.out_dir, self.save_latents = out_dir, save_latents
        pending = [Clip(request=request, path=out_dir / clip_name(request, self.preset.name), preset=self.preset.name,
                        fingerprint=fingerprint.clip_fields(self.run_fields, request))
                   for request in requests]
        total, first = len(pending), 0
        for size in chunk_sizes(total):
            clips, pending = pending[:size], pending[size:]
            failed = yield from self.encode_chunk(clips, first, total, last=not pending)
            first += len(clips)
            yield from self.render_chunk(clips, failed, redo)
        yield from self.collect(wait=True)

    def render_chunk(self, clips: list[Clip], failed: set, redo: str) -> Iterator[ClipResult]:
        clips[:] = [clip for clip in clips if clip.request.index not in failed]
        sampler = self.stages["sampler"]
        while clips:  # popped as they go (the caller's list too), so nothing keeps a finished clip alive
            clip = clips.pop(0)
            status, claim, error = self.admit(clip, redo)
            if status or error:
                yield self.finish(clip, error, status=status)
                continue
            if clips:  # the next clip's host-side inputs get ready while this one is on the device
                sampler.prepare(clips[0])
            self.render_one(clip, claim)
            self.claim_on_device = None
            memory.release(self.runtime.device)
            yield from self.collect(wait=False)

    def admit(self, clip: Clip, redo: str) -> tuple[str, object, str]:
        """(status, claim, error): the claim when this run renders the clip; status "busy" when another run holds
        it, "conflict" when that run renders it with other settings, "skipped" when an overlapping run finished it
        after this one started."""
        if self.unrecorded:  # every clip would be written without the line a run resumes by: spend no device time
            return "", None, f"not rendered: {self.unrecorded}"
        claim = outputs.ClipClaim(clip.path)
        try:
            with signals_held():  # a claim taken is one close() knows of, wherever a stop signal lands
                if claim.acquire(clip.fingerprint):
                    self.claim_on_device = claim  # close() releases it (the check below decodes)
        except OSError as e:
            return "", None, outputs.write_error(claim.lock_path, e)
        if self.claim_on_device is not claim:
            other = held_with_other_settings(clip.path, clip.fingerprint, bool(clip.request.id))
            return ("conflict", None, other) if other else ("busy", None, "")
        there = already_done(clip.request, self.out_dir, self.preset.name, self.save_latents, self.run_fields, redo)
        if not to_render(there):
            with signals_held():
                claim.release()
                self.claim_on_device = None  # not a clip in flight
            return there.status, None, there.error
        return "", claim, ""

    def encode_chunk(self, clips: list[Clip], first: int, total: int, last: bool):
        """Encode a chunk's prompts (the embedding cache first), then free the encoder unless it stays loaded for
        the next chunk; yields the results of the clips that failed and returns their indices."""
        failed, began = set(), time.perf_counter()
        encode = self.stages["encode"]
        if self.encoder_unloaded:
            load(encode, self.repo)
            self.encoder_unloaded = False
        for clip in clips:
            try:
                encode(clip, report=False)
                check_media_read(clip)
                # The chunk's prompts are encoded before its first clip renders: the embeddings wait in host memory.
                clip.prompt_embeds = clip.prompt_embeds.cpu()
            except ModelError:
                raise
            except Exception as e:  # a prompt or its media costs its clip, not the batch
                failed.add(clip.request.index)
                self.reporter.clip_started(clip)
                yield self.finish(clip, clip_error(clip, e, self.memory_plan))
        cached = sum(clip.encode_cached for clip in clips)
        where = f" ({first + 1}-{first + len(clips)} of {total})" if len(clips) < total else ""
        self.reporter.say(f"h3gen: encoded {len(clips) - len(failed)} prompt(s){where} in "
                          f"{time.perf_counter() - began:.2f}s ({cached} from the embedding cache)")
        problem = getattr(getattr(encode, "cache", None), "problem", "")
        if problem and not self.cache_problem_said:
            self.reporter.warn(f"h3gen: note: {problem}")
            self.cache_problem_said = True
        if last or self.runtime.device.startswith("cuda"):
            self.unload(encode)
            memory.settle(self.runtime.device)
            self.encoder_unloaded = not last
        return failed

    def render_one(self, clip: Clip, claim) -> None:
        """DiT and decode on the device, then the mux, in the background when the mux stage can: started with the
        decode when the VAE stage hands its frames over chunk by chunk, so only the last chunk is left to encode."""
        import torch

        self.reporter.clip_started(clip)
        cuda = self.runtime.device.startswith("cuda")
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        refused = memory.refused_allocations(self.runtime.device)
        error, mux, job = "", self.stages["mux"], None
        before = claim.before  # the file there when claimed: a mux that fails after writing one takes it back
        try:
            self.room_for(clip)
            clip = self.stages["sampler"](clip)
            check_latents(clip, self.stages["sampler"])
            if self.save_latents:
                write_latents(clip)
                self.latents_written.add(clip.path)
            if self.stages["vae"].hands_over_frames and mux.background:
                clip.arriving = ArrivingMedia()
                job = mux.submit(clip)
                if job is None:  # the mux runs in line, after the decode: it takes the finished frames
                    clip.arriving = None
            clip = self.stages["vae"](clip)
            check_media(clip, self.stages["vae"])
            clip.drop_tensors(keep_media=True)  # the device's share goes now; the mux needs only frames and audio
            clip.peak_gib = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
            if job is None and mux.background:
                job = mux.submit(clip)
            if job is not None:
                self.muxing.append((clip, claim, job, before))
                self.claim_on_device = None  # close() finds it in self.muxing
                return
            try:
                clip = mux(clip)
            except BaseException:
                outputs.remove_if_written(clip.path, before)
                raise
        except BaseException as e:  # a faulty stage costs its clip, not the batch
            if job is not None:
                abandon(clip, job, e)
            if not isinstance(e, Exception) or isinstance(e, ModelError):  # a model no clip can use ends the run
                raise
            self.check_fatal(clip, e)
            self.learn_unfit(clip, e)
            error = clip_error(clip, e, self.memory_plan,
                               ran_out=memory.refused_allocations(self.runtime.device) > refused)
        self.done.append(self.finish(clip, error, claim=claim))

    def room_for(self, clip: Clip) -> None:
        """Raise ClipError when the clip's MP4 cannot fit on the output disk (check_disk, with what this run learned
        of its clips' sizes), before it spends device time."""
        check_disk(self.out_dir, clip.request, self.bytes_per_pixel, [c.request for c, *_ in self.muxing],
                   self.unfit_per_pixel)

    def check_fatal(self, clip: Clip, error: Exception) -> None:
        """Raise to end the run rather than fail the clip (a group renderer: a rank of the group lost). On one device
        nothing more ends it: only a ModelError, raised before this is asked."""

    def collect(self, wait: bool) -> Iterator[ClipResult]:
        """Results of the clips whose mux has finished (all of them with `wait`), in the order they were rendered."""
        self.finish_muxed(wait)
        yield from self.done
        self.done.clear()

    def stepped(self, clip: Clip, step: int, steps: int) -> None:
        """A forward of `clip` is through: the live display hears of it, and the clips whose background mux has
        ended since are finished now (manifest line, record), not once the clip on the device is."""
        self.reporter.step(clip, step, steps)
        self.finish_muxed(wait=False)

    def finish_muxed(self, wait: bool) -> None:
        """Finish the clips whose mux has ended (all of them with `wait`), in the order they were rendered; their
        results wait in `done` for the caller."""
        while self.muxing and (wait or self.muxing[0][2].done()):
            clip, claim, job, before = self.muxing[0]  # popped once done: a signal while it waits leaves it to close()
            error = ""
            try:
                job.result()
            except Exception as e:
                outputs.remove_if_written(clip.path, before)
                self.learn_unfit(clip, e)
                error = clip_error(clip, e, self.memory_plan)
            self.muxing.pop(0)
            self.done.append(self.finish(clip, error, claim=claim) if error else self.finish_muxed_clip(clip, claim))

    def finish_muxed_clip(self, clip: Clip, claim) -> ClipResult:
        """A clip whose background mux wrote its MP4: its mux line, then its result."""
        self.reporter.stage_done(clip, "mux", clip.seconds.get("mux", 0.0))
        return self.finish(clip, claim=claim)

    def finish(self, clip: Clip, error: str = "", status: str = "", claim=None) -> ClipResult:
        with signals_held():  # recorded, reported and counted, or none of these
            result = self.finish_held(clip, error, status, claim)
            self.results.append(result)
        return result

    def finish_held(self, clip: Clip, error: str, status: str, claim) -> ClipResult:
        if clip.path in self.latents_written:
            self.latents_written.discard(clip.path)
            if error:  # the clip's latents go with it: no file of a clip without its MP4
                outputs.latents_path(clip.path).unlink(missing_ok=True)
        elif status == "" and not error:  # rendered again without --save-latents: latents there are another render's
            with contextlib.suppress(OSError):
                outputs.latents_path(clip.path).unlink(missing_ok=True)
        if claim is not None:
            claim.release()
            if claim is self.claim_on_device:
                self.claim_on_device = None
        clip.drop_tensors()
        top_level = sum(clip.seconds.get(kind, 0.0) for kind in PIPELINE)
        ok = not error or status == "skipped"
        result = ClipResult(clip.request, clip.path, ok, dict(clip.seconds), top_level,
                            error, clip.peak_gib, clip.forwards, clip.forwards_reused,
                            skipped=status in ("skipped", "busy", "conflict"),
                            note="another h3gen run is rendering it" if status == "busy" else "",
                            attention=clip.attention, status=status or ("ok" if ok else "failed"),
                            fingerprint=fingerprint.digest(clip.fingerprint) if clip.fingerprint else "",
                            memory_plan=self.memory_plan,
                            sha256=(clip.sha256 or outputs.sha256_of(clip.path)) if status == "" and ok else "")
        result = outputs.recorded(self.out_dir, result, self.preset.name)
        self.unrecorded = self.unrecorded or result.unrecorded
        if status == "" and ok:
            self.learn_size(clip)
        self.reporter.clip_done(result)
        return result

    def learn_size(self, clip) -> None:
        """The least an MP4 takes per pixel, from a clip (or a clip's result) whose file is whole at `path`."""
        request = clip.request
        try:
            size = clip.path.stat().st_size / (request.frames * request.width * request.height)
        except OSError:
            return
        self.bytes_per_pixel = min(self.bytes_per_pixel, size) if self.bytes_per_pixel else size

    def learn_unfit(self, clip: Clip, error: BaseException) -> None:
        """A clip whose MP4 found the disk full: the space free now (its partial file gone) is less than a clip of
        its size takes, so the next clips fail before their GPU time until more is freed. Not where more is free
        than the clip's raw frames take, which no MP4 outgrows: that write failed for another reason (a quota, no
        inodes)."""
        if outputs.full_disk(error):
            request = clip.request
            per_pixel = shutil.disk_usage(self.out_dir).free / (request.frames * request.width * request.height)
            if per_pixel < RAW_BYTES_PER_PIXEL:
                self.unfit_per_pixel = max(self.unfit_per_pixel, per_pixel)

    def close(self, discard: bool = False) -> list[ClipResult]:
        """Wait for background muxes, or with `discard` (a signal) stop them; the results of the clips that were
        written all the same. Either way each file is written whole or not at all."""
        mux, written, recorded = self.stages["mux"], [], set()
        if discard and mux.background:
            finishing = {job: (clip, claim) for clip, claim, job, _ in self.muxing if decoded(clip) and not job.done()}
            if finishing:
                self.reporter.warn(f"h3gen: finishing the MP4 of {len(finishing)} clip(s) already decoded; another "
                                   "signal ends at once")
            # Each recorded as its file lands, so a second signal cuts off as few manifest lines as it can.
            for job in concurrent.futures.as_completed(finishing):
                clip, claim = finishing[job]
                if not job.cancelled() and job.exception() is None:
                    written.append(self.finish_muxed_clip(clip, claim))
                recorded.add(job)
            mux.discard_in_flight()
        for kind in PIPELINE:
            self.unload(self.stages[kind])
        memory.let_go(self.runtime.device)
        written += [self.finish_muxed_clip(clip, claim) for clip, claim, job, _ in self.muxing
                    if job not in recorded and job.done() and not job.cancelled() and job.exception() is None]
        if discard:
            self.discarded = len(self.muxing) - len(written) + (self.claim_on_device is not None)
        for path in self.latents_written:  # of the clips the signal stopped
            outputs.latents_path(path).unlink(missing_ok=True)
        self.latents_written.clear()
        for claim in [claim for _, claim, _, _ in self.muxing] + [self.claim_on_device]:
            if claim is not None:
                claim.release()
        self.muxing.clear()
        return written

    def unload(self, stage) -> None:
        """A stage that fails to let go of its memory costs nothing written: it is reported, and the run goes on."""
        try:
            stage.unload()
        except Exception as e:
            if debugging():
                traceback.print_exception(e, file=sys.stderr)
            self.reporter.warn(f"h3gen: warning: {stage.failed(f'failed to unload: {type(e).__name__}: {e}')}")


def build(stage_class, config, runtime):
    """A stage of the preset; one that fails to construct with anything but an h3gen error ends the run, named."""
    try:
        stage_class.check_device(config, runtime.device, str(runtime.dtype).removeprefix("torch."))
        return stage_class(config, runtime)
    except H3genError as e:
        stage_class.raise_named(e)
    except Exception as e:
        raise stage_class.failed(f"failed to start: {type(e).__name__}: {e}", stage_class.broke_fix(e)) from e


def load(stage, repo) -> None:
    """A stage's weights; a stage failing with anything but an h3gen error ends the run, named."""
    try:
        stage.load(repo)
    except H3genError as e:
        stage.raise_named(e)
    except Exception as e:
        raise stage.failed(f"failed to load: {type(e).__name__}: {e}", stage.broke_fix(e)) from e


def check_latents(clip: Clip, sampler) -> None:
    """What the sampler hands the decode is the clip asked for: floating latents of the request's shapes, every value
    finite (a NaN or an infinity would decode to noise and a soundtrack no encoder takes). A sampler that breaks this
    is named here, not the decode or the mux that trips on it."""
    import torch

    request = clip.request
    wanted = {"video": request.video_latent_shape, "audio": request.audio_latent_shape}
    for name, shape in wanted.items():
        latents = getattr(clip, f"{name}_latents")
        if not isinstance(latents, torch.Tensor) or not latents.is_floating_point() or tuple(latents.shape) != shape:
            raise ReturnedRefused(f"{sampler.label()} returned a clip whose {name} latents are {described(latents)}, "
                                  f"not float {shape}", "a sampler's run(clip) sets clip.video_latents and "
                                  "clip.audio_latents as the request's shapes say: docs/plugins.md")
    broken = [name for name in wanted if not torch.isfinite(getattr(clip, f"{name}_latents")).all()]
    if broken:
        fix = (DAMAGED_WEIGHTS_FIX if sampler.origin == BUILTIN
               else "a sampler's latents must be finite: docs/plugins.md")
        raise ReturnedRefused(f"{sampler.label()} returned {' and '.join(broken)} latents holding NaN or infinite "
                              "values", fix)


def check_media_read(clip: Clip) -> None:
    """The keyframes and references a clip's encode read are the files its name and fingerprint were taken from: one
    changed or replaced since the run checked its prompts would give a clip stamped as the file that was there."""
    from h3gen.errors import ClipError

    fields = ("request.first_frame", "request.last_frame", "request.references")
    if not any(field in clip.fingerprint for field in fields):
        return
    try:
        now = fingerprint.clip_fields({}, clip.request)
    except OSError as e:
        raise ClipError(f"{e.filename} was taken away while its clip rendered", "put it back and run the same "
                        "command again") from None
    changed = next((field for field in fields if now.get(field) != clip.fingerprint.get(field)), None)
    if changed:
        named = "a reference" if changed == "request.references" else f"its {changed.removeprefix('request.')}"
        raise ClipError(f"{named} changed while the clip rendered, so the clip would carry the name and stamp of the "
                        "file as it was", "run the same command again: it renders the clip from the file as it is")


def check_media(clip: Clip, vae) -> None:
    """What the decode hands the mux is there, and is the clip asked for: a vae that returns without it, or with
    frames or a soundtrack of another shape or length, is named, not the mux that trips on it (or writes a clip
    `validate` refuses)."""
    if clip.arriving is not None:
        missing = [] if clip.arriving.finished else ["finishing clip.arriving with its audio"]
        frames, audio, sample_rate = clip.arriving.handed()
    else:
        missing = [f"clip.{name}" for name in ("frames", "audio") if getattr(clip, name) is None]
        frames, audio, sample_rate = clip.frames, clip.audio, clip.sample_rate
    fix = ("a vae's run(clip) sets clip.frames (uint8 (T, H, W, 3)), clip.audio (float32 (2, N)) and "
           "clip.sample_rate, or hands them over through clip.arriving: docs/plugins.md")
    if missing:
        raise ReturnedRefused(f"{vae.label()} returned the clip without {' or '.join(missing)}", fix)
    problem = media_problem(clip.request, frames, audio, sample_rate)
    if problem:
        raise ReturnedRefused(f"{vae.label()} returned a clip whose {problem}", fix)


def abandon(clip: Clip, job, error: BaseException) -> None:
    """Stop the mux that started with a decode that failed: it writes nothing (a file it finished goes too)."""
    clip.arriving.fail(error)
    if job.cancel():
        return
    try:
        job.result()
    except Exception:
        return
    clip.path.unlink(missing_ok=True)


def clip_error(clip: Clip, error: Exception, memory_plan: dict | None = None, ran_out: bool = False) -> str:
    """The one line a failed clip gets: what a stage said it was (out of memory, a write) before which stage.
    Out of memory (torch's error, or `ran_out`: the allocator refused an allocation while the clip ran) names a
    budget that would fit: under the run's plan (`memory_plan`, its record), a quarter less for the estimate, so
    more DiT blocks stream."""
    import torch

    cause = error.__cause__ if isinstance(error, StageFailed) and error.__cause__ is not None else error
    if debugging():
        traceback.print_exception(error, file=sys.stderr)
    # memory that ran out in a plugin's stage: the stage is named, so its author can tell their stage asked for it
    where = f" in {error.plugin_stage}" if isinstance(error, StageFailed) and error.plugin_stage else ""
    if ran_out or isinstance(cause, torch.OutOfMemoryError) or "out of memory" in str(cause).lower():
        if memory_plan is None:
            return OOM_HINT.replace("out of GPU memory", f"out of GPU memory{where}", 1)
        budget = memory_plan["vram_gib"]
        return (f"out of GPU memory{where} under the plan for {budget:.1f} GiB (try --vram "
                f"{max(1, int(budget * 0.75))} so more DiT blocks stream, an FP8 preset, fewer frames or a smaller "
                "size)")
    if isinstance(cause, MemoryError) or "can't allocate memory" in str(cause):  # torch's CPU allocator says so
        return HOST_OOM_HINT.replace("out of host memory", f"out of host memory{where}", 1)
    if isinstance(cause, OSError):
        return outputs.write_error(clip.path, cause, "the clip")  # its line names the clip's path
    if isinstance(error, H3genError):
        return str(error)
    return f"{type(error).__name__}: {error}"


OOM_HINT = ("out of GPU memory (try --vram with less than the GPU has so DiT blocks stream, an FP8 preset, fewer "
            "frames or a smaller size)")
HOST_OOM_HINT = ("out of host memory (try fewer frames or a smaller size, or leave it more memory: other programs, "
                 "fewer --cpu-workers)")
