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
import math
from pathlib import Path

from h3gen.errors import UsageError
from h3gen.run.memory import GIB
ENCODER_ACTIVATIONS = GIB  # what a prompt's encoding needs beyond the weights: hidden states of ~1k tokens
# The allocator holds more than the live tensors (blocks split between differently sized requests): the estimated
# peak must fit this much under the budget, where the cap refuses what the allocator reserves beyond it.
ALLOCATOR_SLACK = 0.03
FFN_CHUNK_ROWS = 16384  # the passes a plan gives the feed-forward, as measured for CHUNKED_FFN_VALUES_PER_ROW_PER_FFN
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
    host_bytes: int  # host memory the streamed blocks (pinned) and a streamed text encoder need
    asked: bool = True  # the budget was given (--vram, runtime.vram_gib), not the free memory found at the start
    asked_bytes: int = 0  # the budget given, where the GPU had less free: the plan is for what it had (asked False)
    stream_encoder: bool = False  # the text encoder's layers stream too: it does not fit beside the resident DiT
    ffn_chunk_rows: int = 0  # the feed-forward in passes of this many rows: with every block streamed it still fits

    def describe(self) -> str:
        where = ("every DiT block resident" if not self.streamed else
                 f"{self.blocks - self.streamed} of {self.blocks} DiT blocks resident, {self.streamed} streamed from "
                 "pinned host memory")
        budget = f"{self.budget_bytes / GIB:.1f} GiB" + (
            f" ({self.asked_bytes / GIB:g} GiB asked: what is free on the GPU)" if self.asked_bytes else
            "" if self.asked else " (free on the GPU)")
        encoder = ", the text encoder streamed layer by layer" if self.stream_encoder else ""
        chunks = f", the feed-forward in {self.ffn_chunk_rows}-row passes" if self.ffn_chunk_rows else ""
        host = f", {self.host_bytes / GIB:.1f} GiB of host memory" if self.host_bytes else ""
        return (f"memory plan for {budget}: {where}{encoder}{chunks}, estimated peak {self.peak_bytes / GIB:.1f} GiB"
                f"{host}")

    def record(self) -> dict:
        return {"vram_gib": round(self.budget_bytes / GIB, 3), "asked": self.asked,
                "asked_gib": round(self.asked_bytes / GIB, 3) or None, "streamed_blocks": self.streamed,
                "stream_encoder": self.stream_encoder, "ffn_chunk_rows": self.ffn_chunk_rows,
                "estimated_peak_gib": round(self.peak_bytes / GIB, 3), "host_gib": round(self.host_bytes / GIB, 3)}


def plan_memory(budget_bytes: int, sizes: DiTSizes, activation_bytes: int, other_bytes: int = 0,
                asked: bool = True, encoder_bytes: int = 0, streamed_at_least: int = 0, fp8: bool = False) -> MemoryPlan:
    """The fewest streamed blocks, `streamed_at_least` or more (what the preset asks), whose estimated peak fits the
    budget (`other_bytes`: what stays resident beside the DiT, the decoders' weights); one line naming the budget
    that would fit when none does. The text encoder runs beside the resident DiT before its activations exist: it
    streams when its `encoder_bytes` (and a margin for its own activations) exceed what the DiT leaves."""
    fixed = sizes.other_bytes + sizes.blocks * sizes.table_bytes + activation_bytes + other_bytes
    usable = budget_bytes * (1 - ALLOCATOR_SLACK)
    for streamed in range(min(streamed_at_least, sizes.blocks), sizes.blocks + 1):
        slots = 2 * sizes.block_bytes if streamed else 0
        peak = fixed + (sizes.blocks - streamed) * sizes.block_bytes + slots
        if peak <= usable:
            beside_encoder = budget_bytes - (peak - activation_bytes)
            return MemoryPlan(budget_bytes, sizes.blocks, streamed, peak, streamed * sizes.block_bytes, asked,
                              stream_encoder=encoder_bytes + ENCODER_ACTIVATIONS > beside_encoder)
    smallest = (fixed + 2 * sizes.block_bytes) / (1 - ALLOCATOR_SLACK)
    given = budget_named(budget_bytes / GIB) if asked else f"the {budget_bytes / GIB:.1f} GiB free on the GPU"
    raise UsageError(f"no plan fits the DiT in {given}: with every block streamed the largest clip still needs about "
                     f"{smallest / GIB:.1f} GiB",
                     f"give --vram {math.ceil(smallest / GIB)} or more on a GPU that has it"
                     f"{'' if fp8 else ', an FP8 preset'}, or a shorter or smaller clip")


