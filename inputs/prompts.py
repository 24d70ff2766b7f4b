"""The prompts file: one prompt per line, or JSON Lines with `prompt` and optional per-clip settings; and the
command-line values that stand for a line's fields or pick its lines (`parse_size` for --size, `parse_shard` and
`shard_requests` for --shard), checked by the same rules."""

from __future__ import annotations

import json
import re
from pathlib import Path

from h3gen.inputs.request import MAX_SECONDS, MIN_SECONDS, Request, frames_for_duration
from h3gen.errors import UsageError, together

FIELDS = {"prompt": str, "id": str, "seed": int, "duration": (int, float), "width": int, "height": int,
          "first_frame": str, "last_frame": str, "references": list}
KINDS = {str: "a string", int: "a whole number, unquoted", (int, float): "a number, unquoted",
         list: "a list of file paths"}
KEYFRAMES = ("first_frame", "last_frame")
SAFE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
MIN_ASPECT, MAX_ASPECT = 1 / 4, 4
SEEDS = range(2**63)  # what a seed may be: 0 to 2**63 - 1
MOST_BAD_LINES = 20  # a prompts file's bad lines one run names


STREAMED: dict[str, bytes] = {}  # a prompts file that is a pipe (/dev/stdin, <(...)) reads once: kept for the next read


# A prompts file is text: four million prompts of 256 characters fit in 1 GiB. Read a chunk at a time, each chunk
# checked as it comes, so a binary file, a model's weights or an endless stream (/dev/urandom) stops at the chunk
# that shows it instead of filling memory. A few bytes that are not UTF-8 make bad lines, each named with the rest
# (`read_prompts`); more than NOT_TEXT_BYTES of them make a file that is not UTF-8 at all (Latin-1, binary).
MAX_PROMPTS_BYTES, READ_CHUNK, NOT_TEXT_BYTES = 1 << 30, 1 << 20, 256
NOT_TEXT, NUL = "save the prompts file as UTF-8", b"\0"
NOT_UTF8 = re.compile("[\udc80-\udcff]")  # a byte UTF-8 cannot read, as errors="surrogateescape" decodes it


def prompts_bytes(path: Path) -> bytes:
    """The prompts file's bytes, without a NUL byte and mostly UTF-8 text; a pipe's as it held them when first read
    in this process."""
    import codecs

    if str(path) in STREAMED:
        return STREAMED[str(path)]
    read, decoder, not_utf8 = bytearray(), codecs.getincrementaldecoder("utf-8")("surrogateescape"), 0
    with path.open("rb") as f:
        while True:
            chunk = f.read(READ_CHUNK)
            read += chunk
            not_utf8 += len(NOT_UTF8.findall(decoder.decode(chunk, final=not chunk)))
            if not_utf8 > NOT_TEXT_BYTES:
                raise UsageError(f"{path}:{_line_of(read, _first_bad_byte(read))}: not UTF-8 text (more than "
                                 f"{NOT_TEXT_BYTES} bytes that UTF-8 cannot read)", NOT_TEXT)
            if NUL in chunk:  # valid UTF-8, but text has none: UTF-16 without its byte-order mark, or binary
                raise UsageError(f"{path}:{_line_of(read, read.index(NUL))}: a NUL byte, so not UTF-8 text "
                                 "(UTF-16, or not text at all)", NOT_TEXT)
            if not chunk:
                break
            if len(read) > MAX_PROMPTS_BYTES:
                raise UsageError(f"prompts file {path} holds more than {MAX_PROMPTS_BYTES / 2**30:g} GiB, which no "
                                 "prompts file does", "pass the text or JSON Lines file of the prompts")
    data = bytes(read)
    if not path.is_file():
        STREAMED[str(path)] = data
    return data


def _first_bad_byte(data: bytearray) -> int:
    try:
        bytes(data).decode("utf-8")
    except UnicodeDecodeError as e:
        return e.start
    return len(data)


def _line_of(data: bytearray, offset: int) -> int:
    return data.count(b"\n", 0, offset) + 1


def not_utf8(line: str, where: str) -> UsageError | None:
    """A line holding bytes UTF-8 cannot read (decoded with errors="surrogateescape"), named at its first one."""
    bad = NOT_UTF8.search(line)
    if bad is None:
        return None
    byte = ord(bad.group()) - 0xDC00
    return UsageError(f"{where}:{bad.start() + 1}: not UTF-8 text (the byte 0x{byte:02X})", NOT_TEXT)


