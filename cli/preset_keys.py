"""The man page's PRESET KEYS, read from the code that defines them: the sections of h3gen.config.preset, the
[adapter] section, and every built-in stage's Config dataclass, each field with its type, its default and the
comment the code gives it (on its line, or above a run of fields).

A section is (title, items); an item is a paragraph (str) or a key and what it is ((term, text)).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import re
import textwrap
import tokenize
import typing

from h3gen.config.contract import AdapterConfig
from h3gen.config.preset import (DTYPES, KNOWN_VERSIONS, MODEL_DEFAULTS, MODEL_KINDS, OPTIONAL_STAGES,
                                 PARALLEL_DEFAULTS, REQUEST_DEFAULTS, RUNTIME_DEFAULTS, toml_value)
from h3gen.stages.base import BUILTIN, STAGE_KINDS, Wrapped

INTRO = (
    "A preset is a TOML file: the keys below at its top, a [request], [runtime], [parallel], [model] and [adapter] "
    f"table, and one table per stage kind ({', '.join(STAGE_KINDS)}), whose use = NAME picks the registered stage "
    "and whose other keys are that stage's. Every key has a default, so a preset names only what it changes; "
    "each stage kind needs its use, here or in the preset extended, except "
    + ", ".join(f'[{kind}] (use = "{name}")' for kind, name in OPTIONAL_STAGES.items())
    + ". A key a table does not have stops the run, naming the keys it has; so does a value of another type. "
    "--set SECTION.KEY=VALUE sets one key over the preset, VALUE read as a TOML value (a bare word is a string); "
    "--set KIND.use=NAME picks another stage, dropping the keys the preset set for the one it replaces (a stage "
    "that wraps its kind takes them for the one it wraps; one an earlier --set gave is refused, not dropped). "
    "h3gen presets show NAME prints every resolved key and where it came from; --toml prints it as a preset. "
    "Each key below reads KEY = DEFAULT, then its type. The stages are h3gen's own: h3gen plugins lists the ones "
    "plugins add, and h3gen presets show their keys.")

TOP_LEVEL = [
    (f"version = {KNOWN_VERSIONS[-1]}", "int, required (or taken from the preset extended): the preset format; "
                                        f"this h3gen reads {', '.join(map(str, KNOWN_VERSIONS))}."),
    ('description = ""', "str: the line h3gen presets list shows."),
    ('extends = "NAME|FILE"', "str: a preset (a name, or a file relative to this one's folder) whose keys this one "
                              "starts from: its tables are merged key by key; a stage table that names another "
                              "stage replaces the one it extends, unless that stage wraps its kind, when the "
                              "replaced table becomes [KIND.wraps]."),
]

SECTION_NOTES = {
    "request.width": "the clip's width in pixels, a multiple of 32; a prompts line's width overrides it.",
    "request.height": "the clip's height in pixels, a multiple of 32; a prompts line's height overrides it.",
    "request.duration": "the clip's length in seconds, 5 to 15; a prompts line's duration overrides it.",
    "runtime.device": "auto (cuda when torch sees a GPU, else cpu), cpu, cuda or cuda:N.",
    "runtime.dtype": f"the precision weights load and compute in: {', '.join(DTYPES)}.",
    "runtime.vram_gib": "a device memory budget in GiB, for a GPU run: the run keeps within it, streaming as many "
                        "of h3gen's DiT blocks from host memory as it needs; 0: none (the run plans for what is "
                        "free on the GPU as it starts).",
    "parallel.gpus": "GPU workers, as --gpus N when neither --gpus nor --cpu-workers is given; 0: none.",
    "parallel.cpu_workers": "CPU workers, as --cpu-workers N when neither flag is given; 0: none.",
    "parallel.ulysses": "ranks per clip when workers run, as --ulysses K when it is not given; 0: the layout "
                        "rule picks.",
    "model.needs": f"the model the preset is made for: {', '.join(MODEL_KINDS)}; checked from the repository's "
                   "transformer config before any weight loads (--set model.needs=any runs it anyway).",
}

ADAPTER_INTRO = (
    "Adapters (LoRA or full-rank deltas) fused into the weights when they load, by a quant stage built on "
    "h3gen.stages.quant.QuantStage. A path is absolute, or relative to the current directory, then to the model "
    "directory. The contract keys say what the adapters were distilled for; a NAME.contract.json beside "
    "NAME.safetensors (contract.json in an adapter folder) can say it too. A sampler or task outside the contract "
    "stops the run before any weight loads.")


def inline(value) -> str:
    """A default as TOML writes it, on one line."""
    if isinstance(value, list):
        return f"[{', '.join(map(inline, value))}]"
    return toml_value(value)


def sentence(note: str) -> str:
    """A source comment as the rest of a sentence after "int: ": a capitalized first word ("Tiles", "A") in lower
    case, names ("PyTorch", "Qwen3-VL", "FP8") as they are."""
    if re.match(r"[A-Z][a-z]*\b", note):
        note = note[0].lower() + note[1:]
    return note if note.endswith(".") else f"{note}."


def type_name(hint) -> str:
    if typing.get_origin(hint) is list:
        return f"list of {type_name(typing.get_args(hint)[0])}"
    return getattr(hint, "__name__", str(hint))


def field_notes(config_cls) -> dict[str, str]:
    """Each field's comment in the source: the one on its line, else the comment lines above it, which also speak
    for the fields right after it (no blank line between) that have none of their own. A subclass's field keeps its
    base's note unless it has one of its own."""
    notes = {}
    for cls in reversed(config_cls.__mro__):
        if not dataclasses.is_dataclass(cls):
            continue
        source = textwrap.dedent(inspect.getsource(cls))
        lines = source.splitlines()
        comments = {token.start[0]: token.string.lstrip("#").strip()
                    for token in tokenize.generate_tokens(io.StringIO(source).readline)
                    if token.type == tokenize.COMMENT}

        def alone(number):  # a comment line with no code
            return number in comments and lines[number - 1].lstrip().startswith("#")

        above, last = "", 0
        for node in ast.parse(source).body[0].body:
            if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
                continue
            trailing = [comments[n] for n in range(node.lineno, node.end_lineno + 1) if n in comments and not alone(n)]
            block, number = [], node.lineno - 1
            while alone(number):
                block.insert(0, comments[number])
                number -= 1
            if block:
                above = " ".join(block)
            elif number != last or trailing:  # a blank line or a note of its own ends the run
                above = ""
            note = " ".join(trailing) or above
            if note:
                notes[node.target.id] = note
            last = node.end_lineno
    return notes


