"""Adapters a preset fuses into the DiT, and the sampling contract each one was distilled for.

A few-step student (FastH3, turbo LoRAs) only works at the step count, sigma positions, shifts and tasks it was
trained for; anything else renders garbage after minutes of loading. So the contract is checked here, before any
weight loads, from two places: the preset's `[adapter]` keys and an optional JSON file beside the adapter weights
(`NAME.contract.json` beside `NAME.safetensors`, or `contract.json` inside an adapter folder).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

from h3gen.errors import UsageError

CONTRACT_KEYS = ("forwards", "sigma_positions", "video_shift", "audio_shift", "tasks")
TASKS = ("t2va", "fl2va", "ref2va")
TASK_FIELDS = {"t2va": "text alone", "fl2va": "first_frame / last_frame", "ref2va": "references"}  # what makes each
# What a fusable adapter file may hold, by key ending: LoRA factors, their alpha, full-rank weight and bias deltas.
KEY_KINDS = (".lora_A.weight", ".lora_B.weight", ".alpha", ".diff", ".diff_b")


@dataclasses.dataclass
class AdapterConfig:
    """The preset's [adapter] section. Zero or empty contract values mean 'no requirement'."""

    paths: list[str] = dataclasses.field(default_factory=list)  # .safetensors files or PEFT adapter folders
    scale: float = 1.0  # multiplies every adapter's delta (LoRA and full-rank alike)
    scales: list[float] = dataclasses.field(default_factory=list)  # one per path, times `scale`; empty: all 1
    forwards: int = 0  # the DiT forwards the adapters were distilled for (contract; 0: any)
    sigma_positions: list[float] = dataclasses.field(default_factory=list)  # their sigma grid (contract; empty: any)
    video_shift: float = 0.0  # their video shift (contract; 0: any)
    audio_shift: float = 0.0  # their audio shift (contract; 0: any)
    tasks: list[str] = dataclasses.field(default_factory=list)  # the tasks they render (contract; empty: any)
    cache: bool = False  # the adapter allows a step cache (h3gen.stages.cache) to reuse some of its forwards

    def __post_init__(self):
        unknown = [t for t in self.tasks if t not in TASKS]
        if unknown:
            raise UsageError(f"unknown task '{unknown[0]}' in tasks", f"tasks are {', '.join(TASKS)}")
        if self.scales and len(self.scales) != len(self.paths):
            raise UsageError(f"{len(self.scales)} scales for {len(self.paths)} paths",
                             "give one scale per path, or none")
        for key, value in [("scale", self.scale)] + [("scales", v) for v in self.scales]:
            if not math.isfinite(value):
                raise UsageError(f"{key} {value} is not a finite number", "give the adapters' multiplier: 1 as "
                                 "distilled, 0 leaves them out")
        if self.forwards < 0:
            raise UsageError(f"forwards {self.forwards} is below 0",
                             "give the DiT forwards the adapters were distilled for, or 0 for any")
        for key in ("video_shift", "audio_shift"):
            if not 0 <= getattr(self, key) < math.inf:
                raise UsageError(f"{key} {getattr(self, key)} is not a sigma shift",
                                 "give the shift the adapters were distilled for (above 0), or 0 for any")

    def scale_of(self, index: int) -> float:
        return self.scale * (self.scales[index] if self.scales else 1.0)


@dataclasses.dataclass
class AdapterFile:
    name: str  # as the preset wrote it
    weights: Path
    peft_config: Path | None  # adapter_config.json of a PEFT folder: alpha and rank patterns
    contract: Path | None


def find_adapter(name: str, model_root) -> AdapterFile:
    """An adapter path: absolute, or relative to the current directory, then to the model directory."""
    path = Path(name).expanduser()
    candidates = [path] if path.is_absolute() else [Path.cwd() / path] + (
        [Path(model_root) / path] if model_root is not None else [])
    found = next((c for c in candidates if c.exists()), None)
    if found is None:
        raise UsageError(f"adapter {name} not found (looked in {', '.join(str(c.parent) for c in candidates)})",
                         "download the adapter there, or point --set adapter.paths=[...] at it")
    if found.is_dir():
        weights = sorted(found.glob("*.safetensors"))
        if len(weights) != 1:
            raise UsageError(f"adapter folder {found} holds {len(weights)} .safetensors files, not one",
                             "point adapter.paths at the weights file itself")
        peft = found / "adapter_config.json"
        contract = found / "contract.json"
        return AdapterFile(name, weights[0], peft if peft.is_file() else None,
                           contract if contract.is_file() else None)
    if found.suffix != ".safetensors":
        raise UsageError(f"adapter {found} is not a .safetensors file", "h3gen fuses safetensors adapters only")
    contract = found.with_name(f"{found.stem}.contract.json")
    return AdapterFile(name, found, None, contract if contract.is_file() else None)


