"""Step caching: a DiT forward that reuses what the previous forward's middle blocks added, when the first blocks say
the forward would change little. A `cache` stage is a policy the sampler consults once per forward; it holds no
weights and runs no work of its own.

`residual` (the DBCache / first-block idea): every forward computes the first `first_blocks` blocks, and compares
what they added to the packed rows with what they added in the previous forward (relative L1, video and audio rows
apart, so the soundtrack is watched on its own); when both are under `threshold`, the middle blocks are skipped and
their last computed residual added instead, then the last `last_blocks` blocks run. At most `max_reuse` forwards in a
row reuse; the first `compute_first` and the last `compute_last` forwards always compute. `schedule` reuses on every
forward not listed in `steps`: a known cost, for reproducible benchmarks. `none` computes every forward.

In a Ulysses group each rank holds a slice of the rows: the sums behind the metric are added over the group before
the decision, so every rank takes the same branch.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import ClassVar

from h3gen.errors import UsageError
from h3gen.models.dit.tags import AUDIO_TAG, VIDEO_TAG
from h3gen.stages.base import Stage


class StepCache:
    """One clip's cache: what the first blocks added last time, what the middle blocks added, and the counts."""

    def __init__(self, policy, forwards: int, group=None, timer=None):
        self.policy, self.forwards, self.group, self.timer = policy, forwards, group, timer
        self.first_blocks, self.last_blocks = policy.config.first_blocks, policy.config.last_blocks
        self.step, self.streak, self.reused = -1, 0, 0
        self.head = self.middle = None
        self.seconds: dict[str, float] = {}  # "cache_check": the bookkeeping and the metric, every forward together

    def checking(self):
        """Times what the cache adds to a forward (the copies, residuals and the metric), when given a timer."""
        if self.timer is None:
            return contextlib.nullcontext()
        return self.timer.measure(self, "cache_check", report=False)

    def next_forward(self) -> None:
        self.step += 1

    def reuse(self, head_residual, token_tags) -> bool:
        """Given what the first blocks added this forward, whether to skip the middle blocks."""
        previous, self.head = self.head, head_residual
        if self.middle is None or previous is None or not self.policy.may_reuse(self):
            self.streak = 0
            return False
        wanted = self.policy.wants_reuse(self, previous, head_residual, token_tags)
        self.streak = self.streak + 1 if wanted else 0
        self.reused += wanted
        return wanted

    def keep(self, middle_residual) -> None:
        self.middle = middle_residual

    def distance(self, previous, current, token_tags) -> tuple[float, float]:
        """Relative L1 of this forward's first-block residual against the previous one, video and audio rows apart
        (summed over a Ulysses group)."""
        import torch

        sums = []
        for tag in (VIDEO_TAG, AUDIO_TAG):
            rows = (token_tags == tag).nonzero().flatten()
            before, now = previous[:, rows].float(), current[:, rows].float()
            sums += [(now - before).abs().sum(), before.abs().sum()]
        sums = torch.stack(sums)
        if self.group is not None:
            import torch.distributed as dist

            dist.all_reduce(sums, group=self.group)
        video, audio = (float(sums[i] / sums[i + 1].clamp_min(1e-12)) for i in (0, 2))
        return video, audio


@dataclasses.dataclass
class NoCacheConfig:
    pass


class NoCache(Stage):
    kind, name = "cache", "none"
    Config = NoCacheConfig
    description = "every forward computed in full"
    reuses: ClassVar[bool] = False  # whether the policy ever skips blocks (the sampler must then take a cache)

    def __init__(self, config, runtime):
        super().__init__(config, runtime)
        self.check_config(self.config)

    @classmethod
    def check_model(cls, config, repo) -> None:
        """A reusing cache needs a middle block between the first and last blocks it always computes."""
        if not cls.reuses:
            return
        blocks = repo.transformer_config().get("num_layers", 0)
        kept = config.first_blocks + config.last_blocks
        if kept >= blocks:
            raise UsageError(f"cache.first_blocks + cache.last_blocks ({kept}) leave no middle block of the DiT's "
                             f"{blocks} to reuse", f"lower them below {blocks} in the [cache] section")

    def session(self, forwards: int, group=None, timer=None) -> StepCache | None:
        """A clip's cache, or None when nothing is ever reused; `timer` (h3gen.run.timing.StageTimer) times the
        cache's own work."""
        return None


@dataclasses.dataclass
class ResidualConfig:
    threshold: float = 0.05  # relative L1 of the first blocks' residual; 0 never reuses
    first_blocks: int = 8  # computed every forward: their residual is the metric
    last_blocks: int = 0  # computed every forward after the reused middle
    max_reuse: int = 2  # forwards in a row that may reuse
    compute_first: int = 4  # the first forwards always computed
    compute_last: int = 1  # the last forwards always computed


class ResidualCache(NoCache):
    name = "residual"
    Config = ResidualConfig
    description = "the middle blocks' residual reused while the first blocks change little (video, audio apart)"
    reuses = True

    @classmethod
    def check_config(cls, config) -> None:
        if (config.first_blocks < 1 or min(config.last_blocks, config.max_reuse, config.threshold,
                                            config.compute_first, config.compute_last) < 0):
            raise UsageError(f"cache {cls.name}: first_blocks >= 1, last_blocks, max_reuse, threshold, compute_first "
                             "and compute_last >= 0", "fix the [cache] values")

    def session(self, forwards: int, group=None, timer=None) -> StepCache:
        return StepCache(self, forwards, group, timer)

    def may_reuse(self, cache: StepCache) -> bool:
        config = self.config
        return (config.compute_first <= cache.step < cache.forwards - config.compute_last
                and cache.streak < config.max_reuse)

    def wants_reuse(self, cache: StepCache, previous, current, token_tags) -> bool:
        if self.config.threshold <= 0:
            return False
        video, audio = cache.distance(previous, current, token_tags)
        return video < self.config.threshold and audio < self.config.threshold


@dataclasses.dataclass
class ScheduleConfig:
    steps: list[int] = dataclasses.field(default_factory=list)  # forwards computed in full, from 0; [] means all
    first_blocks: int = 1  # computed every forward, before the reused middle
    last_blocks: int = 0  # computed every forward after the reused middle


class ScheduleCache(NoCache):
    name = "schedule"
    Config = ScheduleConfig
    description = "the forwards listed in `steps` computed in full, the others reuse the middle blocks' residual"
    reuses = True

    @classmethod
    def check_config(cls, config) -> None:
        if config.first_blocks < 1 or config.last_blocks < 0 or any(step < 0 for step in config.steps):
            raise UsageError("cache schedule: first_blocks >= 1, last_blocks >= 0, steps counted from 0",
                             "fix the [cache] values")
        if config.steps and 0 not in config.steps:
            raise UsageError("cache schedule: steps must include 0 (the first forward has nothing to reuse)",
                             "add 0 to cache.steps")

    def session(self, forwards: int, group=None, timer=None) -> StepCache | None:
        return StepCache(self, forwards, group, timer) if self.config.steps else None

    def may_reuse(self, cache: StepCache) -> bool:
        return cache.step not in self.config.steps

    def wants_reuse(self, cache: StepCache, previous, current, token_tags) -> bool:
        return True