def media_base(path: Path) -> Path:
    """The folder a line's relative media paths start from: the prompts file's (the file a link leads to, so
    `/dev/stdin` fed from a file is that file), or the current one for a pipe (`<(...)`), which has no folder."""
    return Path(".") if str(path) in STREAMED else path.resolve().parent


def read_prompts(path: Path, base_seed: int, defaults: dict, file_name=None) -> list[Request]:
    """Parse and check every line before anything loads, so a bad line costs seconds, not a run; with `file_name`
    (a request -> the name of the clip it writes), two lines that would write one file are bad lines too."""
    path = Path(path)
    if base_seed not in SEEDS:
        raise UsageError(f"base seed {base_seed} is out of range", "give --seed between 0 and 2**63 - 1")
    try:
        text = prompts_bytes(path).decode("utf-8", "surrogateescape")  # a line with bytes UTF-8 cannot read is bad
    except FileNotFoundError:
        raise UsageError(f"prompts file {path} does not exist", "pass the path of a text or JSON Lines file") from None
    except IsADirectoryError:
        raise UsageError(f"prompts file {path} is a directory", "pass the path of a text or JSON Lines file") from None
    except PermissionError:
        raise UsageError(f"prompts file {path} is not readable", "check its permissions") from None
    if path.suffix.lower() == ".toml":  # a preset in the prompts file's place would render its lines as prompts
        raise UsageError(f"prompts file {path} is a TOML file, which is how presets are written",
                         f"pass it as --preset {path}, and a prompts file (text or JSON Lines) first")
    requests, seen, bad = [], {}, []
    prompts = [(number, line, whole) for number, whole in enumerate(prompt_lines(text), start=1)
               if (line := whole.strip()) and not line.startswith("#")]
    for index, (number, line, whole) in enumerate(prompts):
        try:  # every line is checked, so one run names each bad one
            bad_text = not_utf8(whole, f"{path}:{number}")
            if bad_text:
                raise bad_text
            fields = _parse_line(line, f"{path}:{number}")
            request = _request(fields, index, number, base_seed, defaults, f"{path}:{number}", media_base(path))
            if request.id in seen:
                raise UsageError(f"{path}:{number}: duplicate id '{request.id}' (first on line {seen[request.id]})",
                                 "give every clip its own id")
        except UsageError as e:
            bad.append((number, e))  # with the line's other problems as its `also`
            continue
        if request.id is not None:
            seen[request.id] = number
        requests.append(request)
    if file_name is not None:
        bad = sorted(bad + collisions(requests, file_name, path), key=lambda numbered: numbered[0])
    if bad:
        more = len(bad) - MOST_BAD_LINES
        shown = [each for _, e in bad[:MOST_BAD_LINES] for each in (e, *e.also)]
        raise together(shown + [UsageError(f"{path}: {more} more bad lines after these",
                                           "fix these and run again to see them")] * (more > 0))
    if not requests:
        where = "standard input" if str(path) == "/dev/stdin" else f"prompts file {path}"
        raise UsageError(f"{where} has no prompts", "write one prompt per line, or JSON Lines")
    return requests


def collisions(requests: list[Request], file_name, path: Path) -> list[tuple[int, UsageError]]:
    """(line, error) for each request that would write the file an earlier one writes: the second would silently
    replace the first. Names that differ only in case are one file on macOS's and Windows' file systems."""
    first, found = {}, []  # casefolded name -> (line, name, its id)
    for request in requests:
        name = file_name(request)
        if name.casefold() in first:
            line, other, other_id = first[name.casefold()]
            case = "" if other == name else f" as {other}, one file on macOS and Windows"
            fix = ("give the clips ids that differ in more than case" if request.id and other_id and other != name
                   else "give the clips ids that name different files" if request.id and other_id else
                   "give one of them another seed or an id" if not (request.id or other_id) else
                   "give the clips different ids or seeds")
            found.append((request.line, UsageError(f"{path}:{request.line}: writes {name}, as line {line} does{case}",
                                                   fix)))
            continue
        first[name.casefold()] = (request.line, name, request.id)
    return found


