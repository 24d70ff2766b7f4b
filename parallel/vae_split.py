"""The video decode split across a group: tile batches dealt round-robin to the ranks, gathered on the first one.

Each rank decodes whole batches of the one-rank decode (same tiles, same batch size, so the same kernels on the
same shapes), and the group's first rank joins every tile with diffusers' blends. Blending only moves and mixes
finished tiles, so the frames are those of the one-rank decode, bit for bit, whichever rank decoded which tile.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def is_lead(group) -> bool:
    return dist.get_rank(group) == 0


def agree_tile_batch(size: int, group) -> int:
    """The smallest tile batch any rank can hold: every rank must cut the clip into the same batches."""
    agreed = torch.tensor([size], device=_collective_device(group))
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=group)
    return int(agreed.item())


def decode_across(group, batches, decode, joiner, tile_shape) -> None:
    """Decode `batches` (lists of item indices) over `group`: in round r, rank k decodes batch r * ranks + k, and
    every round is gathered on the group's first rank, whose `joiner` takes the tiles as they come (others pass
    None). `decode(items)` returns (len(items), *shape) tiles; `tile_shape` is (shape, dtype) of one tile."""
    ranks, rank = group.size(), dist.get_rank(group)
    lead = dist.get_global_rank(group, 0)
    shape, dtype = tile_shape
    width = len(batches[0])
    for first in range(0, len(batches), ranks):
        mine = first + rank
        sent = None
        if mine < len(batches):
            sent = decode(batches[mine])
        # Every rank sends a full batch (zeros past its tiles), so the gather has one shape.
        padded = torch.zeros((width, *shape), dtype=dtype, device=_collective_device(group))
        if sent is not None:
            padded[:len(sent)] = sent
        received = [torch.empty_like(padded) for _ in range(ranks)] if rank == 0 else None
        dist.gather(padded, received, dst=lead, group=group)
        if rank == 0:
            for source, tiles in enumerate(received):
                index = first + source
                if index < len(batches):
                    for item, tile in zip(batches[index], tiles):
                        joiner.add(item, tile)
    if rank == 0:
        assert joiner.done


def _collective_device(group):
    """NCCL moves CUDA tensors (on this rank's device), gloo host tensors."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
