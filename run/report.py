"""What the run loop tells whoever watches it: the reporter protocol, and a reporter that says nothing.

The live display, the plain lines and -q's (h3gen.cli.ui, which also print the JSON records), the bench's recorder
and the events a worker sends to rank 0 (h3gen.parallel.events) all implement `Reporter`; the loop never knows which
one it talks to.
"""

from __future__ import annotations

from typing import Protocol


class Reporter(Protocol):
    def say(self, text: str) -> None:
        """One line for the user (progress, notes)."""

    def warn(self, text: str) -> None:
        """One line the user must see even in a quiet run: a warning, a clip failed or in conflict, a stop."""

    def start(self) -> Reporter:
        """The render begins: a live display starts drawing."""

    def stop(self) -> None:
        """The render is over, or stopped."""

    def clip_started(self, clip) -> None:
        """`clip` (h3gen.stages.clip.Clip) goes to the device."""

    def stage_done(self, clip, kind: str, seconds: float) -> None:
        """One stage of `clip` took `seconds`."""

    def step(self, clip, step: int, steps: int) -> None:
        """The sampler finished denoise step `step` of `steps`."""

    def clip_done(self, result) -> None:
        """`result` (h3gen.run.records.ClipResult): written, skipped or failed."""

    def summary(self, results, total: int | None = None) -> None:
        """The end of the run: every clip's result, in file order; `total` clips were asked for."""

    def ended_by(self) -> int | None:
        """A signal the run ends with though no clip was left (SIGPIPE: stdout's reader went away after the last
        clip started); None for none."""


class SilentReporter:
    """Says nothing: the launcher's own checks (its rank 0 says it all), ranks of a group other than the first, and
    the bench, which records what it needs itself."""

    def say(self, text: str) -> None:
        pass

    def warn(self, text: str) -> None:
        pass

    def start(self):
        return self

    def stop(self):
        pass

    def clip_started(self, clip):
        pass

    def stage_done(self, clip, kind, seconds):
        pass

    def step(self, clip, step, steps):
        pass

    def clip_done(self, result):
        pass

    def summary(self, results, total: int | None = None):
        pass

    def ended_by(self):
        return None
