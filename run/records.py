"""What happened to a clip (`ClipResult`), and its record: one per clip and event, the same for a `--json` line and
a manifest line (the manifest adds `time` and `pid`); the README's "Output and exit codes" says what each field
means."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from h3gen.inputs.request import Request


@dataclasses.dataclass
class ClipResult:
    """What became of one clip of a run: written, failed, or left as it was (skipped, busy, a conflict), and the
    times and memory of one rendered."""

    request: Request
    path: Path
    ok: bool
    seconds: dict[str, float]
    end_to_end: float
    error: str = ""
    peak_gib: float | None = None  # None where it was not measured (on the CPU, a clip not rendered)
    forwards: int = 0
    forwards_reused: int = 0
    skipped: bool = False  # the output was already there and valid, or another run is writing it
    note: str = ""  # why a clip was skipped when not because it was already there
    attention: str = ""  # the attention backend the DiT ran on
    # ok, failed, skipped, busy (another run has it), conflict (there, other settings) or damaged (there, invalid:
    # rendered again)
    status: str = ""
    fingerprint: str = ""  # the digest of what decided the clip's bytes (h3gen.run.fingerprint)
    memory_plan: dict | None = None  # the run's memory plan (h3gen.run.budget.MemoryPlan.record), on a GPU
    sha256: str = ""  # the MP4's bytes as this run wrote them (h3gen validate compares a clip with it)
    unrecorded: str = ""  # a clip written whole whose manifest line could not be: why (the run then exits 1)

    def __post_init__(self):
        if not self.status:
            self.status = ("busy" if self.note else "skipped") if self.skipped else "ok" if self.ok else "failed"

    @property
    def rendered(self) -> bool:
        """Written by this run: its times were measured."""
        return self.status == "ok"

    @property
    def rtf(self) -> float | None:
        return self.end_to_end / self.request.duration if self.rendered else None


def request_fields(path, request, preset: str) -> dict:
    """Which clip: its file, the prompts line that asks for it, the preset, and what it renders."""
    return {"path": str(path), "id": request.id, "line": request.line, "seed": request.seed, "preset": preset,
            "task": request.task, "width": request.width, "height": request.height}


def clip_record(result, preset: str) -> dict:
    """What happened to one clip. Null is "not measured": the times of a clip this run did not render, and the peak
    memory on the CPU."""
    rendered, request = result.rendered, result.request
    return {**request_fields(result.path, request, preset), "status": result.status, "ok": result.ok,
            "error": result.error or result.unrecorded or None,
            "seconds": {k: round(v, 4) for k, v in result.seconds.items()},
            "end_to_end_s": round(result.end_to_end, 4) if rendered else None,
            "rtf": round(result.rtf, 4) if rendered else None,
            "media_s": round(request.duration, 4), "frames": request.frames,
            "forwards": result.forwards if rendered else None,
            "forwards_reused": result.forwards_reused if rendered else None,
            "peak_gib": round(result.peak_gib, 3) if result.peak_gib is not None else None,
            "attention": result.attention or None, "fingerprint": result.fingerprint or None,
            "memory_plan": result.memory_plan, "sha256": result.sha256 or None}
