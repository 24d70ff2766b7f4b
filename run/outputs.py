"""The output directory shared by runs: a claim per clip, a manifest of what happened to every clip, room on its
disk for the next clip, and the latents written beside a clip.

Two overlapping runs (cron jobs that outlast their interval) on one directory never write the same clip: each
clip is claimed with an advisory lock that the kernel drops when its process ends, so a crashed run never leaves
a stale claim. The manifest is JSON Lines, appended one whole line per event.

A write for one clip fails soft: an OSError (a full disk, a read-only directory) comes back as the clip's one-line
reason. A write the run cannot do without (the manifest, room for any clip at all) ends it with one line
(WriteError), never a traceback.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import json
import math
import os
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING

from h3gen.errors import ClipError, WriteError
from h3gen.run import fingerprint

if TYPE_CHECKING:
    from h3gen.inputs.request import Request
    from h3gen.stages.clip import Clip

MANIFEST = "manifest.jsonl"
# Less than any MP4 of a request takes: a black 10 s 1344x768 clip with a silent soundtrack is 21 KB.
MP4_FLOOR_BYTES = 64 * 2**10


class ClipClaim:
    """Holds `.NAME.lock` beside the clip while this process renders it."""

    def __init__(self, path: Path):
        self.path, self.lock_path = path, path.with_name(f".{path.name}.lock")
        self.fd = self.before = None

    def acquire(self, fields: dict | None = None) -> bool:
        """True when this process now holds the clip; False when another does. Raises OSError when the lock file
        cannot be created. `fields`, the clip's fingerprint, go into the lock file, where another run asking for
        the clip reads what this one renders (`holder_fields`)."""
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        self.fd, self.before = fd, file_state(self.path)
        HELD.add(self)
        if fields is not None:
            try:
                os.ftruncate(fd, 0)
                os.write(fd, json.dumps(fields, sort_keys=True).encode())
            except OSError:  # a full disk: the claim holds all the same, and its settings are not known elsewhere
                pass
        return True

    def release(self) -> None:
        if self.fd is not None:
            try:
                self.lock_path.unlink(missing_ok=True)
            except OSError:  # a directory turned read-only: the kernel still drops the lock with the descriptor
                pass
            os.close(self.fd)
            self.fd = None
            HELD.discard(self)


HELD: set[ClipClaim] = set()  # the claims this process holds now


def drop_held_claims() -> None:
    """The partial files and locks of every clip this process holds, removed: for a process about to end at once,
    mid-write (a second stop signal), which leaves no hidden file for the next run to clear. A clip's own file goes
    too where it was written since the claim and is not a whole MP4 (a plugin's mux writing in place)."""
    for claim in list(HELD):
        cut_short = file_state(claim.path) not in (None, claim.before) and _not_whole(claim.path)
        for path in [*leftovers(claim.path), claim.lock_path, *([claim.path] if cut_short else [])]:
            with contextlib.suppress(OSError):
                path.unlink(missing_ok=True)


def _not_whole(path: Path) -> bool:
    from h3gen.run.validate import box_problem

    try:
        return bool(box_problem(path))
    except OSError:
        return False


def file_state(path: Path):
    """What tells a file written since apart from the one there before (None: no file)."""
    try:
        stat = path.stat()
    except OSError:
        return None
    return stat.st_ino, stat.st_mtime_ns, stat.st_size


def remove_if_written(path: Path, before) -> None:
    """A failed mux leaves no file: one it wrote before failing (a wrapper failing after its inner mux) goes."""
    if file_state(path) not in (None, before):
        path.unlink(missing_ok=True)


def held_elsewhere(path: Path) -> bool:
    """Whether a live run holds the clip at `path`, found without taking or creating its lock."""
    return lock_held(path.with_name(f".{path.name}.lock"))


def lock_held(lock: Path) -> bool:
    """Whether a live process holds the lock file `lock` (False when there is none)."""
    try:
        fd = os.open(lock, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # a shared lock taken here goes with the descriptor
    return False


def holder_fields(path: Path) -> dict | None:
    """The fingerprint fields the run holding the clip at `path` wrote into its lock file (None: not known)."""
    try:
        fields = json.loads(path.with_name(f".{path.name}.lock").read_bytes())
    except (OSError, ValueError):
        return None
    return fields if isinstance(fields, dict) else None


def partial_mp4(path: Path) -> Path:
    """The hidden file the MP4 at `path` is written into, renamed to `path` once whole."""
    return path.with_name(f".{path.name}.partial.mp4")


def leftovers(path: Path) -> list[Path]:
    """The hidden files a run writes beside the clip at `path` before renaming them into place."""
    latents = latents_path(path)
    return [partial_mp4(path), latents.with_name(f".{latents.name}.partial")]


def clips_in(folder: Path, files_only: bool = True) -> list[Path]:
    """The clips in `folder`, sorted: its MP4 files but the hidden partial ones a run is still writing (`leftovers`);
    without `files_only`, every entry named as one (a link to nothing, a directory) too."""
    return sorted(path for path in folder.glob("*.mp4")
                  if not path.name.startswith(".") and (path.is_file() or not files_only))


def partial_files_of_others(output: Path, clips: list[Path]) -> list[Path]:
    """The hidden partial files (`leftovers`) in `output` of clips other than `clips`: left by a killed run of other
    prompts, or being written by another run."""
    ours = {path for clip in clips for path in leftovers(clip)}
    found = [*output.glob(".*.partial.mp4"), *output.glob(".*.latents.safetensors.partial")]
    return sorted(path for path in found if path not in ours and path.is_file())


def clear_leftovers(path: Path) -> None:
    """Remove the partial files and the lock a killed run left beside the clip at `path`; a run still rendering it
    holds its lock, and its files stay."""
    claim = ClipClaim(path)
    if not any(p.exists() for p in [claim.lock_path, *leftovers(path)]):
        return
    try:
        if not claim.acquire():
            return
    except OSError:
        return  # the clip's own claim then fails with the reason
    try:
        for partial in leftovers(path):
            if partial.is_file() and not partial.is_symlink():  # what h3gen writes; anything else is not its own
                partial.unlink()
    except OSError:
        pass
    finally:
        claim.release()


def record(out_dir: Path, result, preset: str, status: str) -> OSError | None:
    """Append one line for a clip (h3gen.run.records): ok, failed, skipped (already there and valid), busy (another
    run has it) or conflict (there, rendered with other settings). None when written, else the error."""
    from h3gen.run.records import clip_record

    line = json.dumps({"time": round(time.time(), 3), "pid": os.getpid(),
                       **clip_record(result, preset), "status": status}) + "\n"
    path = out_dir / MANIFEST
    try:
        fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            if unterminated(fd):  # a line cut short (a crash, a full disk) ends where this one starts
                os.write(fd, b"\n")
            data, written = line.encode(), 0
            try:
                while written < len(data):  # a short write, and the next one says why: a full disk, a size limit
                    took = os.write(fd, data[written:])
                    if not took:
                        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                    written += took
            except OSError:  # cut the half line off again
                os.ftruncate(fd, os.fstat(fd).st_size - written)
                raise
        finally:
            os.close(fd)
    except OSError as e:
        return OSError(e.errno, e.strerror, str(path))
    return None


def unterminated(fd: int) -> bool:
    """Whether the file open at `fd` ends inside a line."""
    size = os.fstat(fd).st_size
    return size > 0 and os.pread(fd, 1, size - 1) != b"\n"


def recorded(out_dir: Path, result, preset: str):
    """`result` once its manifest line is written. When it cannot be: a clip written whole stays written (its file
    is valid, and a rerun records it and skips it) with the reason in `unrecorded`; a failed one says it after its
    own reason."""
    import dataclasses

    error = record(out_dir, result, preset, result.status)
    said = write_error(Path(error.filename), error) if error is not None else ""
    if not said or said in result.error:  # written, or failed for this already
        return result
    if result.ok:
        return dataclasses.replace(result, unrecorded=said)
    # Failed all the same: the summary and --json say so, after the clip's own reason and its fix.
    return dataclasses.replace(result, error=f"{result.error}; its manifest line was not written either "
                                             f"({error.strerror or error})")


def sha256_of(path: Path) -> str:
    """The sha256 of all of a file's bytes, in hex, read now (fingerprint.file_digest is a settings digest: a
    summary of the file, kept while its size and time stay)."""
    import hashlib

    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def written_digests(out_dir: Path) -> dict[str, str | None]:
    """Each clip's file name -> the sha256 the manifest in `out_dir` recorded when a run last wrote it (None for a
    clip an older h3gen wrote); read once while the manifest stays as it is."""
    path = out_dir / MANIFEST
    try:
        seen = path.stat()
    except OSError:
        return {}
    return _digests(str(path), seen.st_mtime_ns, seen.st_size)


@functools.lru_cache(maxsize=4)
def _digests(path: str, mtime_ns: int, size: int) -> dict[str, str | None]:
    found = {}
    with open(path, encoding="utf-8", errors="replace") as lines:
        for line in lines:
            try:
                record = json.loads(line)
            except ValueError:  # a line cut short by a crash or a full disk
                continue
            if isinstance(record, dict) and record.get("status") == "ok":
                found[Path(str(record.get("path", ""))).name] = record.get("sha256")
    return found


def written_sha256(path: Path) -> str | None:
    """The sha256 the manifest beside a clip recorded when h3gen last wrote it (None where it holds none)."""
    return written_digests(path.parent).get(path.name)


def changed_since_written(path: Path, wanted: str | None) -> list[str]:
    """A clip whose bytes are not `wanted`, the sha256 its manifest recorded (`written_sha256`): damaged or changed
    since h3gen wrote it (MP4 has no checksum, and a few bytes changed inside a frame decode without an error)."""
    if wanted is None or sha256_of(path) == wanted:
        return []
    return [f"its bytes are not those h3gen wrote (the sha256 in {MANIFEST} beside it): damaged or changed since"]


def check_manifest(out_dir: Path) -> None:
    """Raise OSError (with the manifest's path) when a line could not be appended to it, before any clip renders.
    A manifest not there yet is left to the first line (the directory is known to be writable)."""
    path = out_dir / MANIFEST
    if not os.path.lexists(path):
        return
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_APPEND))
    except OSError as e:
        raise OSError(e.errno, e.strerror, str(path)) from None


