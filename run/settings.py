"""A run's settings, as the command line gave them: one frozen value the loop, the launcher and its workers share."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class Parallel:
    """Workers asked for: GPU or CPU ones, ranks per clip, and the machines of a multi-node run."""

    gpus: int | None = None
    cpu_workers: int | None = None
    ulysses: int | None = None
    nnodes: int | None = None
    node_rank: int | None = None
    rdzv_endpoint: str | None = None
    rdzv_id: str | None = None
    # How errors name gpus, cpu_workers or ulysses when a flag did not give it: "preset p's [parallel] gpus = ".
    named: dict = dataclasses.field(default_factory=dict)

    def said(self, key: str) -> str:
        """A worker setting and its value as the user gave it: '--gpus 2', '--set parallel.gpus=2' or the preset's."""
        return self.named.get(key, f"--{key.replace('_', '-')} ") + str(getattr(self, key))

    @property
    def workers(self) -> int:
        """Workers per machine; 0 keeps the run in this process."""
        return self.gpus or self.cpu_workers or 0


@dataclasses.dataclass(frozen=True)
class RunSettings:
    prompts: Path
    output: Path
    preset: str = "tiny"  # a name or a TOML file
    model: Path | None = None  # None: the embedded tiny model
    seed: int = 0
    overrides: tuple[str, ...] = ()  # --set section.key=value, in order
    json_out: bool = False
    save_latents: bool = False
    force: bool = False
    strict_plugins: bool = False
    shard: tuple[int, int] | None = None  # (i, n): the prompts at places i modulo n
    parallel: Parallel = Parallel()
    dry_run: bool = False  # say what would be rendered, skipped or in conflict, and render nothing
    redo_conflicts: bool = False  # render again the clips h3gen stamped with other settings
    quiet: bool = False  # say only what needs someone: warnings, the counts and the clips failed or in conflict, a stop

    @property
    def redo(self) -> str:
        """Which clips already there render again: "all" (--force), "conflicts" (--redo-conflicts) or none ("")."""
        return "all" if self.force else "conflicts" if self.redo_conflicts else ""

    def to_json(self) -> dict:
        """What the launcher hands its workers: the paths as the user gave them and the directory they are relative
        to (`cwd`), so a worker reports them as given, as a one-process run does."""
        return {**dataclasses.asdict(self), "prompts": str(self.prompts), "output": str(self.output),
                "model": str(self.model) if self.model else None, "cwd": os.getcwd()}

    @classmethod
    def from_json(cls, data: dict) -> RunSettings:
        """The settings of `to_json`; the caller works in `data["cwd"]` (h3gen.parallel.worker does)."""
        data = {k: v for k, v in data.items() if k != "cwd"}
        return cls(**{**data, "prompts": Path(data["prompts"]), "output": Path(data["output"]),
                      "model": Path(data["model"]) if data["model"] else None,
                      "overrides": tuple(data["overrides"]), "shard": tuple(data["shard"]) if data["shard"] else None,
                      "parallel": Parallel(**data["parallel"])})
