"""One run: resolve the preset's stages, load them once, and take every request through them in order."""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

from h3gen import memory
from h3gen.clip import Clip, Request
from h3gen.errors import ClipError, H3genError
from h3gen.timing import StageTimer

PIPELINE = ("encode", "sampler", "vae", "mux")  # quant is applied at load time by the stages that load weights


@dataclasses.dataclass
class Runtime:
    device: str
    dtype: object
    timer: StageTimer
    quant: object = None
    on_step: object = lambda clip, step, steps: None


@dataclasses.dataclass
class ClipResult:
    request: Request
    path: Path
    ok: bool
    seconds: dict[str, float]
    end_to_end: float
    error: str = ""
    peak_gib: float = 0.0
    forwards: int = 0
    skipped: bool = False  # the output was already there and valid

    @property
    def rtf(self) -> float:
        return self.end_to_end / self.request.duration


def clip_name(request: Request, preset: str) -> str:
    """The id when given, else a hash of what determines the clip, so reruns find the same file."""
    if request.id:
        return f"{request.id}.mp4"
    digest = hashlib.sha256(f"{preset}\0{request.seed}\0{request.prompt}".encode()).hexdigest()[:12]
    return f"h3-{digest}.mp4"


def pick_device(wanted: str) -> str:
    import torch

    if wanted == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return wanted


class Renderer:
    def __init__(self, preset, registry, repo, reporter):
        import torch

        self.preset, self.reporter = preset, reporter
        device = pick_device(preset.runtime["device"])
        dtype = getattr(torch, preset.runtime["dtype"])
        self.runtime = Runtime(device, dtype, StageTimer(device, reporter.stage_done), on_step=reporter.step)
        self.stages = {kind: registry.stage(kind, name)(config, self.runtime)
                       for kind, (name, config) in preset.stages.items()}
        self.runtime.quant = self.stages["quant"]
        for kind in ("quant",) + PIPELINE:
            self.stages[kind].load(repo)

    def render(self, requests: list[Request], out_dir: Path, save_latents: bool = False) -> Iterator[ClipResult]:
        """Yield one result per request, in order, giving back what each clip allocated before the next."""
        out_dir.mkdir(parents=True, exist_ok=True)
        for request in requests:
            result = self.render_one(request, out_dir, save_latents)
            memory.release(self.runtime.device)
            yield result

    def render_one(self, request: Request, out_dir: Path, save_latents: bool) -> ClipResult:
        import torch

        clip = Clip(request=request, path=out_dir / clip_name(request, self.preset.name), preset=self.preset.name)
        self.reporter.clip_started(clip)
        cuda = self.runtime.device.startswith("cuda")
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        began = time.perf_counter()
        error = ""
        try:
            check_disk(out_dir, request)
            for kind in PIPELINE:
                if kind == "mux" and save_latents:
                    write_latents(clip)
                clip = self.stages[kind](clip)
        except H3genError as e:
            error = str(e)
        except torch.OutOfMemoryError:
            error = OOM_HINT
        except OSError as e:
            error = write_error(clip.path, e)
        except Exception as e:  # a faulty stage costs its clip, not the batch
            error = OOM_HINT if "out of memory" in str(e).lower() else f"{type(e).__name__} in a stage: {e}"
        finally:  # the clip's tensors go now, whatever happened, so the next clip starts from the same memory
            clip.prompt_embeds = clip.text_token_tags = clip.video_latents = clip.audio_latents = None
            clip.frames = clip.audio = None
        peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
        result = ClipResult(request, clip.path, not error, dict(clip.seconds), time.perf_counter() - began,
                            error, peak, clip.notes.get("forwards", 0))
        self.reporter.clip_done(result)
        return result


OOM_HINT = "out of GPU memory (try an FP8 preset, fewer frames or a smaller size)"
# Generous for H.264 at the presets' CRF (real clips take well under a byte per pixel), plus the soundtrack.
MP4_BYTES_PER_PIXEL, AUDIO_BYTES = 0.5, 2**20


def already_done(request: Request, out_dir: Path, preset: str, save_latents: bool) -> ClipResult | None:
    """A skipped result when the clip's file is there and validates for this request, so a rerun resumes."""
    from h3gen.validate import validate_clip

    path = out_dir / clip_name(request, preset)
    if not path.is_file() or save_latents and not latents_path(path).is_file():
        return None
    if validate_clip(path, expected_frames=request.frames):
        return None  # rendered again; the atomic write replaces the bad file only once the new one is complete
    return ClipResult(request, path, True, {}, 0.0, skipped=True)


def check_disk(out_dir: Path, request: Request) -> None:
    """Fail a clip before it spends GPU time when its MP4 cannot fit on the disk."""
    need = int(request.frames * request.width * request.height * MP4_BYTES_PER_PIXEL) + AUDIO_BYTES
    free = shutil.disk_usage(out_dir).free
    if free < need:
        raise ClipError(f"only {free / 2**20:.0f} MiB free in {out_dir}, the clip needs up to {need / 2**20:.0f} MiB",
                        "free disk space; a rerun redoes only the clips that are missing")


def write_error(path: Path, error: OSError) -> str:
    text = f"cannot write {path}: {error.strerror or error}"
    if error.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        text += f" (free space in {path.parent}; a rerun redoes only the clips that are missing)"
    return text


def latents_path(path: Path) -> Path:
    return path.with_suffix(".latents.safetensors")


def write_latents(clip: Clip) -> None:
    from safetensors.torch import save_file

    path = latents_path(clip.path)
    partial = path.with_name(f".{path.name}.partial")
    try:
        save_file({"video": clip.video_latents.float().cpu().contiguous(),
                   "audio": clip.audio_latents.float().cpu().contiguous()}, str(partial))
        partial.replace(path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
