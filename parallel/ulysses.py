"""Ulysses sequence parallelism for FastH3Transformer: one clip's packed sequence spread over a process group.

Each of the k ranks runs the transformer blocks over a contiguous slice of the packed rows; every op there is
row-wise except attention. Around attention an all-to-all trades the row slice for a head slice (all rows, heads/k
heads), attention runs on those heads, and a second all-to-all trades back. Slices are uneven when k does not divide
the row count (all_to_all_single with split sizes), so no padding row is ever a key. After the last block the rows
are gathered, so every rank returns the full velocities and the sampler steps identically everywhere.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from h3gen.errors import UsageError
from h3gen.kernels.attention import attention
from h3gen.parallel.layout import ulysses_degrees

# torch renamed all_gather_into_tensor to all_gather_single; the device image's torch may only know the old name.
ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def row_counts(rows: int, ranks: int) -> list[int]:
    """Rows per rank, in rank order: contiguous slices, the first `rows % ranks` ranks one row longer."""
    base, extra = divmod(rows, ranks)
    return [base + (rank < extra) for rank in range(ranks)]


class RowSlices:
    """The current forward's split of the packed rows over the group, shared by every block's attention."""

    def __init__(self, group):
        self.group = group
        self.ranks, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.counts: list[int] = []

    def split(self, rows: int) -> slice:
        self.counts = row_counts(rows, self.ranks)
        start = sum(self.counts[:self.rank])
        return slice(start, start + self.counts[self.rank])


class UlyssesAttention:
    """Stands in for `FusedAttention.attend`: q, k, v (B, local rows, heads, D) -> output of the same shape."""

    def __init__(self, slices: RowSlices):
        self.slices = slices

    @torch.compiler.disable
    def __call__(self, q, k, v, backend):
        counts, ranks = self.slices.counts, self.slices.ranks
        batch, local_rows, heads, head_dim = q.shape
        group_heads = heads // ranks
        # Send buffer (destination rank, local rows, q/k/v, B, heads of that rank, D): dim 0 splits evenly by rank.
        send = q.new_empty((ranks, local_rows, 3, batch, group_heads, head_dim))
        for index, tensor in enumerate((q, k, v)):
            send[:, :, index] = tensor.view(batch, local_rows, ranks, group_heads, head_dim).permute(2, 1, 0, 3, 4)
        received = q.new_empty((sum(counts), 3, batch, group_heads, head_dim))
        dist.all_to_all_single(received, send.flatten(0, 1), output_split_sizes=counts,
                               input_split_sizes=[local_rows] * ranks, group=self.slices.group)
        # Source ranks hold consecutive row slices, so the received rows are already in packed order. The views
        # are (B, rows, heads, D) with head_dim contiguous and rows strided, the layout the single-device v has.
        q_all, k_all, v_all = received.permute(2, 0, 1, 3, 4).unbind(2)
        out = attention(q_all, k_all, v_all, backend)
        send_back = out.transpose(0, 1).contiguous()  # (rows, B, heads of this rank, D): dim 0 splits by rows
        returned = out.new_empty((ranks * local_rows, batch, group_heads, head_dim))
        dist.all_to_all_single(returned, send_back, output_split_sizes=[local_rows] * ranks,
                               input_split_sizes=counts, group=self.slices.group)
        # (source rank = head group, local rows, B, heads, D) -> (B, local rows, all heads in order, D)
        returned = returned.view(ranks, local_rows, batch, group_heads, head_dim).permute(2, 1, 0, 3, 4)
        return returned.reshape(batch, local_rows, heads, head_dim)


def gather_rows(local, counts: list[int], group):
    """(B, local rows, C) slices -> (B, all rows, C) on every rank; padded to the longest slice for the gather."""
    longest = max(counts)
    padded = local.new_zeros((longest, *local.shape[:1], *local.shape[2:]))
    padded[:local.shape[1]] = local.transpose(0, 1)
    gathered = local.new_empty((len(counts) * longest, *padded.shape[1:]))
    ALL_GATHER(gathered, padded, group=group)
    slices = gathered.view(len(counts), longest, *padded.shape[1:])
    return torch.cat([slices[rank, :count] for rank, count in enumerate(counts)]).transpose(0, 1).contiguous()


def apply_ulysses(transformer, group):
    """Make a built FastH3Transformer sequence-parallel over `group` (every rank calls this on its own copy).
    Forward signature and outputs stay as they were; quantized or compiled blocks keep working, since only the
    attention step and the loop over the blocks are replaced."""
    ranks = dist.get_world_size(group)
    heads = transformer.config.num_attention_heads
    if heads % ranks:
        allowed = ", ".join(map(str, ulysses_degrees(heads, heads)))
        raise UsageError(f"Ulysses over {ranks} ranks cannot split the DiT's {heads} attention heads evenly",
                         f"run on a number of devices that divides {heads}: {allowed}")
    if getattr(transformer, "ulysses_slices", None) is not None:
        raise ValueError("this transformer is already sequence-parallel")
    slices = RowSlices(group)
    for block in transformer.transformer_blocks:
        block.attn.attend = UlyssesAttention(slices)
        block.attn.fp8_from_norm = False  # the all-to-all carries bf16 q, k, v; fa3-fp8 quantizes what arrives
    blocks_on_all_rows = transformer.run_blocks

    def run_blocks(packed, temb, adaln_index, from_table, cos, sin, step_cache=None, token_tags=None):
        rows = slices.split(packed.shape[1])
        local = blocks_on_all_rows(packed[:, rows].contiguous(), temb, adaln_index[rows], from_table, cos[rows],
                                   sin[rows], step_cache, token_tags[rows] if token_tags is not None else None)
        return gather_rows(local, slices.counts, group)

    transformer.run_blocks = run_blocks
    transformer.ulysses_slices = slices
    return transformer