def write_error(path: Path, error: OSError, named: str = "") -> str:
    """The one line a failed write costs its clip; `named`: what the file is called where its line already names its
    path ("the clip")."""
    text = f"cannot write {named or path}: {error.strerror or error}"
    if error.errno == errno.EFBIG:
        text += " (a file size limit stops it: raise `ulimit -f`; a rerun redoes only the clips that are missing)"
    elif error.errno in (errno.ENOSPC, errno.EDQUOT) and no_inodes(path.parent):
        text += (f" (its file system has no free inodes, however much space it has: {NO_INODES_FIX}; a rerun redoes "
                 "only the clips that are missing)")
    elif error.errno in (errno.ENOSPC, errno.EDQUOT):
        text += f" (free space in {path.parent}; a rerun redoes only the clips that are missing)"
    elif error.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        text += " (make it writable; a rerun redoes only the clips that are missing)"
    return text


NO_INODES_FIX = "delete files there or pass -o on another disk"


def no_inodes_in(out_dir: Path) -> str:
    return f"the file system of {out_dir} has no free inodes, however much space it has"


def no_inodes(directory: Path) -> bool:
    """Whether the file system holding `directory` can create no more files (it counts inodes, and none is free)."""
    try:
        stats = os.statvfs(directory)
    except OSError:
        return False
    return stats.f_files > 0 and stats.f_favail == 0


