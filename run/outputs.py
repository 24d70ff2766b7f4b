"""The output directory shared by runs: a claim per clip, and a manifest of what happened to every clip.

Two overlapping runs (cron jobs that outlast their interval) on one directory never write the same clip: each
clip is claimed with an advisory lock that the kernel drops when its process ends, so a crashed run never leaves
a stale claim. The manifest is JSON Lines, appended one whole line per event.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from pathlib import Path

MANIFEST = "manifest.jsonl"


class ClipClaim:
    """Holds `.NAME.lock` beside the clip while this process renders it."""

    def __init__(self, path: Path):
        self.lock_path = path.with_name(f".{path.name}.lock")
        self.fd = None

    def acquire(self) -> bool:
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        self.fd = fd
        return True

    def release(self) -> None:
        if self.fd is not None:
            self.lock_path.unlink(missing_ok=True)
            os.close(self.fd)
            self.fd = None


def record(out_dir: Path, result, preset: str, status: str) -> None:
    """Append one line for a clip (h3gen.run.records): ok, failed, skipped (already there and valid), busy (another
    run has it) or conflict (there, rendered with other settings)."""
    from h3gen.run.records import clip_record

    line = json.dumps({"time": round(time.time(), 3), "pid": os.getpid(),
                       **clip_record(result, preset), "status": status}) + "\n"
    fd = os.open(out_dir / MANIFEST, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, line.encode())
    finally:
        os.close(fd)
