"""Versioned TOML presets: which registered stage runs each step, its knobs, and the request defaults.

Topology stays in code; a preset only picks implementations and values. Every resolved value remembers where it
came from (preset file, stage default, --set) so `h3gen presets show` can explain a configuration.
"""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path
from typing import Any

from h3gen.config.contract import AdapterConfig
from h3gen.errors import UsageError
from h3gen.stages.base import STAGE_KINDS, build_config

KNOWN_VERSIONS = (1,)
REQUEST_DEFAULTS = {"width": 1344, "height": 768, "duration": 5.0}
RUNTIME_DEFAULTS = {"device": "auto", "dtype": "bfloat16"}
# Several workers (0: one process, no torch.distributed); ulysses 0 lets the layout rule pick. Flags override.
PARALLEL_DEFAULTS = {"gpus": 0, "cpu_workers": 0, "ulysses": 0}
TOP_LEVEL = {"version", "description"}
SECTIONS = ("request", "runtime", "parallel", "adapter")  # besides one per stage kind
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


def load_toml(path: Path) -> dict:
    try:
        return tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise UsageError(f"preset {path} is not valid TOML: {e}", "fix the syntax at that line and column") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"cannot read preset {path}: {e}", "pass a readable UTF-8 TOML file") from None


def find_preset(name_or_file: str, registry) -> tuple[str, dict]:
    path = Path(name_or_file)
    if name_or_file in registry.presets:
        return name_or_file, load_toml(registry.presets[name_or_file])
    if path.suffix == ".toml" or path.exists():
        if not path.is_file():
            raise UsageError(f"preset file {path} does not exist", "pass a preset name or an existing .toml file")
        return path.stem, load_toml(path)
    raise UsageError(f"unknown preset '{name_or_file}'", f"available: {', '.join(sorted(registry.presets))}")


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
    return section, field, value


def resolve(name_or_file: str, registry, overrides: list[str] = ()) -> Preset:
    name, data = find_preset(name_or_file, registry)
    where = f"preset {name}"
    sources = {}
    for section, field, value in map(parse_override, overrides):
        if section not in STAGE_KINDS + SECTIONS:
            raise UsageError(f"--set {section}.{field}: unknown section {section!r}",
                             f"sections: {', '.join(STAGE_KINDS + SECTIONS)}")
        _table(data.setdefault(section, {}), section, where)[field] = value
        sources[f"{section}.{field}"] = "--set"
    version = data.get("version")
    if version not in KNOWN_VERSIONS:
        raise UsageError(f"{where} has version {version!r}, which this h3gen does not know",
                         f"supported versions: {', '.join(map(str, KNOWN_VERSIONS))}; upgrade h3gen or fix the preset")
    unknown = set(data) - TOP_LEVEL - set(STAGE_KINDS) - set(SECTIONS)
    if unknown:
        raise UsageError(f"{where}: unknown section '{sorted(unknown)[0]}'",
                         f"allowed: {', '.join(sorted(TOP_LEVEL | set(STAGE_KINDS) | set(SECTIONS)))}")
    request = _section(data, "request", REQUEST_DEFAULTS, where, sources)
    runtime = _section(data, "runtime", RUNTIME_DEFAULTS, where, sources)
    _check_runtime(runtime, where)
    parallel = _section(data, "parallel", PARALLEL_DEFAULTS, where, sources)
    _check_parallel(parallel, where)
    stages = {kind: _stage(kind, data, registry, where, sources) for kind in STAGE_KINDS}
    adapter = _adapter(data, stages["quant"], registry, where, sources)
    return Preset(name, version, str(data.get("description", "")), request, runtime, stages, sources, adapter,
                  parallel)


def _table(value, section: str, where: str) -> dict:
    if not isinstance(value, dict):
        raise UsageError(f"{where}: {section} must be a table, got {value!r:.40}", f"write it as [{section}]")
    return value


