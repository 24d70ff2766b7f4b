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

from h3gen.stages.base import BUILTIN


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
        self.preset_origins: dict[str, str] = {}
        self.failed: list[tuple[str, str]] = []  # (plugin, what went wrong)
        self.left_out: list[str] = []  # installed plugins H3GEN_LOAD_PLUGINS leaves out

    def stage(self, kind: str, name: str) -> type:
        found = self.stages.get((kind, name))
        if found is None:
            allowed = ", ".join(sorted(n for k, n in self.stages if k == kind)) or "none"
            raise UsageError(f"unknown {kind} stage {name!r}", f"registered {kind} stages: {allowed}{self.missing()}")
        return found.stage

    def missing(self) -> str:
        """Where a stage or preset not found may have gone: plugins that failed, and plugins H3GEN_LOAD_PLUGINS
        leaves out ('' when neither)."""
        broken = "".join(f"; plugin '{p}' {why}" for p, why in self.failed)
        left_out = (f"; H3GEN_LOAD_PLUGINS={os.environ.get('H3GEN_LOAD_PLUGINS', '')} leaves out the installed "
                    f"plugin(s) {', '.join(map(repr, sorted(self.left_out)))}, which may register it"
                    if self.left_out else "")
        return broken + left_out


NO_PLUGINS = "none"  # H3GEN_LOAD_PLUGINS=none: h3gen's own stages and presets alone


def wanted_plugins() -> set[str] | None:
    """The names in H3GEN_LOAD_PLUGINS (an empty set for `none`), or None (all) when it is not set or names none
    (set but empty)."""
    names = {n.strip() for n in os.environ.get("H3GEN_LOAD_PLUGINS", "").split(",") if n.strip()}
    return set() if names == {NO_PLUGINS} else names or None


NOT_INSTALLED = "is named in H3GEN_LOAD_PLUGINS, and no such plugin is installed"


def _plugin_manager() -> tuple[pluggy.PluginManager, list[tuple[str, str]], list[str]]:
    pm = pluggy.PluginManager("h3gen")
    pm.add_hookspecs(hookspecs)
    pm.register(builtin, name=BUILTIN)
    names, failed, left_out = wanted_plugins(), [], []
    from importlib.metadata import entry_points

    installed = entry_points(group="h3gen")
    for name in sorted((names or set()) - {ep.name for ep in installed}):
        failed.append((name, f"{NOT_INSTALLED} (installed: "
                             f"{', '.join(sorted(ep.name for ep in installed)) or 'none'})"))
    for ep in installed:
        if names is not None and ep.name not in names:
            left_out.append(ep.name)
            continue
        try:
            pm.register(ep.load(), name=ep.name)
        except (Exception, SystemExit) as e:  # a broken plugin is reported and skipped, never fatal to the run
            failed.append((ep.name, f"failed to load: {type(e).__name__}: {_reason(e)}"))
    return pm, failed, left_out


def package_of(plugin: str) -> str | None:
    """The installed package that declares the entry point `plugin` (what pip uninstalls), if one does."""
    from importlib.metadata import entry_points

    found = next((ep for ep in entry_points(group="h3gen") if ep.name == plugin), None)
    return found.dist.name if found is not None and found.dist is not None else None


class Refused(Exception):
    """What a plugin registered breaks h3gen's contract: the message says what, without the exception's type."""


def _reason(error: BaseException) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


def _checked(stage, origin: str):
    from h3gen.config.stage_config import config_problem
    from h3gen.stages.base import STAGE_KINDS, Stage
    from h3gen.stages.clip import PIPELINE
    from h3gen.stages.quant import QuantStage

    if not (isinstance(stage, type) and issubclass(stage, Stage)):
        raise Refused(f"register() takes a Stage subclass, not {stage!r}")
    name = getattr(stage, "name", None)
    if getattr(stage, "kind", None) not in STAGE_KINDS or not isinstance(name, str) or not name.strip() \
            or name != name.strip():
        raise Refused(f"{stage.__qualname__} needs a kind (one of {', '.join(STAGE_KINDS)}) and a name (a word, "
                      "as `use = \"name\"` names it)")
    if stage.kind in PIPELINE and stage.run is Stage.run:  # the kinds a clip passes through
        raise Refused(f"{stage.kind} stage '{stage.name}' has no run(clip)")
    if stage.kind == "quant" and not issubclass(stage, QuantStage):  # the loaders call its transform
        raise Refused(f"quant stage '{stage.name}' is not built on h3gen.stages.quant.QuantStage (subclass it and "
                      "implement quantize)")
    problem = config_problem(stage.Config)
    if problem:
        raise Refused(f"{stage.kind} stage '{stage.name}': {problem}")
    return Registered(stage.kind, stage.name, stage, origin)


def _offers(pm: pluggy.PluginManager) -> dict[str, dict]:
    """Per plugin, in registration order (built-ins first), the hook functions it implements."""
    offers: dict[str, dict] = {}
    for hook in ("h3gen_register_stages", "h3gen_register_presets"):
        for impl in getattr(pm.hook, hook).get_hookimpls():
            origin = pm.get_name(impl.plugin) or getattr(impl.plugin, "__name__", "?")
            offers.setdefault(origin, {})[hook] = impl.function
    order = [name for name, _ in pm.list_name_plugin()]
    return dict(sorted(offers.items(), key=lambda item: order.index(item[0]) if item[0] in order else len(order)))


def collect(pm: pluggy.PluginManager, failed=(), left_out=()) -> Registry:
    """Every plugin's stages and presets, or none of them: half a plugin is harder to reason about than none."""
    registry = Registry()
    registry.failed.extend(failed)
    registry.left_out.extend(left_out)
    for origin, hooks in _offers(pm).items():
        stages, presets = [], []
        try:
            if "h3gen_register_stages" in hooks:
                hooks["h3gen_register_stages"](register=lambda stage: stages.append(_checked(stage, origin)))
            if "h3gen_register_presets" in hooks:
                hooks["h3gen_register_presets"](register=lambda path: presets.append(Path(str(path))))
            for entry in stages:
                taken = registry.stages.get((entry.kind, entry.name))
                if taken is not None:
                    raise Refused(f"{entry.kind} stage '{entry.name}' is already registered by {taken.origin}")
            for path in presets:
                if not path.is_file():
                    raise Refused(f"registered preset {path} is not a file (a preset in a package ships as its "
                                  "package data: list it under [tool.setuptools.package-data] in pyproject.toml)")
                if path.stem in registry.presets:
                    raise Refused(f"preset '{path.stem}' is already registered by "
                                  f"{registry.preset_origins[path.stem]}")
        except Exception as e:
            why = _reason(e) if isinstance(e, Refused) else f"{type(e).__name__}: {_reason(e)}"
            registry.failed.append((origin, f"failed during registration: {why}"))
            continue
        for entry in stages:
            entry.stage.origin = origin
            registry.stages[(entry.kind, entry.name)] = entry
        for path in presets:
            registry.presets[path.stem], registry.preset_origins[path.stem] = path, origin
    return registry


@cache
def plugin_manager() -> tuple[pluggy.PluginManager, list[tuple[str, str]], list[str]]:
    return _plugin_manager()


def registry() -> Registry:
    return collect(*plugin_manager())