def plan_for(preset, requests, repo, device: str) -> MemoryPlan | None:
    """The plan for a run of h3gen's DiT on a GPU: within `runtime.vram_gib` (--vram), or, without one, within what
    is free on the device as the run starts; None on the CPU without a budget, or for a DiT that cannot stream
    without one. Checked before any weight loads: a budget on a CPU run, above the device's memory, under any plan,
    or more host memory than the machine has, each stop the run with one line."""
    budget_gib = preset.runtime["vram_gib"]
    check_budget(budget_gib, device)
    if not device.startswith("cuda"):
        return None
    name, sampler = preset.stages["sampler"]
    streams = name == "euler" and sampler.dit == "h3gen"
    if not streams:
        if budget_gib:
            raise UsageError("a device memory budget streams the blocks of h3gen's DiT", 'set sampler.dit = "h3gen"')
        return None
    from h3gen.run.memory import free_bytes, free_on_device

    # A budget is at most what the GPU has free: a card's size (--vram 24 on a 24 GB card) is more than it has once
    # the driver and the CUDA context hold their share.
    asked = int(budget_gib * GIB)
    budget = min(asked, free_on_device(device)) if budget_gib else free_bytes(device)
    config = repo.transformer_config()
    encoder_host, encoder_device = encoder_bytes(preset, repo)
    sizes, decoders = dit_sizes(preset, config), decoder_bytes(preset, repo)
    whole, chunked = (activations(preset, requests, config, rows) for rows in (False, True))

    def plan_at(budget_bytes: int) -> MemoryPlan:
        def plan_with(activation_bytes: int) -> MemoryPlan:
            return plan_memory(budget_bytes, sizes, activation_bytes, decoders, asked=0 < asked <= budget_bytes,
                               encoder_bytes=encoder_device, streamed_at_least=sampler.stream_blocks,
                               fp8=fp8_linears(preset))

        try:
            plan = plan_with(whole)
        except UsageError:
            if sampler.ffn_chunk_rows:
                raise
            # Streaming costs next to nothing and chunking a little, so the feed-forward passes over row chunks
            # only where streaming every block is not enough; the error then names what the chunked run needs.
            plan = dataclasses.replace(plan_with(chunked), ffn_chunk_rows=FFN_CHUNK_ROWS)
        if plan.stream_encoder:  # it loads in host memory at the checkpoint's precision, then streams from there
            plan = dataclasses.replace(plan, host_bytes=plan.host_bytes + encoder_host)
        return dataclasses.replace(plan, asked_bytes=asked) if budget_bytes < asked else plan

    plan = plan_at(budget)
    available = host_available_bytes()
    if plan.host_bytes > available:
        raise UsageError(f"{plan.describe()}, and this machine has {available / GIB:.1f} GiB of host memory free",
                         host_fix(plan, available, plan_at, device_bytes(device), fp8_linears(preset)))
    return plan


def host_fix(plan: MemoryPlan, available: int, plan_at, device_total: int, fp8: bool) -> str:
    """What would fit the host memory there is: the smallest larger budget the GPU has whose plan holds less in host
    memory (fewer blocks and no encoder streamed), else freeing memory or FP8 linears."""
    for gib in range(math.floor(plan.budget_bytes / GIB) + 1, math.floor(device_total / GIB) + 1):
        larger = plan_at(gib * GIB)
        if larger.host_bytes <= available:
            held = (f"{larger.host_bytes / GIB:.1f} GiB held in host memory" if larger.host_bytes else
                    "nothing streamed from host memory")
            return (f"give --vram {gib} on a GPU that has it, {held} then; or free "
                    f"{(plan.host_bytes - available) / GIB:.1f} GiB of host memory")
    fp8_hint = "" if fp8 else ", or an FP8 preset (half the bytes to hold)"
    return f"free {(plan.host_bytes - available) / GIB:.1f} GiB of host memory{fp8_hint}"


def planned(preset, requests, repo, device: str, processes: int = 1) -> MemoryPlan | None:
    """`plan_for`, with the preset's sampler and encoder set to follow the plan (`follow`); on the CPU, the clips
    checked against the host memory free (`check_host_fits`, for `processes` of them on this machine)."""
    if device == "cpu" and requests:
        check_host_fits(preset, requests, repo, processes)
    plan = plan_for(preset, requests, repo, device)
    follow(preset, plan)
    return plan


# A card's size as sold is more than the memory its driver reports (a 24 GB L4 reports 22.5 GiB with ECC on): a budget
# up to this much above it is taken for the card's size, and the plan takes what is free.
CARD_SIZE_SLACK = 0.1


def budget_named(gib: float) -> str:
    """A budget as an error says it: --vram or the preset's runtime.vram_gib (a --set of it too) gave it."""
    return f"a device memory budget of {gib:g} GiB (--vram, runtime.vram_gib)"