def safetensors_keys(path: Path) -> list[str]:
    """The tensor names of an adapter file, checked whole as a checkpoint file is (cut short, not safetensors)."""
    from h3gen.models.repo import safetensors_header

    try:
        header = safetensors_header(path)
    except ValueError as e:
        raise UsageError(f"adapter {path} is not a readable safetensors file ({e})", "re-download it, or export it "
                         "again") from None
    except OSError as e:
        raise UsageError(f"adapter {path} cannot be read ({e.strerror or e})", "check its permissions") from None
    return [key for key in header if key != "__metadata__"]


def check_peft_config(adapter: AdapterFile) -> None:
    """A PEFT folder's adapter_config.json holds the scaling the fused delta takes: read before any weight loads."""
    path = adapter.peft_config
    if path is None:
        return
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise UsageError(f"cannot read {path} ({str(e).splitlines()[0]})", "fix it, or export the adapter "
                         "again") from None
    patterns = config.get("alpha_pattern", {}) if isinstance(config, dict) else None
    number = (int, float)
    if not isinstance(config, dict) or not isinstance(patterns, dict) or not all(
            isinstance(v, number) and not isinstance(v, bool) for v in [config.get("lora_alpha", 1),
                                                                      *patterns.values()]):
        raise UsageError(f"{path} is not a PEFT adapter config h3gen can read (a JSON object whose lora_alpha and "
                         "alpha_pattern values are numbers)", "fix it, or export the adapter again")
    for pattern in patterns:
        try:
            re.compile(pattern)
        except re.error as e:
            raise UsageError(f"{path}: alpha_pattern key {pattern!r} is not a regular expression ({e})",
                             "fix it, or export the adapter again") from None
    if config.get("use_dora"):
        raise UsageError(f"{path}: DoRA adapters cannot be fused as a weight delta", "use a plain LoRA adapter")


def classify_key(key: str) -> tuple[str, str] | None:
    """An adapter key as (module name, kind), kind one of lora_A, lora_B, alpha, diff, diff_b; None if not fusable.
    PEFT's raw state dicts name LoRA factors `X.lora_A.<adapter name>.weight`."""
    parts = key.split(".")
    if len(parts) >= 3 and parts[-3] in ("lora_A", "lora_B") and parts[-1] == "weight":
        return ".".join(parts[:-3]), parts[-3]
    if len(parts) >= 2 and parts[-2] in ("lora_A", "lora_B") and parts[-1] == "weight":
        return ".".join(parts[:-2]), parts[-2]
    if len(parts) >= 2 and parts[-1] in ("alpha", "diff", "diff_b"):
        return ".".join(parts[:-1]), parts[-1]
    return None


def check_key_kinds(adapter: AdapterFile) -> None:
    for key in safetensors_keys(adapter.weights):
        if classify_key(key) is None:
            raise UsageError(f"adapter {adapter.weights} has tensor '{key}' of a kind h3gen cannot fuse",
                             f"fusable keys end in {', '.join(KEY_KINDS)}")


def read_contract(adapter: AdapterFile) -> dict:
    if adapter.contract is None:
        return {}
    try:
        contract = json.loads(adapter.contract.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise UsageError(f"cannot read adapter contract {adapter.contract} ({e})", "fix or remove the file") from None
    if not isinstance(contract, dict):
        raise UsageError(f"adapter contract {adapter.contract} is not a JSON object", 'e.g. {"forwards": 4}')
    unknown = set(contract) - set(CONTRACT_KEYS)
    if unknown:
        raise UsageError(f"adapter contract {adapter.contract}: unknown key '{sorted(unknown)[0]}'",
                         f"allowed keys: {', '.join(CONTRACT_KEYS)}")
    from h3gen.config.stage_config import build_config

    checked = build_config(AdapterConfig, dict(contract), f"adapter contract {adapter.contract}")  # types, tasks
    return {key: getattr(checked, key) for key in contract}


def required(config: AdapterConfig, adapters: list[AdapterFile]) -> dict:
    """One contract from the preset's keys and every adapter's contract file; a disagreement is an error."""
    contract = {key: getattr(config, key) for key in CONTRACT_KEYS if getattr(config, key)}
    origin = dict.fromkeys(contract, "the preset's [adapter] section")
    for adapter in adapters:
        for key, value in read_contract(adapter).items():
            if key in contract and not _same(contract[key], value):
                raise UsageError(f"adapter contract {adapter.contract} says {key} = {value!r}, but "
                                 f"{origin[key]} says {contract[key]!r}", "make them agree")
            contract.setdefault(key, value)
            origin.setdefault(key, str(adapter.contract))
    return contract


def _same(a, b) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=0, abs_tol=1e-6)
    return a == b