def prompt_lines(text: str) -> list[str]:
    """Lines end at \n only (a \r before it goes too): U+2028 and the other breaks `str.splitlines` honours are
    text, as JSON allows them unescaped in a string. A byte-order mark (editors on Windows write one) is dropped."""
    return [line.removesuffix("\r") for line in text.removeprefix("\ufeff").split("\n")]


def encodable(value) -> bool:
    """Whether every string in a JSON value is text that UTF-8 can write (JSON's \\u escapes can name half a
    surrogate pair, which no encoder, tokenizer or file name takes)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return False
    elif isinstance(value, list):
        return all(map(encodable, value))
    elif isinstance(value, dict):
        return all(map(encodable, [*value, *value.values()]))
    return True


class _Twice(ValueError):
    """A JSON object that names one key twice (json would keep the last silently)."""


def _once_each(pairs: list) -> dict:
    seen = {}
    for key, value in pairs:
        if key in seen:
            raise _Twice(key)
        seen[key] = value
    return seen


MAX_NESTING = 8  # a line's object, a list in it, an object in that list: deeper is no request's


def nesting(value) -> int:
    """How deep `value`'s lists and objects go (a string or number: 0), without recursion."""
    deepest, level = 0, [(value, 0)]
    while level:
        item, depth = level.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is not None:
            deepest = max(deepest, depth + 1)
            if deepest > MAX_NESTING:
                return deepest
            level.extend((child, depth + 1) for child in children)
    return deepest


def _parse_line(line: str, where: str) -> dict:
    # A line that starts like JSON is JSON or an error: a typo in an object must never render as its text.
    if not line.startswith(("{", "[")):
        return {"prompt": line}
    try:
        fields = json.loads(line, object_pairs_hook=_once_each)
        if nesting(fields) > MAX_NESTING:
            raise RecursionError
    except RecursionError:
        raise UsageError(f"{where}: JSON nested deeper than the {MAX_NESTING} levels a request can have",
                         'write one object per line, e.g. {"prompt": "...", "references": ["a.png"]}') from None
    except json.JSONDecodeError as e:
        before, after = line[:e.pos].rstrip(), line[e.pos:].strip()
        if not after:
            what = "the line ends before its object does (an object must be whole on its line)"
        elif before.endswith(",") and after[0] in "}]":
            what = "a comma before the closing bracket, which JSON does not allow"
        else:
            what = e.msg
        raise UsageError(f"{where}: malformed JSON at column {e.colno}: {what}",
                         'write one object per line, e.g. {"prompt": "..."}; a prompt starting with "[" or "{" '
                         'goes in one too') from None
    except _Twice as e:
        raise UsageError(f"{where}: field {e.args[0]!r} is given twice", "keep the one you mean") from None
    if not isinstance(fields, dict):
        raise UsageError(f"{where}: a JSON line must be an object", 'e.g. {"prompt": "..."}')
    problems = []  # each field's, so one run names them all
    for key, value in fields.items():
        if key not in FIELDS:
            problems.append(UsageError(f"{where}: unknown field {key!r}", f"allowed fields: {', '.join(FIELDS)}"))
        elif not encodable(value):
            problems.append(UsageError(f"{where}: field '{key}' holds a lone UTF-16 surrogate (a \\ud800-\\udfff "
                                       "escape without its pair), which is not text",
                                       "write the character itself, or both halves of its surrogate pair"))
        elif not isinstance(value, FIELDS[key]) or isinstance(value, bool):
            problems.append(UsageError(f"{where}: field '{key}' has the wrong type ({_short(value, as_json=True)})",
                                       f"give {KINDS[FIELDS[key]]}; the README's prompts file table lists each "
                                       "field's type"))
    prompt = fields.get("prompt", "")
    if isinstance(prompt, str) and not prompt.strip():  # another type is named as such above
        problems.append(UsageError(f"{where}: missing or empty 'prompt'", 'every JSON line needs {"prompt": "..."}'))
    if problems:
        raise together(problems)
    return fields