def check_budget(budget_gib: float, device: str) -> None:
    """A budget (0: none) is for a GPU, and at most the GPU's memory (its size as sold)."""
    if not budget_gib:
        return
    if not device.startswith("cuda"):
        raise UsageError(f"{budget_named(budget_gib)} is for a GPU, and this run is on the CPU",
                         "run on a GPU, or give --vram 0 for none; a preset's runtime.vram_gib gives one too")
    total = device_bytes(device)
    if budget_gib * GIB > total * (1 + CARD_SIZE_SLACK):
        raise UsageError(f"{budget_named(budget_gib)} is more than the GPU's {total / GIB:.1f} GiB",
                         f"give at most {math.floor(total / GIB)}, or no budget to plan for what is free on it")


def fp8_linears(preset, role: str = "dit") -> bool:
    quant_name, quant = preset.stages["quant"]
    return quant_name == "fp8-rowwise" and role in quant.roles


def dit_sizes(preset, config: dict) -> DiTSizes:
    from h3gen.models.dit.checkpoint import H3DiTConfig
    from h3gen.stages.sampler import forwards

    element = element_bytes(preset)
    return DiTSizes.of(H3DiTConfig.from_dict(config), 1 if fp8_linears(preset) else element,
                       2 * forwards(preset.stages["sampler"][1]) + 2, element)


def decoder_bytes(preset, repo) -> int:
    """The video and audio decoders stay resident beside the DiT: their weights at the checkpoint's (bf16) bytes (an
    upper bound for an FP8 decoder), twice over in fp32."""
    return element_bytes(preset) // 2 * (repo.weight_bytes("vae") + repo.weight_bytes("audio_vae"))


