"""Versioned TOML presets: which registered stage runs each step, its knobs, and the request defaults.

Topology stays in code; a preset only picks implementations and values. Every resolved value remembers where it
came from (preset file, stage default, --set) so `h3gen presets show` can explain a configuration.

A preset can build on another (`extends = "h3-base"`, a name or a file): it then says only what changes. Where it,
or `--set`, names another stage for a kind, the keys set for the stage it replaces are dropped; a wrapping stage
(h3gen.stages.base.Wrapper) takes them as the stage it wraps instead.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
from pathlib import Path
from typing import Any

from h3gen.config.contract import AdapterConfig
from h3gen.errors import H3genError, UsageError
from h3gen.config.stage_config import build_config, shown, type_fix
from h3gen.stages.base import STAGE_KINDS

KNOWN_VERSIONS = (1,)
REQUEST_DEFAULTS = {"width": 1344, "height": 768, "duration": 5.0}
# vram_gib: the device memory budget (0: what is free when the run starts), met by h3gen.run.budget's plan.
RUNTIME_DEFAULTS = {"device": "auto", "dtype": "bfloat16", "vram_gib": 0.0}
# Several workers (0: one process, no torch.distributed); ulysses 0 lets the layout rule pick. Flags override.
PARALLEL_DEFAULTS = {"gpus": 0, "cpu_workers": 0, "ulysses": 0}
TOP_LEVEL = {"version", "description"}
# The model a preset is made for: "tiny" (the embedded smoke-test model), "MiniMax-H3" (a real repository) or "any".
MODEL_DEFAULTS = {"needs": "any"}
MODEL_KINDS = ("tiny", "MiniMax-H3", "any")
SECTIONS = ("request", "runtime", "parallel", "adapter", "model")  # besides one per stage kind
DTYPES = ("bfloat16", "float16", "float32")


@dataclasses.dataclass
class Preset:
    name: str
    version: int
    description: str
    request: dict[str, Any]
    runtime: dict[str, Any]
    stages: dict[str, tuple[str, Any]]  # kind -> (registered name, config)
    sources: dict[str, str]
    adapter: AdapterConfig = dataclasses.field(default_factory=AdapterConfig)
    parallel: dict[str, int] = dataclasses.field(default_factory=lambda: dict(PARALLEL_DEFAULTS))
    model: dict[str, str] = dataclasses.field(default_factory=lambda: dict(MODEL_DEFAULTS))


def load_toml(path: Path) -> dict:
    try:
        return tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise UsageError(f"preset {path} is not valid TOML: {e}", "fix the syntax at that line and column") from None
    except RecursionError:
        raise UsageError(f"preset {path} nests its values too deeply to read", "write each key's value as a "
                         "number, a string or a list of them") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"cannot read preset {path}: {e}", "pass a readable UTF-8 TOML file") from None


def find_preset(name_or_file: str, registry, folder: Path | None = None) -> tuple[str, Path]:
    """The preset's name and file: a registered name, or a file (relative to `folder`, the extending preset's)."""
    path = Path(name_or_file)
    if name_or_file in registry.presets:
        return name_or_file, Path(registry.presets[name_or_file])
    if folder is not None and not path.is_absolute():
        path = folder / path
    if path.suffix == ".toml" or path.exists():
        if path.is_dir():
            raise UsageError(f"preset {path} is a directory", "pass a preset name or a .toml file")
        if not path.is_file():
            raise UsageError(f"preset file {path} does not exist", "pass a preset name or an existing .toml file")
        return path.stem, path
    if not registry.presets:
        raise UsageError(f"unknown preset '{name_or_file}': no presets are registered",
                         "`h3gen plugins` says why the plugin that ships them failed")
    beside = (folder or Path()) / f"{name_or_file}.toml"
    if beside.is_file():
        raise UsageError(f"unknown preset '{name_or_file}'", f"for the file, pass {beside}")
    raise UsageError(f"unknown preset '{name_or_file}'",
                     f"available: {', '.join(sorted(registry.presets))}{registry.missing()}")


def preset_label(name: str, path: Path, registry) -> str:
    """How errors and `presets show` name a preset: a registered one by its name, a file by its path (as given, or
    from the folder of the preset that extends it), so the user finds the file to fix."""
    registered = registry.presets.get(name)
    return f"preset {name}" if registered is not None and Path(registered) == path else f"preset {path}"


def load_preset(name_or_file: str, registry, folder: Path | None = None,
                chain: tuple = ()) -> tuple[str, dict, dict]:
    """The preset's tables, with the presets it extends merged under them, and where each key came from
    ({"vae.wraps.use": "preset tiny"})."""
    name, path = find_preset(name_or_file, registry, folder)
    label = preset_label(name, path, registry)
    seen = [resolved for resolved, _ in chain]
    if path.resolve() in seen:  # the cycle from its first preset, each named as errors name it
        cycle = [said for _, said in chain[seen.index(path.resolve()):]] + [label]
        what = "extends itself" if len(cycle) == 2 else "is in a cycle of extends"
        raise UsageError(f"{label} {what} ({' -> '.join(said.removeprefix('preset ') for said in cycle)})",
                         "remove the cycle of extends")
    data = load_toml(path)
    base = data.pop("extends", None)
    if base is None:
        return name, data, dict.fromkeys(key_paths(data), label)
    if not isinstance(base, str):
        raise UsageError(f"{label}: extends must be a preset name or file, got {base!r:.40}",
                         'e.g. extends = "h3-base"')
    try:
        find_preset(base, registry, path.parent)
    except UsageError as e:  # said with the file that names it: the user's command line may not show it
        raise UsageError(f"{path}: extends = {base!r}: {e.problem}", e.fix) from None
    _, merged, origins = load_preset(base, registry, path.parent, chain + ((path.resolve(), label),))
    for key, value in data.items():
        if key in STAGE_KINDS and isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = replace_stage(merged[key], value, key, registry, origins, label)
        else:
            if key in SECTIONS and isinstance(value, dict) and isinstance(merged.get(key), dict):
                value = {**merged[key], **value}
            merged[key] = value
            origins.update(dict.fromkeys(key_paths({key: data[key]}), label))
    return name, merged, origins


def key_paths(tables: dict, prefix: str = "") -> list[str]:
    """"section.key" for every value in nested tables (a wrapped stage's keys as "vae.wraps.key")."""
    paths = []
    for key, value in tables.items():
        paths += key_paths(value, f"{prefix}{key}.") if isinstance(value, dict) else [f"{prefix}{key}"]
    return paths


def replace_stage(old: dict, new: dict, kind: str, registry, origins: dict, source: str) -> dict:
    """A stage section over another: the same stage takes the new keys over the old; another stage drops them,
    unless it wraps its kind, when the old section becomes the stage it wraps. `origins` follows the keys."""
    name = new.get("use")
    if name is None or name == old.get("use"):
        section = {**old, **new}
    else:
        section = dict(new)
        moved = {path: origins.pop(path) for path in [p for p in origins if p.startswith(f"{kind}.")]}
        if "wraps" not in section and is_wrapper(registry, kind, name):
            section["wraps"] = old
            origins.update({f"{kind}.wraps.{path[len(kind) + 1:]}": where for path, where in moved.items()})
        else:  # the keys go with the stage; one the user gave on the command line must not vanish without a word
            dropped = [path for path, where in moved.items() if where == "--set" and not path.endswith(".use")]
            found = registry.stages.get((kind, name)) if isinstance(name, str) else None
            if dropped and found is not None:  # an unknown stage is refused as such, later
                value = old
                for part in dropped[0].split(".")[1:]:
                    value = value.get(part) if isinstance(value, dict) else None
                takes = stage_takes(found.stage, dropped[0].split(".")[1])
                raise UsageError(f"--set {dropped[0]}={toml_value(value)} is for the {kind} stage {old.get('use')!r}, "
                                 f"which the later --set {kind}.use={name} replaces",
                                 f"give --set {kind}.use={name} before it" if takes else
                                 f"drop it: {name!r} takes no key {dropped[0].split('.')[1]!r}")
    origins.update(dict.fromkeys(key_paths({kind: new}), source))
    return section


def stage_takes(stage, key: str) -> bool:
    """Whether the stage class has the config key `key` (True where its Config is not a dataclass to tell)."""
    import dataclasses

    config = getattr(stage, "Config", None)
    return not dataclasses.is_dataclass(config) or key in {field.name for field in dataclasses.fields(config)}


def is_wrapper(registry, kind: str, name) -> bool:
    from h3gen.stages.base import Wrapper

    found = registry.stages.get((kind, name)) if isinstance(name, str) else None
    return found is not None and issubclass(found.stage, Wrapper)


def parse_override(text: str) -> tuple[str, str, Any]:
    """`section.key=value`, the value read as a TOML value (bare words stay strings)."""
    key, sep, raw = text.partition("=")
    section, dot, field = key.strip().partition(".")
    if not sep or not dot or not field:
        raise UsageError(f"--set {text!r} is not section.key=value", "e.g. --set sampler.steps=8")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    except RecursionError:
        raise UsageError(f"--set {key.strip()}: its value nests too deeply to read",
                         "give a number, a string or a list of them") from None
    return section, field, value


def resolve(name_or_file: str, registry, overrides: list[str] = ()) -> Preset:
    """The preset by name or file, its `extends` chain merged and `--set` overrides applied, with its keys and their
    types checked; the stages' own value checks (`check_stage_configs`) come later, where the run is prepared."""
    name, data, sources = load_preset(name_or_file, registry)
    where = preset_label(name, find_preset(name_or_file, registry)[1], registry)
    for section, field, value in map(parse_override, overrides):
        if section not in STAGE_KINDS + SECTIONS:
            raise UsageError(f"--set {section}.{field}: unknown section {section!r}",
                             f"sections: {', '.join(STAGE_KINDS + SECTIONS)}")
        table = _table(data.setdefault(section, {}), section, where)
        if field == "use" and section in STAGE_KINDS:
            data[section] = replace_stage(table, {"use": value}, section, registry, sources, "--set")
        else:
            *parents, last = field.split(".")  # wraps.tile_batch: a key of the wrapped stage
            for parent in parents:
                table = _table(table.setdefault(parent, {}), f"{section}.{parent}", where)
            table[last] = value
            sources[f"{section}.{field}"] = "--set"
    version = data.get("version")
    if version is None:
        raise UsageError(f"{where} has no version", f"add version = {KNOWN_VERSIONS[-1]} at its top")
    if not isinstance(version, int) or isinstance(version, bool):
        raise UsageError(f"{origin_of(sources, 'version', where)} has version {version!r}, which is not a whole number",
                         f"write version = {KNOWN_VERSIONS[-1]}, without quotes")
    if version not in KNOWN_VERSIONS:
        raise UsageError(f"{where} has version {version!r}, which this h3gen does not know",
                         f"supported versions: {', '.join(map(str, KNOWN_VERSIONS))}; upgrade h3gen or fix the preset")
    unknown = set(data) - TOP_LEVEL - set(STAGE_KINDS) - set(SECTIONS)
    if unknown:
        first = sorted(unknown)[0]
        what = "section" if isinstance(data[first], dict) else "top-level key"
        raise UsageError(f"{origin_of(sources, first, where)}: unknown {what} '{first}'",
                         f"allowed: {', '.join(sorted(TOP_LEVEL | {'extends'}))} and the sections "
                         f"{', '.join(sorted(set(STAGE_KINDS) | set(SECTIONS)))}")
    if not isinstance(data.get("description", ""), str):
        raise UsageError(f"{origin_of(sources, 'description', where)}: description is "
                         f"{type(data['description']).__name__}, not text",
                         'write it in quotes, e.g. description = "FP8 linears for 24 GB cards"')
    request = _section(data, "request", REQUEST_DEFAULTS, where, sources)
    _check_request(request, sources)
    runtime = _section(data, "runtime", RUNTIME_DEFAULTS, where, sources)
    _check_runtime(runtime, sources)
    parallel = _section(data, "parallel", PARALLEL_DEFAULTS, where, sources)
    _check_parallel(parallel, where, sources)
    model = _section(data, "model", MODEL_DEFAULTS, where, sources)
    if model["needs"] not in MODEL_KINDS:
        raise UsageError(f"{_given('model', 'needs', model['needs'], sources)} is not a model kind",
                         f"use one of {', '.join(MODEL_KINDS)}")
    stages = {kind: _stage(kind, data, registry, where, sources) for kind in STAGE_KINDS}
    _check_steps_used(stages["sampler"][1], sources)
    adapter = _adapter(data, stages["quant"], registry, where, sources)
    return Preset(name, version, str(data.get("description", "")), request, runtime, stages, sources, adapter,
                  parallel, model)


def _table(value, section: str, where: str) -> dict:
    if not isinstance(value, dict):
        raise UsageError(f"{where}: {section} must be a table, got {value!r:.40}", f"write it as [{section}]")
    return value


def _check_request(request: dict, sources: dict) -> None:
    """The defaults a prompt takes, checked as a prompt's own values are, and blamed on where they were set."""
    from h3gen.inputs.prompts import check_clip

    def origin(*keys: str) -> str:
        return ", ".join(_given("request", key, request[key], sources, with_value=False) for key in keys)

    check_clip(request["duration"], request["width"], request["height"], origin("duration"), origin("width", "height"))


def _check_steps_used(sampler, sources: dict) -> None:
    """A --set sampler.steps that the grid would not follow: explicit sigma positions set the forwards."""
    positions = getattr(sampler, "sigma_positions", None)
    if positions and sources.get("sampler.steps") == "--set" and sampler.steps != len(positions):
        raise UsageError(f"--set sampler.steps={sampler.steps} would change nothing: "
                         f"{_given('sampler', 'sigma_positions', positions, sources, with_value=False)} sets the "
                         f"grid's {len(positions)} points", "add --set 'sampler.sigma_positions=[]' for a grid of "
                         f"{sampler.steps} evenly spaced points, or leave out --set sampler.steps")


def _given(section: str, key: str, value, sources: dict, with_value: bool = True) -> str:
    """A section's value as an error names it: the --set that gave it, or the key in the preset that set it (an
    extended one's name where the value came from there), with the value unless the error says it itself."""
    source = sources[f"{section}.{key}"]
    if source == "--set":
        return f"--set {section}.{key}={value:g}" if isinstance(value, float) else f"--set {section}.{key}={value}"
    return f"{source} [{section}] {key}" + (f" {value!r}" if with_value else "")


def _check_runtime(runtime: dict, sources: dict) -> None:
    device, dtype = runtime["device"], runtime["dtype"]
    if not 0 <= runtime["vram_gib"] < float("inf"):  # NaN fails this too
        raise UsageError(f"{_given('runtime', 'vram_gib', runtime['vram_gib'], sources)} is no budget",
                         "give GiB above 0, or 0 for what is free")
    if device not in ("auto", "cpu", "cuda") and not (device.startswith("cuda:") and device[5:].isdigit()):
        raise UsageError(f"{_given('runtime', 'device', device, sources)} is not a device h3gen runs on",
                         "use auto, cpu, cuda or cuda:N")
    if dtype not in DTYPES:
        raise UsageError(f"{_given('runtime', 'dtype', dtype, sources)} is not a supported dtype",
                         f"use one of {', '.join(DTYPES)}")


def _check_parallel(parallel: dict, where: str, sources: dict) -> None:
    for key, value in parallel.items():
        if isinstance(value, bool) or value < 0:
            raise UsageError(f"{_given('parallel', key, value, sources)}: give a whole number >= 0",
                             "0 leaves it to the command line")
    if parallel["gpus"] and parallel["cpu_workers"]:
        raise UsageError(f"{where} [parallel] sets both gpus and cpu_workers", "keep one of them")


def _section(data: dict, section: str, defaults: dict, where: str, sources: dict) -> dict:
    values = dict(_table(data.get(section, {}), section, origin_of(sources, section, where)))
    for key, value in values.items():
        given = sources.get(f"{section}.{key}") == "--set"
        held = origin_of(sources, f"{section}.{key}", where)  # the preset that has the key, an extended one too
        if key not in defaults:
            raise UsageError(f"--set {section}.{key}: unknown key '{key}' in {where} [{section}]" if given
                             else f"unknown key '{key}' in {held} [{section}]", f"allowed keys: {', '.join(defaults)}")
        kind = type(defaults[key])
        label = f"--set {section}.{key}" if given else f"{held} [{section}] {key}"
        fix = "fix the value after the =" if given else "fix the value in the preset or --set"
        widened = kind is float and isinstance(value, int)  # 5 where 5.0 is meant
        if isinstance(value, bool) is not (kind is bool) or not isinstance(value, kind) and not widened:
            raise UsageError(f"{label} must be {kind.__name__}, got {shown(value)}", type_fix(kind, fix, value))
        if isinstance(value, float) and math.isnan(value):
            raise UsageError(f"{label} is nan, which is no number", fix)
        sources.setdefault(f"{section}.{key}", where)
    for key, value in defaults.items():
        values.setdefault(key, value)
        sources.setdefault(f"{section}.{key}", "default")
    return values


# Kinds a preset may leave out, and the stage they then use.
OPTIONAL_STAGES = {"cache": "none"}


def set_key(sources: dict, name: str) -> str:
    """The --set that gave `name` ("vae.tile_batch"), or one under it ("vae.wraps.use" for "vae.wraps"); '' when none
    did."""
    return next((k for k, source in sources.items() if source == "--set" and (k == name or k.startswith(f"{name}."))),
                "")


def _origins(section: dict, key: str, sources: dict, where: str) -> tuple[dict, dict]:
    """For `build_config`: the keys of section `key` a --set gave (as set_as), and the section holding each."""
    set_as = {k: set_key(sources, f"{key}.{k}") for k in section if set_key(sources, f"{key}.{k}")}
    return set_as, {k: f"{origin_of(sources, f'{key}.{k}', where)} [{key}]" for k in section}


def origin_of(sources: dict, name: str, where: str) -> str:
    """The preset that holds `name` ("sampler.steps", or a section: any key under it), as errors name presets: an
    extended preset where the key came from there; `where` (the preset asked for) otherwise."""
    found = sources.get(name) or next((source for k, source in sources.items() if k.startswith(f"{name}.")), "")
    return found if found.startswith("preset ") else where


def _stage(kind: str, data: dict, registry, where: str, sources: dict, key: str = ""):
    """(name, config) of the stage `data[kind]` names; `key` is the section's place ("vae", "vae.wraps")."""
    key = key or kind
    section = dict(_table(data.get(kind, {}), key, origin_of(sources, key, where)))
    if "use" not in section and kind in OPTIONAL_STAGES and key == kind:
        section["use"] = OPTIONAL_STAGES[kind]
        sources.setdefault(f"{key}.use", "default")
    name = section.pop("use", None)
    if not isinstance(name, str):
        raise UsageError(f"{where}: [{key}] needs use = \"<registered name>\"",
                         f"registered {kind} stages: {', '.join(sorted(n for k, n in registry.stages if k == kind))}")
    try:
        stage = registry.stage(kind, name)
    except UsageError as e:  # said where the name came from, as the section's other values are
        given = f"--set {key}.use={name}" if sources.get(f"{key}.use") == "--set" else f"{where} [{key}]"
        raise UsageError(f"{given}: {e.problem}", e.fix) from None
    wrapping = is_wrapper(registry, kind, name)
    wraps = section.pop("wraps", None) if wrapping else None
    if isinstance(wraps, dict):  # a key of the wrapped stage set on the wrapper: said so (any other: build_config)
        inner = registry.stages.get((kind, wraps.get("use"))) if isinstance(wraps.get("use"), str) else None
        for misplaced in (k for k in section if inner and stage_takes(inner.stage, k) and not stage_takes(stage, k)):
            given = set_key(sources, f"{key}.{misplaced}")
            problem = (f"--set {given}: unknown key '{misplaced}' for {kind} stage '{name}', which" if given else
                       f"unknown key '{misplaced}' in {origin_of(sources, f'{key}.{misplaced}', where)} [{key}]: "
                       f"{kind} stage '{name}'")
            raise UsageError(f"{problem} wraps '{wraps['use']}', which takes it",
                             f"set it under [{key}.wraps], or --set {key}.wraps.{misplaced}=...")
    config = build_config(stage.Config, section, f"{where} [{key}]", *_origins(section, key, sources, where),
                          stage=f"{kind} stage '{name}'")
    if wrapping:
        from h3gen.stages.base import Wrapped

        if wraps is None:
            given = f"--set {key}.use={name}" if sources.get(f"{key}.use") == "--set" else where
            over = f", or set it over a preset that has a {kind} stage" if key == kind else ""
            raise UsageError(f"{given}: {kind} stage '{name}' wraps another {kind} stage, and none is named",
                             f"name it: [{key}.wraps] use = \"...\" in a preset, --set {key}.wraps.use=... on the "
                             f"command line{over}")
        inner = _stage(kind, {kind: wraps}, registry, where, sources, f"{key}.wraps")
        config.wraps = Wrapped(inner[0], registry.stage(kind, inner[0]), inner[1])
    sources.setdefault(f"{key}.use", where)
    for field in dataclasses.fields(config):
        if not (wrapping and field.name == "wraps"):
            sources.setdefault(f"{key}.{field.name}",
                               where if field.name in section else f"default of {kind} '{name}'")
    return name, config


def _adapter(data: dict, quant: tuple[str, Any], registry, where: str, sources: dict) -> AdapterConfig:
    """The [adapter] section. Adapters are fused by the quant stage in its load-time pass, so it gets them too."""
    from h3gen.stages.quant import QuantStage

    section = dict(_table(data.get("adapter", {}), "adapter", origin_of(sources, "adapter", where)))
    adapter = build_config(AdapterConfig, dict(section), f"{where} [adapter]",
                           *_origins(section, "adapter", sources, where))
    for field in dataclasses.fields(adapter):
        sources.setdefault(f"adapter.{field.name}", where if field.name in section else "default")
    name, config = quant
    if adapter.paths and not issubclass(registry.stage("quant", name), QuantStage):
        raise UsageError(f"{where}: quant stage '{name}' cannot fuse the [adapter] paths",
                         "pick a quant stage built on h3gen.stages.quant.QuantStage")
    config.adapter = adapter
    return adapter


def describe(preset: Preset) -> list[tuple[str, Any, str]]:
    """Every resolved value as (key, value, where it came from), for `h3gen presets show`."""
    rows = [("version", preset.version, preset.sources.get("version", f"preset {preset.name}"))]
    rows += [(f"request.{k}", v, preset.sources[f"request.{k}"]) for k, v in preset.request.items()]
    rows += [(f"runtime.{k}", v, preset.sources[f"runtime.{k}"]) for k, v in preset.runtime.items()]
    rows += [(f"parallel.{k}", v, preset.sources[f"parallel.{k}"]) for k, v in preset.parallel.items()]
    rows += [(f"model.{k}", v, preset.sources[f"model.{k}"]) for k, v in preset.model.items()]
    for kind, (name, config) in preset.stages.items():
        rows += _stage_rows(kind, name, config, preset.sources)
    rows += [(f"adapter.{f.name}", getattr(preset.adapter, f.name), preset.sources[f"adapter.{f.name}"])
             for f in dataclasses.fields(preset.adapter)]
    return rows


def _stage_rows(key: str, name: str, config, sources: dict) -> list[tuple[str, Any, str]]:
    rows = [(f"{key}.use", name, sources[f"{key}.use"])]
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if field.name == "wraps" and value.stage is not None:
            rows += _stage_rows(f"{key}.wraps", value.name, value.config, sources)
        else:
            rows.append((f"{key}.{field.name}", value, sources[f"{key}.{field.name}"]))
    return rows


def toml_value(value) -> str:
    """`value` as TOML writes it (true, "text", [1, 2]), a list on one line however long: what `presets show`
    prints, so a line can be copied."""
    import tomli_w

    if isinstance(value, (list, tuple)):
        return f"[{', '.join(map(toml_value, value))}]"
    return tomli_w.dumps({"v": value})[4:].strip()


def as_toml(preset: Preset) -> str:
    """The resolved preset as TOML that resolves back to the same values: a start for a new preset."""
    import tomli_w

    tables: dict[str, Any] = {"version": preset.version, "description": preset.description}
    for key, value, _ in describe(preset)[1:]:
        *parents, last = key.split(".")
        table = tables
        for parent in parents:
            table = table.setdefault(parent, {})
        table[last] = value
    return tomli_w.dumps(tables)


def check_stage_configs(preset, registry, repo=None, device: str = "") -> None:
    """Each stage's own check of its section (`Stage.check_config`), with `repo` of the model (`check_model`), with
    `device` of the device the run picked (`check_device`, in the preset's dtype); a refusal that names a key of the
    section says where the value came from, a --set or a preset (not a stage's default); a check that raises
    anything else is the stage's failure, named."""
    from h3gen.stages.base import raised, wrapped_chain

    for kind, (name, config) in preset.stages.items():
        chain = wrapped_chain(registry.stage(kind, name), config)  # a wrapper's checks, then the wrapped stage's
        for depth, (stage, stage_config) in enumerate(chain):
            try:
                stage.check_config(stage_config)
                if repo is not None:
                    stage.check_model(stage_config, repo)
                if device:
                    stage.check_device(stage_config, device, preset.runtime["dtype"])
            except UsageError as e:
                blamed = _blamed(preset, kind, e, kind + ".wraps" * depth)
                if blamed is e:
                    raise
                raise blamed from e
            except H3genError:
                raise
            except Exception as e:
                raise stage.failed(f"raised {raised(e)} while checking its settings", stage.broke_fix(e)) from e


def _blamed(preset, kind: str, error: UsageError, section: str = "") -> UsageError:
    """`error` prefixed with where the first key of the section it names came from, when a --set or a preset gave it;
    for an error that names no key, where the section's values were set, each place once. A wrapped stage names its
    keys as its own (`mux.crf`): they are set in its `section` (`mux.wraps.crf`)."""
    import re

    section = section or kind
    named = [section + k[len(kind):] for k in re.findall(rf"\b{kind}\.[a-z0-9_.]*[a-z0-9_]",
                                                          f"{error.problem} {error.fix}")]
    named = [k for k in named if k in preset.sources]
    # The first key it names; a check of several keys together names none: where the section's values were set.
    keys = named[:1] or [k for k in preset.sources if k.startswith(f"{kind}.") and not k.endswith(".use")]
    given = dict.fromkeys(f"--set {k}" if preset.sources[k] == "--set" else f"{preset.sources[k]} [{kind}]"
                          for k in keys if preset.sources[k] == "--set" or preset.sources[k].startswith("preset "))
    if not given:
        return error
    return UsageError(f"{', '.join(given)}: {error.problem}", error.fix)