def _request(fields: dict, index: int, line: int, base_seed: int, defaults: dict, where: str,
             base: Path = Path(".")) -> Request:
    problems = []  # each independent check's, so one run names them all

    def check(problem, *args):
        try:
            return problem(*args)
        except UsageError as e:
            problems.append(e)

    duration = float(fields.get("duration", defaults["duration"]))
    check(check_duration, duration, where)
    width, height = int(fields.get("width", defaults["width"])), int(fields.get("height", defaults["height"]))
    found = check(_conditions, fields, base, where)
    conditions, keyframe_size = found or ({}, None)
    if keyframe_size is not None and "width" not in fields and "height" not in fields:
        width, height = check(_keyframe_canvas, keyframe_size, width, height, where) or (width, height)
    elif found is not None or "width" in fields or "height" in fields:  # a bad keyframe sets no canvas to check
        from_preset = [side for side in ("width", "height") if side not in fields]
        check(check_size, width, height, where, from_preset[0] if len(from_preset) == 1 else "")
    clip_id = fields.get("id")
    if clip_id is not None and not SAFE_ID.match(clip_id):
        problems.append(UsageError(f"{where}: id {_short(clip_id)} is not a plain file name",
                                   "start it with an ASCII letter or digit, then ASCII letters, digits, '.', '_' and "
                                   "'-' only, 128 characters at most"))
    seed = int(fields.get("seed", base_seed + index))
    if seed not in SEEDS and "seed" not in fields:
        problems.append(UsageError(f"{where}: seed {seed} (the base seed {base_seed} plus the clip's index {index}) "
                                   "is out of range", "give a smaller --seed, or the line a seed of its own"))
    elif seed not in SEEDS:
        problems.append(UsageError(f"{where}: seed {seed} is out of range", "use a seed between 0 and 2**63 - 1"))
    if problems:
        raise together(problems)
    request = Request(index=index, prompt=fields["prompt"].strip(), seed=seed, width=width, height=height,
                      frames=frames_for_duration(duration), id=clip_id, line=line, **conditions)
    check_fits(request, where)
    return request


def _keyframe_canvas(keyframe_size: tuple[int, int], width: int, height: int, where: str) -> tuple[int, int]:
    """The size a line without one renders its keyframe at: the keyframe's aspect ratio on the preset's canvas."""
    from h3gen.inputs.media import keyframe_canvas

    canvas = keyframe_canvas(keyframe_size, width, height)
    try:
        check_size(*canvas, where)
    except UsageError:  # diffusers' rule rounds a keyframe near 1:4 or 4:1 past it on some canvases
        raise UsageError(f"{where}: the keyframe's {keyframe_size[0]}x{keyframe_size[1]} on the {width}x{height} "
                         f"canvas gives {canvas[0]}x{canvas[1]}, outside H3's 1:4 to 4:1 once rounded to "
                         "multiples of 32", "give the line a width and height, or crop the keyframe a little "
                         "less narrow") from None
    return canvas


def _conditions(fields: dict, base: Path, where: str) -> tuple[dict, tuple[int, int] | None]:
    """fl2va keyframes or ref2va references, every file checked; and the size of the keyframe that sets the
    canvas (the first frame, else the last) when the line gives no size."""
    keyframes = [field for field in KEYFRAMES if field in fields]
    if not keyframes and "references" not in fields:
        return {}, None
    from h3gen.inputs import media

    if keyframes and "references" in fields:
        raise UsageError(f"{where}: a line conditions on keyframes (fl2va) or on references (ref2va), not both",
                         "split it into two lines")
    if "references" in fields:
        return {"references": media.references(fields["references"], base, where)}, None
    if ("width" in fields) != ("height" in fields):
        raise UsageError(f"{where}: give both width and height, or neither",
                         "without them the keyframe's aspect ratio sets the size")
    found = {field: media.keyframe(fields[field], base, field, where) for field in keyframes}
    return {field: path for field, (path, _) in found.items()}, found[keyframes[0]][1]


def check_clip(seconds: float, width: int, height: int, where_duration: str, where_size: str) -> None:
    """A duration and size checked as a prompt's own are, where they come from elsewhere: a preset's request
    defaults, `h3gen bench --durations --size`."""
    check_duration(seconds, where_duration)
    check_size(width, height, where_size)
    check_fits(Request(index=0, prompt="", seed=0, width=width, height=height, frames=frames_for_duration(seconds)),
               where_size)


