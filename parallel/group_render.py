"""One rank of a group of k > 1 ranks that render each clip together.

Every rank loads every stage, then each stage spreads itself over the group (`Stage.parallelize`). All ranks then
take the same clips through encode, sampler and vae; the group's first rank alone claims, checks the disk, muxes
and writes (MP4, latents, manifest) and reports. Whether a clip is rendered at all is the first rank's decision,
sent to the others before the clip starts, so the ranks never disagree about which collectives come next.
"""

from __future__ import annotations

from h3gen.errors import ClipError, H3genError
from h3gen.run.render import Renderer, check_latents, clip_error
from h3gen.stages.base import ReturnedRefused, StageFailed
from h3gen.stages.clip import CLIP_DEVICE_STAGES, DEVICE_STAGES

GO, PASS = 0, 1  # the first rank's word on a clip: render it, or leave it (busy, skipped, failed)


class GroupRenderer(Renderer):
    def __init__(self, preset, registry, repo, reporter, group, leader: int, memory_plan=None):
        import torch.distributed as dist

        super().__init__(preset, registry, repo, reporter, memory_plan)
        self.group, self.leader = group, leader
        self.leads = dist.get_rank() == leader
        for kind in DEVICE_STAGES:
            self.stages[kind].parallelize(group)

    def admit(self, clip, redo):
        import torch
        import torch.distributed as dist

        status, claim, error = "", None, ""
        if self.leads:
            status, claim, error = super().admit(clip, redo)
            if claim is not None:
                try:  # here rather than in render_one: the others must hear of it before the sampler starts
                    super().room_for(clip)
                except ClipError as e:
                    claim.release()
                    claim, error = None, str(e)
        # A CPU tensor: gloo carries it on a CPU run, and the cpu:gloo half of the backend on a GPU run.
        word = torch.tensor([PASS if status or error else GO])
        dist.broadcast(word, src=self.leader, group=self.group)
        if self.leads:
            return status, claim, error
        return ("", None, "") if int(word) == GO else ("followed", None, "")

    def room_for(self, clip) -> None:
        """Checked in `admit`, where every rank of the group hears the outcome before the sampler starts."""

    def render_one(self, clip, claim) -> None:
        if self.leads:
            return super().render_one(clip, claim)
        try:
            for kind in CLIP_DEVICE_STAGES:
                clip = self.stages[kind](clip)
                if kind == "sampler":  # the latents every rank holds alike: refused here as on the first rank
                    check_latents(clip, self.stages[kind])
        except Exception as e:  # the first rank meets the same error and reports the clip; this rank only lent a share
            self.check_fatal(clip, e)
        clip.drop_tensors()

    def finish(self, clip, error: str = "", status: str = "", claim=None):
        """The first rank alone writes the manifest line and reports the clip; the others only let go of it."""
        if self.leads:
            return super().finish(clip, error, status, claim)
        clip.drop_tensors()
        return None

    def check_fatal(self, clip, error: Exception) -> None:
        """An input error meets every rank alike, as does a stage's return its contract refuses once every rank ran
        it (ReturnedRefused), and the group moves on to the next clip together. Anything else (out of memory on one
        GPU, a lost peer) may have struck this rank alone, while the others wait in a collective for it: the run
        ends here, torchrun stops the other ranks and names this one's error."""
        import torch.distributed as dist

        in_step = isinstance(error, ReturnedRefused) or not isinstance(error, StageFailed)
        if isinstance(error, H3genError) and in_step:
            return
        raise GroupError(f"rank {dist.get_rank()} failed on {clip.path.name}: {clip_error(clip, error)}",
                         "its group cannot go on without it; run the same command again to render the rest")


class GroupError(H3genError):
    exit_code = 1
