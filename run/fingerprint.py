"""A clip's render fingerprint: everything that decides its bytes, as named fields and one digest of them.

It is stored in the MP4 (its `comment` tag) and in the manifest, so a rerun skips a clip only when the clip on disk
was rendered from the same model, resolved preset, request and stage versions, and otherwise says which field
differs. The machine is not part of it (device, CPU threads): a clip's settings are, where it ran is not.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from functools import cache, lru_cache
from pathlib import Path

# Bumped by a change to h3gen that changes the bytes of a clip rendered with the same settings, so reruns redo them.
RENDER_VERSION = 1
# Resolved preset values that change how a run goes, never what a clip holds (streamed blocks: tests/test_streaming.py;
# a memory budget only picks how many).
NOT_IN_OUTPUT = ("version", "request.", "runtime.device", "runtime.vram_gib", "parallel.", "model.", "mux.workers",
                 "encode.cache", "encode.stream_layers", "sampler.stream_blocks", "sampler.stream_with")
TAG = "comment"  # the MP4 metadata key; ffmpeg's mp4 muxer keeps only the standard ones


def digest(fields: dict) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


def plain(value):
    """A JSON value for a config value (paths and tuples as JSON has them)."""
    return json.loads(json.dumps(value, default=str))


def run_fields(preset, registry, repo) -> dict:
    """The fields every clip of a run shares: h3gen's render version, the model, the preset and its stages."""
    from h3gen.config.preset import describe
    from h3gen.stages.base import wrapped_chain

    fields = {"h3gen": RENDER_VERSION, "model": model_identity(str(repo.root))}  # the preset by its values, not name
    for key, value, _ in describe(preset):
        if not key.replace(".wraps.", ".").startswith(NOT_IN_OUTPUT):  # a wrapped stage's keys as its own
            fields[key] = plain(value)
    for kind, (name, config) in preset.stages.items():
        for depth, (stage, stage_config) in enumerate(wrapped_chain(registry.stage(kind, name), config)):
            section = kind + ".wraps" * depth
            fields[f"{section}.use"] = f"{stage.name} {stage_version(stage)}"
            note_defaults(fields[f"{section}.use"], stage_config)
            # A stage may declare config keys that change how it runs, never what it writes (`output_neutral`).
            for key in getattr(stage, "output_neutral", ()):
                fields.pop(f"{section}.{key}", None)
    for index, (path, scaling) in enumerate(adapter_files(preset, repo.root)):
        fields[f"adapter.file{index}"] = file_digest(path)
        if scaling is not None:  # a PEFT folder's adapter_config.json: its alpha scales the delta
            fields[f"adapter.config{index}"] = file_digest(scaling)
    return fields


# Each stage's keys at their defaults, by the stage's `use` (name and version): a key a stage gained since a clip was
# stamped, left at its default, is that clip's setting (a default that changed the bytes would change the version).
DEFAULTS: dict[tuple[str, str], object] = {}


def note_defaults(use: str, config) -> None:
    for field in dataclasses.fields(config):
        if field.default is not dataclasses.MISSING:
            DEFAULTS[use, field.name] = plain(field.default)
        elif field.default_factory is not dataclasses.MISSING:
            DEFAULTS[use, field.name] = plain(field.default_factory())


def clip_fields(run: dict, request) -> dict:
    """A clip's fields: the run's and its request's (the media files by their content)."""
    fields = dict(run, **{"request.prompt": request.prompt, "request.seed": request.seed,
                          "request.size": f"{request.width}x{request.height}", "request.frames": request.frames})
    for key in ("first_frame", "last_frame"):
        if getattr(request, key):
            fields[f"request.{key}"] = file_digest(getattr(request, key))
    if request.references:
        fields["request.references"] = [f"{r.kind} {file_digest(r.path)}" for r in request.references]
    return fields


def stamp(fields: dict) -> str:
    """What the MP4's tag holds: the digest and the fields, so a rerun can say what changed."""
    return json.dumps({"h3gen_fingerprint": digest(fields), "fields": fields}, sort_keys=True, ensure_ascii=False)


def read_stamp(path: Path) -> dict | None:
    """The fields stored in an MP4 by `stamp`, or None for a clip without them."""
    import av

    try:
        with av.open(str(path)) as container:
            return stamped_fields(container.metadata.get(TAG, ""))
    except (av.FFmpegError, OSError, ValueError):  # a tag that is not UTF-8 (a damaged file) too
        return None


