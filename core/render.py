"""One run: resolve the preset's stages, load them once, and take every request through them in order."""

from __future__ import annotations

import dataclasses
import hashlib
import time
from pathlib import Path

from h3gen.clip import Clip, Request
from h3gen.errors import H3genError
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

    def render(self, requests: list[Request], out_dir: Path, save_latents: bool = False) -> list[ClipResult]:
        out_dir.mkdir(parents=True, exist_ok=True)
        return [self.render_one(request, out_dir, save_latents) for request in requests]

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
            for kind in PIPELINE:
                if kind == "mux" and save_latents:
                    write_latents(clip)
                clip = self.stages[kind](clip)
        except H3genError as e:
            error = str(e)
        except torch.OutOfMemoryError:
            error = "out of GPU memory (try an FP8 preset, fewer frames or a smaller size)"
        except OSError as e:
            error = f"cannot write {clip.path}: {e.strerror or e}"
        except Exception as e:  # a faulty stage costs its clip, not the batch
            error = f"{type(e).__name__} in a stage: {e}"
        finally:
            clip.frames = clip.audio = None
        peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
        result = ClipResult(request, clip.path, not error, dict(clip.seconds), time.perf_counter() - began,
                            error, peak, clip.notes.get("forwards", 0))
        self.reporter.clip_done(result)
        return result


def write_latents(clip: Clip) -> None:
    from safetensors.torch import save_file

    path = clip.path.with_suffix(".latents.safetensors")
    partial = path.with_name(f".{path.name}.partial")
    save_file({"video": clip.video_latents.float().cpu().contiguous(),
               "audio": clip.audio_latents.float().cpu().contiguous()}, str(partial))
    partial.replace(path)
