"""What a run finds where a clip's file goes: the file's name, and whether the file there is done (a rerun skips
it), in conflict (rendered with other settings, or not h3gen's) or damaged (rendered again)."""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import os
from pathlib import Path

from h3gen.errors import ModelError
from h3gen.inputs.request import Request
from h3gen.run import fingerprint
from h3gen.run.outputs import (changed_since_written, holder_fields, latents_path, read_latents_stamp,
                               written_sha256)
from h3gen.run.records import ClipResult

DAMAGED = "there but damaged:"  # how a clip h3gen wrote whole and something changed since is said


def clip_name(request: Request, preset: str) -> str:
    """The id when given, else a hash of the preset's name, the seed, the prompt and the media files' content, so
    reruns find the same file (the fingerprint, not the name, says whether the clip there has these settings)."""
    if request.id:  # an id that already ends in .mp4 is the file name itself
        return request.id if request.id.endswith(".mp4") else f"{request.id}.mp4"
    media = [request.first_frame, request.last_frame, *(r.path for r in request.references)]
    # t2va names stay what they always were; conditioned clips also depend on their media, by content as the
    # fingerprint takes them, so a project moved or mounted elsewhere finds its clips.
    key = f"{preset}\0{request.seed}\0{request.prompt}" + "".join(f"\0{fingerprint.file_digest(m)}"
                                                                   for m in media if m)
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return f"h3-{digest}.mp4"


def already_done(request: Request, out_dir: Path, preset: str, save_latents: bool,
                 run_fields: dict, redo: str = "") -> ClipResult | None:
    """What a run does with a clip whose file may be there: None when it is not (render it); skipped when it was
    rendered with the same fingerprint and validates for this request, so a rerun resumes; a conflict (left alone)
    when it was rendered with other settings, is a whole MP4 h3gen did not stamp, is not an MP4 at all, or is a
    link to a missing file; damaged (rendered again, see `to_render`) when it does not validate and is h3gen's or
    cut short. `redo` (RunSettings.redo): "all" renders every clip again (None), "conflicts" those h3gen stamped
    with other settings (a file it did not stamp stays)."""
    from h3gen.run.validate import box_problem, not_an_mp4

    path = out_dir / clip_name(request, preset)
    wanted = fingerprint.clip_fields(run_fields, request)
    if path.exists() and not path.is_file():  # no clip can be written there, --force or not
        return conflict(request, path, wanted, ["a directory" if path.is_dir() else "a special file"], "not a file",
                        "move it away, or -o elsewhere")
    if redo == "all":
        return None
    if path.is_symlink() and not path.exists():
        return conflict(request, path, wanted, [f"a link to {path.readlink()}, which is missing"], "not a file",
                        "restore what it points to, --force to replace the link, or -o elsewhere")
    if not path.is_file():
        return None
    if not_an_mp4(path):  # h3gen writes a clip whole and renames it into place: this file is someone else's
        return conflict(request, path, wanted, ["it does not start with an ftyp box"], "a file that is not an MP4")
    stored = fingerprint.read_stamp(path)
    settings = fingerprint.differences(stored, wanted)
    if stored is not None and settings:  # a changed duration too: not a clip of the wrong length to replace
        return None if redo == "conflicts" else conflict(request, path, wanted, settings,
                                                         "rendered with different settings", REDO_HINT)
    # A clip this run would write the same is checked for damage, not decoded picture by picture: it was whole when
    # renamed into place, and a rerun over thousands of clips must not cost a decode of each (`h3gen validate` does).
    # Where the manifest holds the sha256 of its bytes as written, reading them once for it is the whole check.
    problems, state = damage(path, stored, request.frames), DAMAGED
    if not problems and save_latents and stored is not None:
        problems, state = latents_problems(latents_path(path), wanted), "there, but"
    if problems and stored is None and not box_problem(path):
        return conflict(request, path, wanted, problems, "a whole MP4 h3gen did not stamp")
    if problems:  # the atomic write replaces it only once the new file is whole
        return ClipResult(request, path, False, {}, 0.0, status="damaged",
                          error=f"{state} {problems[0]}; rendered again")
    if stored is None:  # whole, but without h3gen's stamp: another tool's file, or an older h3gen's
        return conflict(request, path, wanted, ["no h3gen stamp in its metadata"], "a whole MP4 h3gen did not stamp")
    return ClipResult(request, path, True, {}, 0.0, skipped=True, fingerprint=fingerprint.digest(wanted))


def damage(path: Path, stored: dict | None, expected_frames: int | None = None) -> list[str]:
    """What a rerun finds wrong with the clip at `path` (its stamp `stored`): where the manifest holds the sha256 of
    its bytes as written, reading them once for it is the whole check."""
    from h3gen.run.validate import validate_clip

    written = written_sha256(path) if stored is not None else None
    if written:
        return changed_since_written(path, written)
    return validate_clip(path, expected_frames=expected_frames, pictures=stored is None)