def config_keys(config_cls, kind: str = "") -> list[tuple[str, str]]:
    hints, notes = typing.get_type_hints(config_cls), field_notes(config_cls)
    items = []
    for field in dataclasses.fields(config_cls):
        if hints[field.name] is Wrapped:
            items.append((f"[{kind}.wraps]", "table: the stage this one wraps, with its use and keys (by default "
                                             "the stage the table named before this one replaced it)."))
            continue
        default = field.default if field.default is not dataclasses.MISSING else field.default_factory()
        note = notes.get(field.name)
        items.append((f"{field.name} = {inline(default)}",
                      type_name(hints[field.name]) + (f": {sentence(note)}" if note else ".")))
    return items


def table_keys(section: str, defaults: dict) -> list[tuple[str, str]]:
    return [(f"{key} = {inline(value)}", f"{type(value).__name__}: {SECTION_NOTES[f'{section}.{key}']}")
            for key, value in defaults.items()]


def builtin_stages(registry, kind: str) -> list:
    return [entry for (k, _), entry in sorted(registry.stages.items()) if k == kind and entry.origin == BUILTIN]


def preset_keys(registry) -> list[tuple[str, list]]:
    sections = [("", [INTRO]), ("Top level", TOP_LEVEL)]
    for section, defaults in (("request", REQUEST_DEFAULTS), ("runtime", RUNTIME_DEFAULTS),
                              ("parallel", PARALLEL_DEFAULTS), ("model", MODEL_DEFAULTS)):
        sections.append((f"[{section}]", table_keys(section, defaults)))
    sections.append(("[adapter]", [ADAPTER_INTRO, *config_keys(AdapterConfig)]))
    for kind in STAGE_KINDS:
        for entry in builtin_stages(registry, kind):
            keys = config_keys(entry.stage.Config, kind)
            sections.append((f'[{kind}] use = "{entry.name}"',
                             [*filter(None, [entry.stage.description]), *(keys or ["No other keys."])]))
    return sections