def stamped_fields(text: str) -> dict | None:
    """The fields of a `stamp` (an MP4's tag, a latents file's metadata); None for text that is not one."""
    try:
        stored = json.loads(text)
    except ValueError:
        return None
    return stored["fields"] if isinstance(stored, dict) and isinstance(stored.get("fields"), dict) else None


def differences(old: dict | None, new: dict) -> list[str]:
    """`FIELD: OLD -> NEW` for each field of this run's that differs (a clip from before fingerprints: one line
    saying so): a stage swapped (`vae.use`) first, whose own keys then differ too, then the rest by name. A field
    only the clip carries is one this h3gen no longer counts (the preset's name, a key a stage since declared
    `output_neutral`): where its stage changed, that stage's `use` differs; but a request's media the clip had and this
    request has not (a first frame taken off the line) is. A key only this run has is a difference but where its
    stage, the same name and version, gained it since and it is at its default (`DEFAULTS`)."""
    if old is None:
        return ["fingerprint: none -> " + digest(new)]
    keys = sorted(set(new) | {key for key in old if key.startswith("request.")},
                  key=lambda key: (not key.endswith(".use"), key))
    was, now = {key: before(key, old) for key in keys}, {key: new.get(key) for key in keys}
    return [f"{key}: {shown(was[key])} -> {shown(now[key])}{in_seconds(key, was[key], now[key])}"
            for key in keys if was[key] != now[key] and not same_model(key, was[key], now[key])
            and not (was[key] is None and gained_at_default(key, old, new))]


def gained_at_default(key: str, old: dict, new: dict) -> bool:
    """`key` is a knob its stage gained since `old` was stamped, and `new` leaves it at its default."""
    section, _, knob = key.rpartition(".")
    use = new.get(f"{section}.use")
    return (knob != "use" and key not in old and use is not None and old.get(f"{section}.use") == use
            and (use, knob) in DEFAULTS and DEFAULTS[use, knob] == new[key])


def before(key: str, old: dict):
    """`key`'s value in `old`, at its other place where a stage was wrapped or unwrapped since (`mux.crf` once
    `mux.wraps.crf`): a key that only moved is no difference, the `use` that changed with it is."""
    if key in old or key.endswith(".use"):
        return old.get(key)
    bare = key.replace(".wraps.", ".")
    return next((value for k, value in old.items() if k.replace(".wraps.", ".") == bare), None)


def same_model(key: str, old, new) -> bool:
    """A clip stamped with the model's identity counted over every file, documentation too, when the repository is
    as it was."""
    return key == "model" and old is not None and COUNTING_EVERY_FILE.get(new) == old


def in_seconds(key: str, old, new) -> str:
    """A frame count is what a prompt's `duration` became: said in seconds too."""
    from h3gen.inputs.request import FPS

    if key != "request.frames" or not all(isinstance(v, int) for v in (old, new)):
        return ""
    return f" (duration {old / FPS:.2f} s -> {new / FPS:.2f} s)"


def shown(value) -> str:
    from h3gen.text import shown as escaped

    # A string as it is, but an empty one, which would read as a line cut short.
    text = escaped("(none)" if value is None else value if isinstance(value, str) and value else json.dumps(value))
    return text if len(text) <= 60 else text[:57] + "..."


def stage_version(stage: type) -> str:
    """A stage's own `version` when it declares one; else its distribution's version (h3gen's render version for
    the built-ins)."""
    declared = getattr(stage, "version", None)
    if declared is not None:
        return str(declared)
    top = stage.__module__.split(".")[0]
    if top == "h3gen":
        return f"h3gen/{RENDER_VERSION}"
    from importlib.metadata import packages_distributions, version

    names = packages_distributions().get(top, [])
    return f"{names[0]}/{version(names[0])}" if names else f"{top}/unversioned"


def adapter_files(preset, model_root) -> list[tuple[Path, Path | None]]:
    """Each adapter's weights, and the PEFT config beside them where it has one."""
    from h3gen.config.contract import find_adapter

    found = [find_adapter(name, model_root) for name in preset.adapter.paths]
    return [(adapter.weights, adapter.peft_config) for adapter in found]


