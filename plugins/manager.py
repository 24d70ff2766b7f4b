"""The plugin manager: built-ins first, then packages of the `h3gen` entry-point group.

A plugin that fails to import, or raises while it registers, is recorded in `Registry.failed` and skipped whole:
none of its stages or presets are kept. The command reports the failures; `--strict-plugins` makes them fatal.
"""

from __future__ import annotations

import dataclasses
import os
from functools import cache
from pathlib import Path

import pluggy

from h3gen.errors import UsageError
from h3gen.plugins import builtin, hookspecs

BUILTIN = "h3gen (built-in)"


@dataclasses.dataclass(frozen=True)
class Registered:
    kind: str
    name: str
    stage: type
    origin: str


class Registry:
    def __init__(self):
        self.stages: dict[tuple[str, str], Registered] = {}
        self.presets: dict[str, Path] = {}
        self.failed: list[tuple[str, str]] = []  # (plugin, what went wrong)

    def stage(self, kind: str, name: str) -> type:
        found = self.stages.get((kind, name))
        if found is None:
            allowed = ", ".join(sorted(n for k, n in self.stages if k == kind)) or "none"
            broken = "".join(f"; plugin '{p}' {why}" for p, why in self.failed)
            raise UsageError(f"unknown {kind} stage {name!r}", f"registered {kind} stages: {allowed}{broken}")
        return found.stage


def wanted_plugins() -> set[str] | None:
    """The names in H3GEN_LOAD_PLUGINS, or None (all) when it is not set."""
    allowed = os.environ.get("H3GEN_LOAD_PLUGINS")
    return None if allowed is None else {n.strip() for n in allowed.split(",") if n.strip()}


def _plugin_manager() -> tuple[pluggy.PluginManager, list[tuple[str, str]]]:
    pm = pluggy.PluginManager("h3gen")
    pm.add_hookspecs(hookspecs)
    pm.register(builtin, name=BUILTIN)
    names, failed = wanted_plugins(), []
    from importlib.metadata import entry_points

    for ep in entry_points(group="h3gen"):
        if names is not None and ep.name not in names:
            continue
        try:
            pm.register(ep.load(), name=ep.name)
        except (Exception, SystemExit) as e:  # a broken plugin is reported and skipped, never fatal to the run
            failed.append((ep.name, f"failed to load: {_reason(e)}"))
    return pm, failed


def _reason(error: BaseException) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


def _checked(stage, origin: str):
    from h3gen.stages.base import STAGE_KINDS, Stage

    if not (isinstance(stage, type) and issubclass(stage, Stage)):
        raise TypeError(f"register() takes a Stage subclass, not {stage!r}")
    if getattr(stage, "kind", None) not in STAGE_KINDS or not isinstance(getattr(stage, "name", None), str):
        raise TypeError(f"{stage.__qualname__} needs a kind (one of {', '.join(STAGE_KINDS)}) and a name")
    return Registered(stage.kind, stage.name, stage, origin)


def collect(pm: pluggy.PluginManager, failed=()) -> Registry:
    registry = Registry()
    registry.failed.extend(failed)
    for impl in pm.hook.h3gen_register_stages.get_hookimpls():  # in registration order: built-ins first
        origin = pm.get_name(impl.plugin) or getattr(impl.plugin, "__name__", "?")
        offered = []
        try:
            impl.function(register=lambda stage: offered.append(_checked(stage, origin)))
            for entry in offered:
                taken = registry.stages.get((entry.kind, entry.name))
                if taken is not None:
                    raise ValueError(f"{entry.kind} stage '{entry.name}' is already registered by {taken.origin}")
        except Exception as e:  # skip the whole plugin: half a plugin is harder to reason about than none
            registry.failed.append((origin, f"failed during registration: {_reason(e)}"))
            continue
        registry.stages.update({(entry.kind, entry.name): entry for entry in offered})
    for impl in pm.hook.h3gen_register_presets.get_hookimpls():
        origin = pm.get_name(impl.plugin) or getattr(impl.plugin, "__name__", "?")
        offered = []
        try:
            impl.function(register=lambda path: offered.append(Path(str(path))))
        except Exception as e:
            registry.failed.append((origin, f"failed during registration: {_reason(e)}"))
            continue
        for path in offered:
            registry.presets.setdefault(path.stem, path)
    return registry


@cache
def plugin_manager() -> tuple[pluggy.PluginManager, list[tuple[str, str]]]:
    return _plugin_manager()


def registry() -> Registry:
    return collect(*plugin_manager())
