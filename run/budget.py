"""A device memory budget and the plan that meets it: how many DiT blocks stay on the device and how many stream
from pinned host memory (h3gen.models.dit.streaming), decided before any weight loads from the repository's config.

Sizes come from the architecture: a block's linears (fused QKV, the attention output, SwiGLU's up/gate and down)
at the weights' bytes per value (1 for FP8 linears, plus a scale per output row), its norms, and its AdaLN table
(rows for every timestep of the schedule, three modalities, six modulation vectors), which stays resident. The rest
of the DiT (embedders, token refiner, output layers) is small and resident. A streamed block costs no device memory
but its share of two slots shaped like one block; activations come from the measured peak per packed row
(h3gen.run.memory).
"""

from __future__ import annotations

import dataclasses

from h3gen.errors import UsageError

GIB = 2**30
MODALITIES, MODULATIONS = 3, 6


@dataclasses.dataclass(frozen=True)
class DiTSizes:
    blocks: int
    block_bytes: int  # the streamable weights of one block
    table_bytes: int  # one block's AdaLN table: resident
    other_bytes: int  # embedders, token refiner, output layers: resident

    @classmethod
    def of(cls, config, weight_bytes: float, table_rows: int, table_bytes_per_value: int = 2) -> DiTSizes:
        """From an H3DiTConfig: `weight_bytes` per linear weight value (2 in bf16, 1 with FP8 linears)."""
        hidden, inner, ffn = config.hidden_size, config.num_attention_heads * config.attention_head_dim, config.ffn_dim
        linear_values = hidden * 3 * inner + inner * hidden + hidden * 2 * ffn + ffn * hidden
        scales = (3 * inner + hidden + 2 * ffn + hidden) * 4 if weight_bytes < 2 else 0
        block = int(linear_values * weight_bytes) + scales + 4 * hidden * 2
        table = table_rows * MODALITIES * MODULATIONS * hidden * table_bytes_per_value
        refiner = config.num_refiner_layers * (4 * hidden * hidden + 2 * hidden * ffn) * 2
        other = refiner + (config.text_dim + config.time_embed_hidden_dim + 2 * config.video_patch_dim) * hidden * 4
        return cls(config.num_layers, block, table, other)

    @property
    def resident_bytes(self) -> int:
        return self.blocks * (self.block_bytes + self.table_bytes) + self.other_bytes


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    budget_bytes: int
    blocks: int
    streamed: int  # the last `streamed` blocks live in host memory
    peak_bytes: int  # estimated device peak of the DiT's forward
    host_bytes: int  # pinned host memory the streamed blocks need

    def describe(self) -> str:
        where = ("every DiT block resident" if not self.streamed else
                 f"{self.blocks - self.streamed} of {self.blocks} DiT blocks resident, {self.streamed} streamed from "
                 f"pinned host memory ({self.host_bytes / GIB:.1f} GiB of host memory)")
        return f"memory plan for {self.budget_bytes / GIB:.1f} GiB: {where}, estimated peak {self.peak_bytes / GIB:.1f} GiB"

    def record(self) -> dict:
        return {"vram_gib": round(self.budget_bytes / GIB, 3), "streamed_blocks": self.streamed,
                "estimated_peak_gib": round(self.peak_bytes / GIB, 3), "host_gib": round(self.host_bytes / GIB, 3)}


def plan_memory(budget_bytes: int, sizes: DiTSizes, activation_bytes: int) -> MemoryPlan:
    """The fewest streamed blocks whose estimated peak fits the budget; one line naming the budget that would fit
    when none does."""
    fixed = sizes.other_bytes + sizes.blocks * sizes.table_bytes + activation_bytes
    for streamed in range(sizes.blocks + 1):
        slots = 2 * sizes.block_bytes if streamed else 0
        peak = fixed + (sizes.blocks - streamed) * sizes.block_bytes + slots
        if peak <= budget_bytes:
            return MemoryPlan(budget_bytes, sizes.blocks, streamed, peak, streamed * sizes.block_bytes)
    smallest = fixed + 2 * sizes.block_bytes
    raise UsageError(f"no plan fits the DiT in {budget_bytes / GIB:.1f} GiB: with every block streamed the largest "
                     f"clip still needs about {smallest / GIB:.1f} GiB",
                     f"give --vram {smallest / GIB:.0f} or more, an FP8 preset, or a shorter or smaller clip")


def plan_for(preset, requests, repo, device: str) -> MemoryPlan | None:
    """The plan for a run of h3gen's DiT with `runtime.vram_gib` set; None when no budget is asked for or the sampler
    cannot stream. Checked before any weight loads: a budget on a CPU run, above the device's memory, under any plan,
    or more host memory than the machine has, each stop the run with one line."""
    budget_gib = preset.runtime["vram_gib"]
    if not budget_gib:
        return None
    if not device.startswith("cuda"):
        raise UsageError(f"a device memory budget (--vram {budget_gib:g}) on a run on the CPU",
                         "drop --vram (runtime.vram_gib), or run on a GPU")
    import torch

    total = torch.cuda.get_device_properties(torch.device(device)).total_memory
    budget = int(budget_gib * GIB)
    if budget > total:
        raise UsageError(f"--vram {budget_gib:g} is more than the GPU's {total / GIB:.1f} GiB",
                         f"give at most {total / GIB:.0f}")
    name, sampler = preset.stages["sampler"]
    if name != "euler" or sampler.dit != "h3gen":
        raise UsageError("a device memory budget streams the blocks of h3gen's DiT", 'set sampler.dit = "h3gen"')
    return check_host(plan_memory(budget, dit_sizes(preset, repo), activations(preset, requests, repo)))


def dit_sizes(preset, repo) -> DiTSizes:
    import json

    from h3gen.models.dit.checkpoint import H3DiTConfig
    from h3gen.stages.sampler import forwards

    config = H3DiTConfig.from_dict(json.loads((repo.path("transformer") / "config.json").read_text()))
    quant_name, quant = preset.stages["quant"]
    fp8 = quant_name == "fp8-rowwise" and "dit" in quant.roles
    element = element_bytes(preset)
    return DiTSizes.of(config, 1 if fp8 else element, 2 * forwards(preset.stages["sampler"][1]) + 2, element)


def element_bytes(preset) -> int:
    return 4 if preset.runtime["dtype"] == "float32" else 2


def activations(preset, requests, repo) -> int:
    from h3gen.run.memory import DiTShape, peak_bytes

    shape = DiTShape.from_config(repo.path("transformer") / "config.json")
    return max(peak_bytes(request, shape, 0, element_bytes(preset)) for request in requests)


def check_host(plan: MemoryPlan) -> MemoryPlan:
    """Streamed blocks live in pinned host memory: the machine must have it free."""
    import os

    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if plan.host_bytes > available:
        raise UsageError(f"{plan.describe()}, and this machine has {available / GIB:.1f} GiB of host memory free",
                         "free host memory, give a larger --vram, or an FP8 preset (half the bytes to hold)")
    return plan