@cache
def model_identity(root: str) -> str:
    """The repository's weights, configs and tokenizer files without reading every weight: each file's path and size,
    and what `file_summary` reads of it; not its documentation (`DOCUMENTATION`: a model card edited or re-downloaded
    changes no clip). The repository's own path, which a saved modular_model_index.json records for each component,
    counts as ".", and so does any other absolute path recorded there (the folder copied or moved since): the same
    model written in another cache folder is the same model, and so is one named by a relative path, through a link,
    or copied elsewhere."""
    hashed, every_file = hashlib.sha256(), hashlib.sha256()
    base = Path(root)
    owns = sorted({json.dumps(str(form))[1:-1].encode() for form in (base.absolute(), base.resolve())}, key=len,
                  reverse=True)  # the longer first: one path may hold the other
    for path in sorted(p for p in base.rglob("*") if p.is_file() and not p.name.startswith(".")):
        summary, size = file_summary(path), path.stat().st_size
        for own in owns:
            if own in summary:  # a file read whole
                summary = summary.replace(own, b".")
                size = len(summary)
        if path.suffix == ".json" and path.stat().st_size <= WHOLE_BYTES:  # where a folder copied or moved was saved
            summary = SAVED_AT.sub(rb'\1"."', summary)
            size = len(summary)
        for digest_of in (every_file,) if documentation(path) else (every_file, hashed):
            digest_of.update(f"{path.relative_to(base)}\0{size}\0".encode())
            digest_of.update(summary)
    identity = hashed.hexdigest()[:16]
    COUNTING_EVERY_FILE[identity] = every_file.hexdigest()[:16]
    return identity


# Files of a model repository that no loader reads: by suffix, and by name (README.txt, LICENSE, NOTICE, ...).
DOCUMENTATION = ({".md", ".markdown", ".rst", ".html", ".pdf", ".png", ".jpg", ".jpeg", ".gif", ".webp", ".svg",
                  ".mp4", ".webm", ".mov"}, ("README", "LICENSE", "LICENCE", "NOTICE", "COPYING", "CITATION"))
# A model's identity as clips stamped before documentation was left out recorded it: every file counted.
COUNTING_EVERY_FILE: dict[str, str] = {}


def documentation(path: Path) -> bool:
    suffixes, names = DOCUMENTATION
    return path.suffix.lower() in suffixes or path.name.upper().startswith(names)


WHOLE_BYTES = 2**26  # a file up to this size is read whole
# A component's source as save_pretrained recorded it: an absolute path is where the folder was, not what it holds.
SAVED_AT = re.compile(rb'("pretrained_model_name_or_path":\s*)"/[^"]*"')
SAMPLES, SAMPLE_BYTES = 8, 2**20  # a larger safetensors file: its header, then these spread over its tensors


def file_summary(path: Path, whole_bytes: int = WHOLE_BYTES) -> bytes:
    """What a file counts by: up to `whole_bytes`, all of it; past that, a safetensors file by its header and
    samples spread over its tensor bytes, the last ending at the file's end (weights retrained at the same shapes
    differ there), any other file by its modification time."""
    size = path.stat().st_size
    with path.open("rb") as f:
        if path.suffix != ".safetensors":
            return f.read() if size <= whole_bytes else str(path.stat().st_mtime_ns).encode()
        if size <= whole_bytes:
            return f.read()
        length = f.read(8)
        summary = [length, f.read(min(int.from_bytes(length, "little"), 2**27))]
        start = f.tell()
        for i in range(SAMPLES):
            f.seek(start + max(0, size - start - SAMPLE_BYTES) * i // (SAMPLES - 1))
            summary.append(f.read(SAMPLE_BYTES))
        return b"".join(summary)


def file_digest(path: Path) -> str:
    """A file the request or preset names, by its content (a safetensors file by its summary). Read once while the
    file stays as it is: a clip's name and its fingerprint both take its media."""
    path = Path(path)
    state = path.stat()
    return _digest(path.resolve(), state.st_dev, state.st_ino, state.st_size, state.st_mtime_ns)


@lru_cache(maxsize=256)
def _digest(path: Path, device: int, inode: int, size: int, modified_ns: int) -> str:
    return hashlib.sha256(file_summary(path) + str(size).encode()).hexdigest()[:16]
