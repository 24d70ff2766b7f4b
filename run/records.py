"""One record per clip and event, the same for a `--json` line and a manifest line (the manifest adds `time` and
`pid`); the README's "Records" section says what each field means."""

from __future__ import annotations


def request_fields(path, request, preset: str) -> dict:
    """Which clip: its file, the prompts line that asks for it, the preset, and what it renders."""
    return {"path": str(path), "id": request.id, "line": request.line, "seed": request.seed, "preset": preset,
            "task": request.task, "width": request.width, "height": request.height}


def clip_record(result, preset: str) -> dict:
    """What happened to one clip. Null is "not measured": the times of a clip this run did not render, and the peak
    memory on the CPU."""
    rendered, request = result.rendered, result.request
    return {**request_fields(result.path, request, preset), "status": result.status, "ok": result.ok,
            "error": result.error or None,
            "seconds": {k: round(v, 4) for k, v in result.seconds.items()},
            "end_to_end_s": round(result.end_to_end, 4) if rendered else None,
            "rtf": round(result.rtf, 4) if rendered else None,
            "media_s": round(request.duration, 4), "frames": request.frames,
            "forwards": result.forwards if rendered else None,
            "forwards_reused": result.forwards_reused if rendered else None,
            "peak_gib": round(result.peak_gib, 3) if result.peak_gib is not None else None,
            "attention": result.attention or None, "fingerprint": result.fingerprint or None,
            "memory_plan": result.memory_plan}