def parse_size(text: str, option: str = "--size") -> tuple[int, int]:
    """A WIDTHxHEIGHT an option gives, e.g. 1344x768 (not yet checked as a size H3 renders)."""
    try:
        width, height = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise UsageError(f"cannot read {option} {text!r}", f"WIDTHxHEIGHT: e.g. {option} 1344x768") from None
    return width, height


def check_duration(seconds: float, where: str) -> None:
    if not MIN_SECONDS <= seconds <= MAX_SECONDS:
        raise UsageError(f"{where}: duration {seconds:g} s is outside H3's {MIN_SECONDS:g}-{MAX_SECONDS:g} s",
                         "ask for 5 to 15 seconds")


def check_size(width: int, height: int, where: str, preset_side: str = "") -> None:
    """Sides in multiples of 32, 32 or more, within 1:4 to 4:1; `preset_side` ("width" or "height"): the side the
    preset gave, which the error names (and the fix: the prompt can give it too)."""
    multiples = width >= 32 and height >= 32 and not width % 32 and not height % 32
    within = width > 0 and height > 0 and MIN_ASPECT <= width / height <= MAX_ASPECT
    if multiples and within:
        return
    size = f"size {width}x{height}" + (f" (its {preset_side} the preset's)" if preset_side else "")
    problem = (f"{size} has a side under 32 pixels" if min(width, height) < 32
               else f"{size} is not made of multiples of 32" if not multiples
               else f"{size} is outside H3's aspect ratios of 1:4 to 4:1")
    too = f"; or give the line a {preset_side} too" if preset_side else ""
    raise UsageError(f"{where}: {problem}", f"use {'x'.join(map(str, nearest_size(width, height)))}, the nearest "
                                            f"size H3 takes: sides in multiples of 32, within 1:4 to 4:1{too}")


def nearest_size(width: int, height: int) -> tuple[int, int]:
    """Each side rounded to a multiple of 32 (32 or more), the longer then cut to four times the shorter."""
    width, height = (max(32, round(side / 32) * 32) for side in (width, height))
    return min(width, 4 * height), min(height, 4 * width)


# What the largest group of GPUs a run can have holds: 8 ranks of one machine splitting a clip, at 288 GiB each (the
# largest GPUs made). A clip whose estimated peak is beyond that fails on every device, after the weights load.
MAX_CLIP_BYTES = 8 * 288 * 2**30


def check_fits(request: Request, where: str) -> None:
    from h3gen.run.memory import DiTShape, peak_bytes

    need = peak_bytes(request, DiTShape(), 0)
    if need > MAX_CLIP_BYTES:
        raise UsageError(f"{where}: size {request.width}x{request.height} at {request.frames} frames needs about "
                         f"{need / 2**40:,.1f} TiB of memory, more than any machine or group of GPUs holds",
                         "use a size near H3's 1344x768")


def _short(value, as_json: bool = False) -> str:
    """A value for an error message: one line, not too long; `as_json`: as the line wrote it (null, true, "10")."""
    text = json.dumps(value, ensure_ascii=False) if as_json else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def parse_shard(text: str) -> tuple[int, int]:
    """`I/N` with 0 <= I < N: zero-based, like `--array=0-3` in Slurm, so SLURM_ARRAY_TASK_ID fits as is."""
    index, sep, count = text.partition("/")
    if not sep or not index.strip().isdigit() or not count.strip().isdigit():
        raise UsageError(f"--shard {text!r} is not I/N", "e.g. --shard 0/4 ... --shard 3/4 for four runs")
    index, count = int(index), int(count)
    if count < 1 or index >= count:
        raise UsageError(f"--shard {text}: shard {index} of {count} does not exist",
                         (f"I counts from 0: pass 0/{count}" if count == 1 else
                          f"I counts from 0: pass 0/{count} to {count - 1}/{count}") if count else "N is at least 1")
    return index, count


def shard_requests(requests: list[Request], shard: tuple[int, int] | None) -> list[Request]:
    """Prompt number i of the file (0-based, blank and comment lines not counted) goes to shard i mod N.

    Round-robin rather than contiguous blocks: shards stay balanced, and appending prompts to the file never moves
    an existing one to another shard. Requests keep their index, so seeds and file names are those of an
    unsharded run."""
    if shard is None:
        return requests
    index, count = shard
    return [request for request in requests if request.index % count == index]