def sampler_asks(sampler) -> dict:
    """What a sampler config will run, in contract terms (a knob the sampler does not have is left out)."""
    from h3gen.stages.sampler import forwards

    positions = list(getattr(sampler, "sigma_positions", None) or [])
    steps = getattr(sampler, "steps", None)
    if not positions and steps is not None and steps >= 2:  # steps evenly spaced points of linspace(1, 0)
        positions = [1 - index / (steps - 1) for index in range(steps)]
    asks = {}
    if positions or steps is not None:
        asks["forwards"] = forwards(sampler)
    if positions:
        asks["sigma_positions"] = positions
    for key in ("video_shift", "audio_shift"):
        if hasattr(sampler, key):
            asks[key] = getattr(sampler, key)
    return asks


def describe(contract: dict, asked: bool = False) -> str:
    """A contract in words: '4 DiT forwards, sigma positions 0.999, ..., video shift 12, audio shift 3, t2va only';
    `asked`: what a run asks for instead ('... task fl2va')."""
    words = {"forwards": lambda v: f"{v} DiT forwards",
             "sigma_positions": lambda v: f"sigma positions {', '.join(f'{s:g}' for s in v)} before the shift",
             "video_shift": lambda v: f"video shift {v:g}",
             "audio_shift": lambda v: f"audio shift {v:g}",
             "tasks": lambda v: f"task {', '.join(v)}" if asked else f"{' or '.join(v)} only"}
    return ", ".join(words[key](contract[key]) for key in CONTRACT_KEYS if key in contract)


def check_cache(preset, registry) -> None:
    """A step cache needs a sampler that takes one, and an adapter's consent: a few-step student was distilled to
    give its result in exactly its forwards, and reusing one of them is outside what it was trained for."""
    cache_name, cache_config = preset.stages["cache"]
    if not registry.stage("cache", cache_name).reuses:
        return
    sampler_name, sampler_config = preset.stages["sampler"]
    refusal = registry.stage("sampler", sampler_name).refuses_cache(sampler_config)
    if refusal:
        given = (f"--set cache.use={cache_name}" if preset.sources.get("cache.use") == "--set"
                 else f"preset {preset.name}: cache '{cache_name}'")
        raise UsageError(f"{given}: {refusal}", "set cache.use=none")
    check_cache_steps(preset, cache_config, sampler_config)
    if preset.adapter.paths and not preset.adapter.cache:
        raise UsageError(f"preset {preset.name}: cache '{cache_name}' with adapters {', '.join(preset.adapter.paths)}, "
                         "whose contract does not allow a step cache",
                         "set cache.use=none, or adapter.cache=true if the adapter was trained to take one")


def check_cache_steps(preset, cache_config, sampler_config) -> None:
    """A schedule's forwards computed in full are forwards of the run: one past its last would never come."""
    from h3gen.stages.sampler import forwards

    steps = getattr(cache_config, "steps", None)
    if not steps or not hasattr(sampler_config, "steps"):
        return
    total = forwards(sampler_config)
    if max(steps) >= total:
        raise UsageError(f"preset {preset.name}: cache.steps lists forward {max(steps)}, and the run has {total} "
                         f"forwards (0 to {total - 1})", f"list forwards below {total}, or raise sampler.steps")


def check_adapters(preset, requests, model_root, prompts: Path | str = "prompts file") -> list[AdapterFile]:
    """Find the preset's adapters and check the run against their contract; raises UsageError saying what the
    adapter requires, at the prompts file's first line of a task it does not render. Reads file headers and small
    JSON files only."""
    config = preset.adapter
    adapters = [find_adapter(name, model_root) for name in config.paths]
    for adapter in adapters:
        check_key_kinds(adapter)
        check_peft_config(adapter)
    contract = required(config, adapters)
    if not adapters or not contract:
        return adapters
    asks = sampler_asks(preset.stages["sampler"][1])
    wrong = {key: asks[key] for key in ("forwards", "sigma_positions", "video_shift", "audio_shift")
             if key in contract and key in asks and not _same(contract[key], asks[key])}
    if wrong:
        raise UsageError(f"adapter {', '.join(config.paths)} requires {describe(contract)}; "
                         f"this run asks for {describe(wrong, asked=True)}",
                         "set the sampler to what the adapter requires, or drop the --set that changed it "
                         f"(h3gen presets show {preset.name} lists both)")
    off = [r for r in requests if "tasks" in contract and getattr(r, "task", "t2va") not in contract["tasks"]]
    if off:  # the prompts file asks for it, not the sampler: name the line
        first, more = off[0], f" (and {len(off) - 1} more line(s))" if len(off) > 1 else ""
        given = TASK_FIELDS[first.task]
        fields = " or ".join(TASK_FIELDS[task] for task in sorted({r.task for r in off} - {"t2va"}))
        raise UsageError(f"{prompts}:{first.line}: a {first.task} clip ({given}){more}, and preset {preset.name}'s "
                         f"adapter {', '.join(config.paths)} renders {describe(dict(tasks=contract['tasks']))}",
                         "render those lines with a preset without adapters (h3-base)"
                         + (f", or drop their {fields}" if fields else ""))
    return adapters