def full_disk(error: BaseException) -> bool:
    """Whether `error` (or what it was raised from) is a write that found no space left."""
    while error is not None:
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        error = error.__cause__
    return False


def save_tensors(tensors: dict, path: Path, metadata: dict | None = None) -> None:
    """Write a safetensors file whole or not at all (a hidden partial file, renamed when complete). Python writes
    the bytes, so the file's mode follows the umask as every other output's does (safetensors' own writer makes it
    0600), and a failed write raises OSError with its errno."""
    from safetensors.torch import save

    partial = path.with_name(f".{path.name}.partial")
    try:
        partial.write_bytes(save(tensors, metadata))
        partial.replace(path)
    except OSError as e:
        raise OSError(e.errno, e.strerror, str(path)) from None
    finally:
        try:
            partial.unlink(missing_ok=True)
        except OSError:
            pass


def check_disk(out_dir: Path, request: Request, bytes_per_pixel: float = 0.0, writing: list[Request] = (),
               unfit_per_pixel: float = 0.0) -> None:
    """Fail a clip before it spends GPU time when its MP4 cannot fit on the disk: less is free than any MP4 takes, or
    than the clip would take at `bytes_per_pixel`, the least this run's clips took (written, or found valid), beside
    what the clips still `writing` (muxed in the background) will take at that rate; or no more is free than a clip
    of this run found when its MP4 did not fit (`unfit_per_pixel`, that free space over its pixels). Short of that
    the clip is rendered, and a disk that fills while it is written fails the clip with nothing partial left (the
    atomic write)."""
    def size(r: Request, rate: float) -> int:
        return math.ceil(r.frames * r.width * r.height * rate)

    need, pending = max(MP4_FLOOR_BYTES, size(request, bytes_per_pixel)), sum(size(r, bytes_per_pixel) for r in writing)
    free = shutil.disk_usage(out_dir).free
    if free < need + pending:
        free_text, need_text = sizes_that_differ(free, need)
        what = (f"at least {need_text}" if need == MP4_FLOOR_BYTES else
                f"about {need_text}, as clips of these settings take")
        if pending:
            what += f", beside about {sizes_that_differ(free, pending)[1]} for the clips still being written"
        problem = f"only {free_text} free in {out_dir}, the clip needs {what}"
    elif free <= size(request, unfit_per_pixel):
        problem = (f"only {sizes_that_differ(free, 0)[0]} free in {out_dir}, no more than when a clip of this run "
                   "did not fit")
    elif no_inodes(out_dir):  # the MP4's partial file is a new file, which takes an inode
        raise ClipError(no_inodes_in(out_dir), f"{NO_INODES_FIX}; a rerun redoes only the clips that are missing")
    else:
        return
    raise ClipError(problem, "free disk space; a rerun redoes only the clips that are missing")


