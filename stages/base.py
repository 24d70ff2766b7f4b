"""What every stage shares: a small validated config, loading from a repository, timing around `run`.

`Stage.__call__` is never overridden: it times `run` for the live display, so every implementation, built-in or
from a plugin, is measured the same way.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, ClassVar

from h3gen.errors import UsageError

STAGE_KINDS = ("encode", "sampler", "vae", "quant", "mux")


@dataclasses.dataclass
class NoConfig:
    pass


def build_config(config_cls: type, values: dict[str, Any], where: str):
    """Make a config dataclass from preset values: unknown keys and wrong types are errors listing what is allowed."""
    fields = {f.name: f for f in dataclasses.fields(config_cls)}
    hints = typing.get_type_hints(config_cls)
    for key, value in values.items():
        if key not in fields:
            allowed = ", ".join(sorted(fields)) or "none"
            raise UsageError(f"unknown key '{key}' in {where}", f"allowed keys: {allowed}")
        values[key] = _coerce(value, hints[key], f"{where}.{key}")
    return config_cls(**values)


def _coerce(value, hint, where: str):
    origin = typing.get_origin(hint) or hint
    if origin is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise UsageError(f"{where} must be a list, got {value!r}", "write it as [a, b, ...]")
        (item,) = set(typing.get_args(hint)[:1]) or {object}
        return origin(_coerce(v, item, where) for v in value)
    if origin is object or isinstance(value, origin) and not (origin is int and isinstance(value, bool)):
        return value
    raise UsageError(f"{where} must be {getattr(origin, '__name__', origin)}, got {value!r}",
                     "fix the value in the preset or --set")


class Stage:
    """One step of the pipeline. Subclasses set `kind`, `name`, `Config` and implement `run`."""

    kind: ClassVar[str]
    name: ClassVar[str]
    Config: ClassVar[type] = NoConfig
    description: ClassVar[str] = ""
    on_host: ClassVar[bool] = False  # timed by the host clock: work that never touches the device
    # What the stage can do, declared by its class and read by the run loop and the launcher, never probed. The
    # defaults are the in-line, one-rank behaviour, so a stage that declares nothing works in every run.
    splits_clip: ClassVar[bool] = False  # sampler: renders one clip across a group of ranks after `parallelize`
    hands_over_frames: ClassVar[bool] = False  # vae: fills `clip.arriving` chunk by chunk for a mux started with it
    background: ClassVar[bool] = False  # mux: `submit(clip)` muxes on a thread, `discard_in_flight()` stops it

    @classmethod
    def refuses_split(cls, config) -> str:
        """Why this stage, with `config`, cannot render one clip across a group of ranks; '' when it can."""
        return "" if cls.splits_clip else f"the {cls.kind} stage '{cls.name}' renders a clip on one rank"

    def __init__(self, config, runtime):
        self.config, self.runtime = config, runtime

    def load(self, repo) -> None:
        """Load weights from a `ModelRepo`; stages without weights keep this no-op."""

    def load_note(self) -> str:
        """What the stage chose as it loaded, for the run's "loaded" line (the sampler: its attention backend)."""
        return ""

    def __call__(self, clip, report: bool = True):
        with self.runtime.timer.measure(clip, self.kind, report=report, host=self.on_host):
            return self.run(clip)

    def run(self, clip):
        raise NotImplementedError

    def submit(self, clip):
        """A background mux (`background = True`): start muxing `clip` and return a Future of it, or None to be
        called in line after the decode."""
        return None

    def discard_in_flight(self) -> None:
        """A background mux: stop the writes in flight now (a signal ends the run), leaving no partial file."""

    def parallelize(self, group) -> None:
        """Spread this stage over `group`, a torch.distributed process group of two or more ranks that render one
        clip together. Called once after `load` on every rank of the group; afterwards every rank calls the stage
        with the same clip, and each must come out with the state the next stage reads on that rank. The default
        leaves every rank doing the whole work (replicated), which is always correct and right for cheap stages."""

    def unload(self) -> None:
        """Drop weights so the memory can serve another stage."""
