"""How N workers split the work: G groups of k ranks, each group rendering its own clips, one clip across k ranks.

k ranks of a group run one clip with Ulysses sequence parallelism: each rank holds the whole DiT and 1/k of the
attention heads between two all-to-alls, so k has to divide the head count (56 for MiniMax-H3). A group never
spans two machines (k divides the workers per node): its all-to-alls want NVLink, not the network.
"""

from __future__ import annotations

import dataclasses

from h3gen.errors import UsageError


@dataclasses.dataclass(frozen=True)
class Layout:
    groups: int
    ulysses: int  # ranks per group: the Ulysses degree; 1 is plain data parallelism

    @property
    def world(self) -> int:
        return self.groups * self.ulysses

    def group_of(self, rank: int) -> int:
        return rank // self.ulysses

    def ranks_of(self, group: int) -> list[int]:
        return list(range(group * self.ulysses, (group + 1) * self.ulysses))

    def describe(self, worker: str, clips: int) -> str:
        """The layout in words, for a run of `clips` clips to render: groups past them load nothing and stay idle."""
        busy = min(self.groups, clips) if clips else self.groups
        idle = f", {self.groups - busy} group(s) idle with no clip to render" if busy < self.groups else ""
        if self.ulysses == 1:
            return f"{self.groups} group(s) x 1 {worker}: data parallel, {busy} clip(s) at a time{idle}"
        return (f"{self.groups} group(s) x {self.ulysses} {worker}s: Ulysses {self.ulysses} within a group, "
                f"{busy} clip(s) at a time{idle}")


def ulysses_degrees(per_node: int, heads: int) -> list[int]:
    """The degrees a group can take: divisors of the workers per node that also divide the head count."""
    return [k for k in range(1, per_node + 1) if per_node % k == 0 and heads % k == 0]


def choose_layout(world: int, per_node: int, prompts: int, heads: int, ulysses: int = 0) -> Layout:
    """The default: as many data-parallel groups as there are clips to keep them busy, and the spare ranks of a
    short batch put to Ulysses. Whole clips in parallel scale better than one clip split k ways (the all-to-alls
    cost time), so a group only grows when fewer clips than groups would leave ranks idle."""
    if ulysses:
        return Layout(world // ulysses, ulysses)
    degrees = ulysses_degrees(per_node, heads)
    fitting = [k for k in degrees if world // k <= max(prompts, 1)]
    k = fitting[0] if fitting else degrees[-1]
    return Layout(world // k, k)


def check_ulysses(ulysses: int, per_node: int, heads: int, said: str, workers_said: str) -> None:
    """An impossible layout stops the run before any worker starts. `said` and `workers_said` name the settings as
    the user gave them ('--ulysses 3', '--cpu-workers 4')."""
    if ulysses < 1:
        raise UsageError(f"{said}: a group has at least one rank", "ask for 1 or more")
    if per_node % ulysses:
        raise UsageError(f"{said} does not divide {workers_said}",
                         f"pick one of {', '.join(str(k) for k in range(1, per_node + 1) if per_node % k == 0)}")
    if heads % ulysses:
        raise UsageError(f"{said} does not divide the DiT's {heads} attention heads",
                         f"pick one of {', '.join(map(str, ulysses_degrees(per_node, heads)))}")