def rendered_again(path: Path) -> bool:
    """Whether a rerun of the render that wrote the clip at `path` renders it again, as `already_done` takes a clip
    of its settings: one h3gen stamped whose bytes are not those it wrote or do not validate, or one cut short."""
    from h3gen.run.validate import box_problem, not_an_mp4

    if not path.is_file() or not_an_mp4(path):
        return False
    stored = fingerprint.read_stamp(path)
    return (stored is not None or bool(box_problem(path))) and bool(damage(path, stored))


def latents_problems(path: Path, wanted: dict) -> list[str]:
    """What is wrong with a clip's latents file beside it: gone or damaged from outside (it is written whole), without
    a stamp, or stamped with settings other than the clip's (`wanted`)."""
    from h3gen.models.repo import check_safetensors

    if not path.is_file():
        return [f"its latents {path.name} are missing (--save-latents writes them beside the clip)"]
    try:
        check_safetensors(path)
    except ModelError:
        return [f"its latents {path.name} are cut short or not safetensors"]
    stored = read_latents_stamp(path)
    if stored is None:  # an older h3gen's, or another tool's: nothing says they are this clip's
        return [f"its latents {path.name} carry no h3gen stamp, so their settings are not known"]
    settings = fingerprint.differences(stored, wanted)
    if settings:
        return [f"its latents {path.name} are of other settings ({first_reasons(settings)})"]
    return []


REDO_HINT = "--redo-conflicts to render these again, --force every clip, or -o elsewhere"


def held_with_other_settings(path: Path, wanted: dict, has_id: bool) -> str:
    """Why the clip at `path`, which another run holds, is not the one `wanted` asks for: that run renders it with
    other settings ('' when the same, or when its settings are not known). `has_id`: the prompt names its clip."""
    held = holder_fields(path)
    reasons = fingerprint.differences(held, wanted) if held else []
    if not reasons:
        return ""
    return (f"another h3gen run is rendering it with other settings ({first_reasons(reasons)}); when that run ends, "
            f"--redo-conflicts renders this one over it; or give the prompt {'another' if has_id else 'an'} id, or -o "
            "elsewhere")


def conflict(request: Request, path: Path, wanted: dict, reasons: list[str], what: str,
             hint: str = "move it away to render this clip, --force to render every clip again, or -o "
                         "elsewhere") -> ClipResult:
    return ClipResult(request, path, False, {}, 0.0, skipped=True, status="conflict",
                      error=f"exists, {what} ({first_reasons(reasons)}); {hint}",
                      fingerprint=fingerprint.digest(wanted))


def first_reasons(reasons: list[str]) -> str:
    """The first three reasons, and how many more there are."""
    more = f", and {len(reasons) - 3} more" if len(reasons) > 3 else ""
    return "; ".join(reasons[:3]) + more


def to_render(found: ClipResult | None) -> bool:
    """Whether `already_done`'s answer leaves the clip to render."""
    return found is None or found.status == "damaged"


MOVED_SPAN = 16  # how many places each way a default seed is looked for when its line moved


def moved_seeds(pending: list[Request], requests: list[Request], out_dir: Path, preset: str, base_seed: int) -> str:
    """A note when clips about to render on their default seed (`base_seed` plus their place in the file) have a clip
    here from the same prompt under a seed up to MOVED_SPAN places away that no line of the file asks for: lines above
    them were removed or added since, so each renders anew under another name. '' when none has."""
    ours = {clip_name(request, preset) for request in requests}
    others = {entry.name for entry in os.scandir(out_dir) if entry.name.endswith(".mp4")} - ours \
        if out_dir.is_dir() else set()
    if not others:  # every clip here is one this file asks for
        return ""
    moved = collections.Counter()
    for request in pending:
        if (request.id or request.seed != base_seed + request.index or request.first_frame or request.last_frame
                or request.references or (out_dir / clip_name(request, preset)).exists()):
            continue  # an id or a seed of its own, or rendered over its own name (--force, a conflict, damaged)
        for offset in (way * places for places in range(1, MOVED_SPAN + 1) for way in (1, -1)):
            name = clip_name(dataclasses.replace(request, seed=request.seed + offset), preset)
            if request.seed + offset >= 0 and name in others:
                moved[offset] += 1
                break
    if not moved:
        return ""
    if len({offset > 0 for offset in moved}) == 1:  # every one moved the same way (a repeated prompt: further)
        offset = min(moved, key=lambda o: (-moved[o], abs(o)))  # the commonest, the nearest of equals
        what = "removed or commented out (or --seed lowered)" if offset > 0 else "added (or --seed raised)"
        lines = "a prompt line above them was" if abs(offset) == 1 else f"{abs(offset)} prompt lines above them were"
        where = f"under a seed {abs(offset)} {'higher' if offset > 0 else 'lower'}: {lines} {what}"
        back = "put the line back" if offset > 0 else "move the new line below them"
    else:
        where = "under a seed a few places away: prompt lines were moved, added or removed (or --seed changed)"
        back = "put the lines back as they were"
    return (f"{sum(moved.values())} of the clips to render have a clip in {out_dir} from the same prompt {where}, "
            "which moved their default seeds (--seed plus the place in the file), so they render anew under other "
            f"names; {back} to keep those clips, and give each line its \"seed\" where lines come and go")
