"""DiT blocks whose weights live in host memory and come to the device only while they run.

`BlockStreamer` keeps each streamed block's parameters and buffers (FP8 weights and their scales included; the AdaLN
table stays resident, it is small and indexed every forward) in pinned host memory, and two device slots shaped
like one block. Before a streamed block runs, its weights are in a slot: copied there on a side stream while the
block before it computed, the compute stream waiting on the copy's event; the next streamed block's copy starts
into the other slot, which waits on the event of the block that used it last. Events, never a synchronization: the
copies overlap compute. A block's `.data` points at its slot only while it runs, so nothing else keeps a slot alive.
"""

from __future__ import annotations

import torch

RESIDENT = ("adaln_table",)  # small, indexed every forward: never streamed


def block_tensors(block) -> dict[str, torch.nn.Parameter | torch.Tensor]:
    """The block's streamable tensors by name: parameters and buffers but the resident ones, and but those still
    without data (the AdaLN projection a loader builds its table from, then drops)."""
    tensors = dict(block.named_parameters())
    tensors.update((name, buffer) for name, buffer in block.named_buffers()
                   if buffer is not None and name.split(".")[-1] not in RESIDENT)
    return {name: tensor for name, tensor in tensors.items() if not tensor.is_meta}


def set_tensor(block, name: str, value: torch.Tensor) -> None:
    *path, leaf = name.split(".")
    module = block.get_submodule(".".join(path)) if path else block
    if leaf in module._parameters:
        module._parameters[leaf].data = value
    else:
        module._buffers[leaf] = value


class BlockStreamer:
    """Streams `streamed` (block indices) of `blocks`; each moves to host memory when `take(index)` is called (as
    soon as it is loaded, so the device never holds the streamed blocks together)."""

    def __init__(self, blocks, streamed: list[int], device):
        self.blocks, self.device = blocks, torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.streamed = sorted(streamed)
        self.host: dict[int, dict[str, torch.Tensor]] = {}
        self.slots: list[dict[str, torch.Tensor]] = []
        self.holds = [None, None]  # the block each slot holds (or is being filled with)
        self.running = None  # the streamed block whose weights the compute stream is using
        self.copied = [self.event(), self.event()]  # a slot's copy has landed
        self.free = [self.event(), self.event()]  # the block that used a slot last has run
        self.copies = torch.cuda.Stream(self.device) if self.cuda else None

    def take(self, index: int) -> None:
        """Move block `index`'s streamable tensors to pinned host memory; the two slots are shaped by the first."""
        self.host[index] = {name: self.to_host(tensor) for name, tensor in block_tensors(self.blocks[index]).items()}
        for name, tensor in self.host[index].items():
            set_tensor(self.blocks[index], name, tensor)
        if not self.slots:
            self.slots = [{name: torch.empty_like(tensor, device=self.device)
                           for name, tensor in self.host[index].items()} for _ in range(2)]

    def to_host(self, tensor):
        host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=self.cuda)
        host.copy_(tensor)
        return host

    def event(self):
        return torch.cuda.Event() if self.cuda else None

    def streams(self, index: int) -> bool:
        return index in self.host

    def before(self, index: int) -> None:
        """Block `index` is about to run: its weights are on the device once the compute stream reaches it, and
        the next streamed block's copy is under way."""
        if not self.streams(index):
            return
        if index not in self.holds:
            self.fetch(index)
        slot = self.holds.index(index)
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(self.copied[slot])
        for name, tensor in self.slots[slot].items():
            set_tensor(self.blocks[index], name, tensor)
        self.running = index
        following = self.next_after(index)
        if following is not None and following not in self.holds:
            self.fetch(following)

    def after(self, index: int) -> None:
        """Block `index` has been queued: its slot is free once the compute stream gets past it."""
        if not self.streams(index):
            return
        slot = self.holds.index(index)
        if self.cuda:
            self.free[slot].record(torch.cuda.current_stream(self.device))
        for name, tensor in self.host[index].items():
            set_tensor(self.blocks[index], name, tensor)
        self.running = None

    def next_after(self, index: int) -> int | None:
        """The streamed block after `index`, the first one again after the last (the next forward's)."""
        later = [i for i in self.streamed if i > index]
        return later[0] if later else (self.streamed[0] if len(self.streamed) > 1 else None)

    def fetch(self, index: int) -> None:
        """Copy block `index` into a slot the running block does not hold (an empty one first)."""
        slots = [slot for slot in (0, 1) if self.holds[slot] is None or self.holds[slot] != self.running]
        slot = next((slot for slot in slots if self.holds[slot] is None), slots[0])
        self.holds[slot] = index
        if not self.cuda:
            for name, tensor in self.host[index].items():
                self.slots[slot][name].copy_(tensor)
            return
        with torch.cuda.stream(self.copies):
            self.copies.wait_event(self.free[slot])
            for name, tensor in self.host[index].items():
                self.slots[slot][name].copy_(tensor, non_blocking=True)
            self.copied[slot].record(self.copies)

    def resident_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for slot in self.slots for t in slot.values())
