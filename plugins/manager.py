"""The plugin manager: built-ins first, then packages of the `h3gen` entry-point group."""

from __future__ import annotations

import dataclasses
import os
import sys
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
        self.failed: list[tuple[str, str]] = []

    def stage(self, kind: str, name: str) -> type:
        found = self.stages.get((kind, name))
        if found is None:
            allowed = ", ".join(sorted(n for k, n in self.stages if k == kind)) or "none"
            raise UsageError(f"unknown {kind} stage '{name}'", f"registered {kind} stages: {allowed}")
        return found.stage


def _plugin_manager() -> pluggy.PluginManager:
    pm = pluggy.PluginManager("h3gen")
    pm.add_hookspecs(hookspecs)
    pm.register(builtin, name=BUILTIN)
    allowed = os.environ.get("H3GEN_LOAD_PLUGINS")
    names = None if allowed is None else {n.strip() for n in allowed.split(",") if n.strip()}
    from importlib.metadata import entry_points

    for ep in entry_points(group="h3gen"):
        if names is not None and ep.name not in names:
            continue
        try:
            pm.register(ep.load(), name=ep.name)
        except Exception as e:  # a broken plugin is reported and skipped, never fatal to the run
            print(f"h3gen: plugin '{ep.name}' failed to load: {e}", file=sys.stderr)
    return pm


def collect(pm: pluggy.PluginManager) -> Registry:
    registry = Registry()
    for impl in pm.hook.h3gen_register_stages.get_hookimpls():
        origin = pm.get_name(impl.plugin) or getattr(impl.plugin, "__name__", "?")

        def register(stage, origin=origin):
            registry.stages[(stage.kind, stage.name)] = Registered(stage.kind, stage.name, stage, origin)

        impl.function(register=register)
    for impl in pm.hook.h3gen_register_presets.get_hookimpls():
        impl.function(register=lambda path: registry.presets.setdefault(Path(str(path)).stem, Path(str(path))))
    return registry


@cache
def plugin_manager() -> pluggy.PluginManager:
    return _plugin_manager()


def registry() -> Registry:
    return collect(plugin_manager())