def encoder_bytes(preset, repo) -> tuple[int, int]:
    """The text encoder's weights (in host memory, on the device): the layers H3 runs (one past the one it reads) of
    the checkpoint's; on the device halved for FP8 linears (their embeddings and vision tower stay, so this errs low
    by their share). (0, 0) for an encoder that cannot stream."""
    name, encode = preset.stages["encode"]
    if not hasattr(encode, "stream_layers"):
        return 0, 0
    layers = repo.text_encoder_layers()
    used = min(1.0, (encode.layer + 1) / layers)
    host = int(repo.weight_bytes("text_encoder") * used * element_bytes(preset) // 2)
    return host, host // 2 if fp8_linears(preset, "text_encoder") else host


def element_bytes(preset) -> int:
    return 4 if preset.runtime["dtype"] == "float32" else 2


def activations(preset, requests, config: dict, chunked: bool = False) -> int:
    """The largest clip's activations at h3gen's DiT peak, as measured per packed row (`chunked`: with the
    feed-forward in row passes, as the preset may already ask); or the decode's, when larger, for a decoder that
    does not size its tile batch to the memory left (h3gen's `fast` does, down to one tile)."""
    from h3gen.run import memory

    shape = memory.DiTShape.from_dict(config)
    chunked = chunked or preset.stages["sampler"][1].ffn_chunk_rows
    values = memory.CHUNKED_FFN_VALUES_PER_ROW_PER_FFN if chunked else memory.FAST_DIT_VALUES_PER_ROW_PER_FFN
    rows = max(memory.packed_rows(request, shape) for request in requests)
    dit = int(rows * shape.ffn_dim * element_bytes(preset) * values)
    if hasattr(preset.stages["vae"][1], "max_tile_batch"):
        return dit
    return max(dit, max(memory.peak_bytes(request, shape, 0, element_bytes(preset), values) for request in requests))


def host_available_bytes() -> int:
    """Host memory a process can take now without swapping: the kernel's MemAvailable (free memory and the page cache
    it can drop), within the limit of each cgroup that holds the process (`cgroup_headroom`: a container's, a
    systemd unit's); the free pages where Linux does not say."""
    import os

    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        with open("/proc/meminfo") as meminfo:
            available = next((int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemAvailable:")),
                             available)
    except (OSError, ValueError):
        pass
    headroom = cgroup_headroom()
    return available if headroom is None else min(available, headroom)


# cgroup v2's and v1's files: the limit, what is charged, and the page cache in it the kernel can drop (memory.stat)
CGROUP_FILES = {"v2": ("memory.max", "memory.current", "inactive_file"),
                "v1": ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")}
NO_LIMIT = 2**62  # v1 says "no limit" with a number near 2**63


def cgroup_headroom(mount: Path = Path("/sys/fs/cgroup"), membership: Path = Path("/proc/self/cgroup")) -> int | None:
    """The least memory any cgroup holding this process can still take (its limit less what is charged to it, but
    the page cache it can drop), from the process's own cgroup up to the root, v2 (`0::/path`) and v1's memory
    controller (`N:memory:/path`, mounted at memory/) alike; None where no limit holds it, or Linux does not say."""
    try:
        lines = membership.read_text().splitlines()
    except OSError:
        return None
    headroom = None
    for line in lines:
        number, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        version = "v2" if number == "0" and not controllers else "v1" if "memory" in controllers.split(",") else None
        if version is None:
            continue
        base = mount if version == "v2" else mount / "memory"
        own = base / path.strip("/")
        for group in (own, *own.parents):
            room = cgroup_room(group, *CGROUP_FILES[version])
            if room is not None:
                headroom = room if headroom is None else min(headroom, room)
            if group == base:
                break
    return headroom


def cgroup_room(group: Path, limit_file: str, usage_file: str, cache_key: str) -> int | None:
    try:
        limit = (group / limit_file).read_text().strip()
        if limit == "max" or int(limit) >= NO_LIMIT:
            return None
        used = int((group / usage_file).read_text())
    except (OSError, ValueError):
        return None
    return max(0, int(limit) - used + droppable_cache(group, cache_key))


def droppable_cache(group: Path, key: str) -> int:
    try:
        stat = (group / "memory.stat").read_text().splitlines()
        return next((int(line.split()[1]) for line in stat if line.split()[:1] == [key]), 0)
    except (OSError, ValueError, IndexError):
        return 0


def check_host_fits(preset, requests, repo, processes: int = 1) -> None:
    """A run on the CPU holds its libraries, its weights (at the run's precision, from a bf16 checkpoint) and the
    largest clip's peak in host memory (`memory.host_peak_bytes`), once in each of `processes`: more than the machine
    has free stops it before any weight loads, where it would otherwise end in the kernel's out-of-memory kill or in
    swap."""
    from h3gen.models.repo import WEIGHTED
    from h3gen.run import memory

    weights = sum(repo.weight_bytes(part) for part in WEIGHTED) * element_bytes(preset) // 2
    shape = memory.DiTShape.from_dict(repo.transformer_config())
    largest = max(requests, key=lambda r: memory.host_peak_bytes(r, shape, 0, element_bytes(preset)))
    need = processes * memory.host_peak_bytes(largest, shape, weights, element_bytes(preset))
    available = host_available_bytes()
    if need > available:
        each = f" in each of {processes} worker processes" if processes > 1 else ""
        loaded = processes * (memory.HOST_LIBRARIES_BYTES + weights)  # before any clip
        fit = available // (need // processes)  # the processes of this size that the free memory holds
        if processes > 1 and fit >= 1:
            fix = (f"run at most {fit} workers (--cpu-workers {fit})" if fit > 1
                   else "run in one process: leave out --cpu-workers")
        elif loaded > available:
            fix = (f"the libraries and weights alone take {loaded / GIB:.1f} GiB before any clip: run on a GPU, or "
                   "free host memory")
        else:
            fix = "render fewer frames or a smaller size, free host memory, or render on a GPU"
        raise UsageError(f"the largest clip ({memory.clip_named(largest)}) needs about {need / GIB:.1f} GiB of host "
                         f"memory on the CPU ({in_gib_or_mib(weights)} of it weights{each}), and this machine has "
                         f"{available / GIB:.1f} GiB free", fix)


def in_gib_or_mib(size: int) -> str:
    """A size in GiB, or in MiB below a tenth of a GiB (a small model's weights are not "0.0 GiB")."""
    return f"{size / GIB:.1f} GiB" if size >= GIB / 10 else f"{size / 2**20:.1f} MiB"


def device_bytes(device: str) -> int:
    import torch

    return torch.cuda.get_device_properties(torch.device(device)).total_memory


def hold_to(device: str, vram_gib: float) -> None:
    """Hold this process's allocator to the budget, as a card of that size would (the whole device without one)."""
    if not device.startswith("cuda"):
        return
    import torch

    from h3gen.run.memory import cuda_index

    index = cuda_index(device)
    total = torch.cuda.get_device_properties(index).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, vram_gib * GIB / total) if vram_gib else 1.0, index)


def follow(preset, plan: MemoryPlan | None) -> None:
    """The sampler streams what the plan says (never fewer blocks than the preset's `sampler.stream_blocks`)."""
    if plan is not None:
        sampler, encode = preset.stages["sampler"][1], preset.stages["encode"][1]
        sampler.stream_blocks = plan.streamed
        if plan.ffn_chunk_rows and not sampler.ffn_chunk_rows:
            sampler.ffn_chunk_rows = plan.ffn_chunk_rows
        if plan.stream_encoder and hasattr(encode, "stream_layers"):
            encode.stream_layers = True