def _check_runtime(runtime: dict, where: str) -> None:
    device, dtype = runtime["device"], runtime["dtype"]
    if device not in ("auto", "cpu", "cuda") and not (device.startswith("cuda:") and device[5:].isdigit()):
        raise UsageError(f"{where} [runtime] device {device!r} is not one h3gen runs on",
                         "use auto, cpu, cuda or cuda:N")
    if dtype not in DTYPES:
        raise UsageError(f"{where} [runtime] dtype {dtype!r} is not supported", f"use one of {', '.join(DTYPES)}")


def _check_parallel(parallel: dict, where: str) -> None:
    for key, value in parallel.items():
        if isinstance(value, bool) or value < 0:
            raise UsageError(f"{where} [parallel] {key} must be a whole number >= 0, got {value!r}",
                             "0 leaves it to the command line")
    if parallel["gpus"] and parallel["cpu_workers"]:
        raise UsageError(f"{where} [parallel] sets both gpus and cpu_workers", "keep one of them")


def _section(data: dict, section: str, defaults: dict, where: str, sources: dict) -> dict:
    values = dict(_table(data.get(section, {}), section, where))
    for key, value in values.items():
        if key not in defaults:
            raise UsageError(f"unknown key '{key}' in {where} [{section}]", f"allowed keys: {', '.join(defaults)}")
        if not isinstance(value, type(defaults[key])) and not (isinstance(defaults[key], float) and isinstance(value, int)):
            raise UsageError(f"{where} [{section}] {key} must be {type(defaults[key]).__name__}, got {value!r}",
                             "fix the value in the preset or --set")
        sources.setdefault(f"{section}.{key}", where)
    for key, value in defaults.items():
        values.setdefault(key, value)
        sources.setdefault(f"{section}.{key}", "default")
    return values


def _stage(kind: str, data: dict, registry, where: str, sources: dict):
    section = dict(_table(data.get(kind, {}), kind, where))
    name = section.pop("use", None)
    if not isinstance(name, str):
        raise UsageError(f"{where}: [{kind}] needs use = \"<registered name>\"",
                         f"registered {kind} stages: {', '.join(sorted(n for k, n in registry.stages if k == kind))}")
    stage = registry.stage(kind, name)
    config = build_config(stage.Config, section, f"{where} [{kind}]")
    sources.setdefault(f"{kind}.use", where)
    for field in dataclasses.fields(config):
        sources.setdefault(f"{kind}.{field.name}", where if field.name in section else f"default of {kind} '{name}'")
    return name, config


def _adapter(data: dict, quant: tuple[str, Any], registry, where: str, sources: dict) -> AdapterConfig:
    """The [adapter] section. Adapters are fused by the quant stage in its load-time pass, so it gets them too."""
    from h3gen.stages.quant import QuantStage

    section = dict(_table(data.get("adapter", {}), "adapter", where))
    adapter = build_config(AdapterConfig, dict(section), f"{where} [adapter]")
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
    rows = [("version", preset.version, f"preset {preset.name}")]
    rows += [(f"request.{k}", v, preset.sources[f"request.{k}"]) for k, v in preset.request.items()]
    rows += [(f"runtime.{k}", v, preset.sources[f"runtime.{k}"]) for k, v in preset.runtime.items()]
    rows += [(f"parallel.{k}", v, preset.sources[f"parallel.{k}"]) for k, v in preset.parallel.items()]
    for kind, (name, config) in preset.stages.items():
        rows.append((f"{kind}.use", name, preset.sources[f"{kind}.use"]))
        rows += [(f"{kind}.{f.name}", getattr(config, f.name), preset.sources[f"{kind}.{f.name}"])
                 for f in dataclasses.fields(config)]
    rows += [(f"adapter.{f.name}", getattr(preset.adapter, f.name), preset.sources[f"adapter.{f.name}"])
             for f in dataclasses.fields(preset.adapter)]
    return rows