def check_room(out_dir: Path) -> None:
    """Refuse a run before any weight loads when its output disk cannot take even the smallest MP4, or one more
    file."""
    free = shutil.disk_usage(out_dir).free
    if free < MP4_FLOOR_BYTES:
        free_text, need_text = sizes_that_differ(free, MP4_FLOOR_BYTES)
        raise WriteError(f"only {free_text} free in {out_dir}, and a clip takes at least {need_text}",
                         "free disk space there, or pass -o on another disk")
    if no_inodes(out_dir):
        raise WriteError(no_inodes_in(out_dir), NO_INODES_FIX)


def sizes_that_differ(a: int, b: int) -> tuple[str, str]:
    """Both sizes in the larger one's unit (KiB, MiB or GiB), with as many decimals as it takes for two different
    sizes to read differently."""
    unit, scale = next((unit, scale) for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))
                       if max(a, b) >= scale or unit == "KiB")
    for decimals in range(4):
        texts = f"{a / scale:.{decimals}f} {unit}", f"{b / scale:.{decimals}f} {unit}"
        if texts[0] != texts[1]:
            return texts
    return f"{a:,} bytes", f"{b:,} bytes"


LATENTS_TAG = "h3gen"  # the latents file's metadata key for the clip's stamp


def latents_path(path: Path) -> Path:
    return path.with_suffix(".latents.safetensors")


def write_latents(clip: Clip) -> None:
    """The clip's latents beside its MP4, stamped as the MP4 is: a rerun with --save-latents knows latents of
    other settings."""
    save_tensors({"video": clip.video_latents.float().cpu().contiguous(),
                  "audio": clip.audio_latents.float().cpu().contiguous()}, latents_path(clip.path),
                 {LATENTS_TAG: fingerprint.stamp(clip.fingerprint)})


def read_latents_stamp(path: Path) -> dict | None:
    """The fingerprint fields `write_latents` stamped into a latents file (None without them: an older h3gen's)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), "pt") as f:
            return fingerprint.stamped_fields((f.metadata() or {}).get(LATENTS_TAG, ""))
    except (OSError, SafetensorError):
        return None
