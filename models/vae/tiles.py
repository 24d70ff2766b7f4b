"""Where the video VAE's decode cuts and joins: temporal chunks, spatial tiles, and the linear blends between them.

The layout and the blend arithmetic are diffusers' `AutoencoderKLMiniMaxH3` decode, step for step, so the tiles can
be decoded in any grouping (batched, or on other ranks) and still be joined into the frames diffusers makes. Every
tile of every chunk has the same latent shape, which is what lets them share one decoder forward.
"""

from __future__ import annotations

import dataclasses
import math


def split_tiles(length: int, tile: int, min_overlap: int, ratio: int) -> tuple[list[int], int, list[int]]:
    """Pixel starts, tile size and overlaps covering `length`: the fewest tiles that keep every overlap at least
    `min_overlap`, the slack spread round-robin over the overlaps in whole latents."""
    if tile >= length:
        return [0], length, []
    count = math.ceil(length / tile)
    while tile * count - min_overlap * (count - 1) < length:
        count += 1
    overlaps = [min_overlap] * (count - 1)
    for i in range((tile * count - sum(overlaps) - length) // ratio):
        overlaps[i % (count - 1)] += ratio
    starts = [0]
    for overlap in overlaps:
        starts.append(starts[-1] + tile - overlap)
    return starts, tile, overlaps


@dataclasses.dataclass(frozen=True)
class DecodePlan:
    """One clip's decode: `chunks` temporal chunks of `chunk_latents` latent frames, each cut into the same grid of
    tiles. Items (chunk, row, col) are numbered chunk-major, so a chunk's tiles are done before the next chunk's."""

    ratio: int  # pixels per latent, spatially
    temporal_ratio: int
    chunk_stride: int  # latent frames between chunk starts
    chunk_latents: int
    chunks: int
    pad_latents: int  # copies of the last latent frame appended so the chunks cover the clip
    pre_padding: int  # leading pixel frames of a chunk that belong to no frame of the clip
    frame_overlap: int  # pixel frames two consecutive chunks cross-fade over
    has_tail: bool  # each chunk's last frames are blended into the next chunk's first
    row_starts: tuple[int, ...]  # pixels
    col_starts: tuple[int, ...]
    tile_height: int
    tile_width: int
    row_overlaps: tuple[int, ...]
    col_overlaps: tuple[int, ...]
    frames: int  # pixel frames of the clip

    @property
    def grid(self) -> int:
        return len(self.row_starts) * len(self.col_starts)

    @property
    def items(self) -> int:
        return self.chunks * self.grid

    @property
    def chunk_frames(self) -> int:
        """Pixel frames of one decoded chunk, before it is cut into its own frames and the tail."""
        return self.chunk_latents * self.temporal_ratio

    def item(self, index: int) -> tuple[int, int, int]:
        chunk, tile = divmod(index, self.grid)
        return (chunk, *divmod(tile, len(self.col_starts)))

    def latent_tile(self, latents, index: int):
        """The latents of item `index`, (C, chunk_latents, h, w), a view of the padded (C, T, H, W) latents."""
        chunk, row, col = self.item(index)
        t, y, x = chunk * self.chunk_stride, self.row_starts[row] // self.ratio, self.col_starts[col] // self.ratio
        return latents[:, t:t + self.chunk_latents, y:y + self.tile_height // self.ratio,
                       x:x + self.tile_width // self.ratio]


def plan_decode(vae, latent_shape, tile_height: int, tile_width: int, overlap_height: int,
                overlap_width: int) -> DecodePlan:
    """The plan diffusers' `_decode` follows for latents of `latent_shape` (B, C, T, H, W) with these tile knobs."""
    _, _, latent_frames, height, width = latent_shape
    ratio, temporal_ratio = vae.spatial_compression_ratio, vae.temporal_compression_ratio
    stride, token_drop, clip_length = vae.tokens_chunk_size, vae.config.token_drop, vae.config.clip_length
    tokens = latent_frames + token_drop
    pad = (-tokens) % stride
    chunks = (tokens + pad) // stride - int(token_drop > 0)
    chunk_latents = stride + vae.token_overlap
    if (chunks - 1) * stride + chunk_latents > latent_frames + pad:
        raise ValueError(f"{latent_frames} latent frames do not make whole decode chunks")
    rows, tile_h, row_overlaps = split_tiles(height * ratio, tile_height, overlap_height, ratio)
    cols, tile_w, col_overlaps = split_tiles(width * ratio, tile_width, overlap_width, ratio)
    main = min(stride * temporal_ratio, chunk_latents * temporal_ratio) - vae.frame_pre_padding
    tail = chunk_latents * temporal_ratio - stride * temporal_ratio - vae.frame_pre_padding
    # The repeated latents decode to frames nobody asked for; a chunk's last latent covers only part of a stride.
    intra_tail = clip_length % temporal_ratio
    pad_frames = sum(intra_tail if intra_tail and (latent_frames + k) % stride == 0 else temporal_ratio
                     for k in range(pad))
    frames = chunks * main + (tail if token_drop > 0 else 0) - pad_frames
    return DecodePlan(ratio, temporal_ratio, stride, chunk_latents, chunks, pad, vae.frame_pre_padding,
                      vae.frame_overlap, token_drop > 0, tuple(rows), tuple(cols), tile_h, tile_w,
                      tuple(row_overlaps), tuple(col_overlaps), frames)


def pad_latents(latents, plan: DecodePlan):
    """(C, T, H, W) latents with the last frame repeated as the plan needs."""
    import torch

    if plan.pad_latents == 0:
        return latents
    return torch.cat([latents, latents[:, -1:].expand(-1, plan.pad_latents, -1, -1)], dim=1)


def blend(before, after, extent: int, dim: int):
    """The cross-faded start of `after` over the end of `before`, with diffusers' weights in `after`'s dtype."""
    import torch

    extent = min(before.shape[dim], after.shape[dim], extent)
    positions = torch.arange(extent, device=after.device, dtype=after.dtype)
    shape = [1] * after.ndim
    shape[dim] = extent
    fade_out, fade_in = (1 - positions / extent).view(shape), (positions / extent).view(shape)
    return before.narrow(dim, before.shape[dim] - extent, extent) * fade_out + after.narrow(dim, 0, extent) * fade_in


def stitch(tiles, plan: DecodePlan):
    """One chunk's decoded tiles, `tiles[row][col]` each (C, F, h, w), joined into (C, F, H, W) frames.

    Each tile is blended with the unblended tile above it, then the result with the unblended tile to its left,
    and cropped where the next tile takes over: diffusers' order, which the values depend on."""
    first = tiles[0][0]
    height = plan.row_starts[-1] + plan.tile_height
    width = plan.col_starts[-1] + plan.tile_width
    out = first.new_empty((*first.shape[:2], height, width))
    last_row, last_col = len(plan.row_starts) - 1, len(plan.col_starts) - 1
    for i, row in enumerate(tiles):
        for j, tile in enumerate(row):
            if i > 0 or j > 0:
                tile = tile.clone()
            if i > 0:
                extent = min(plan.row_overlaps[i - 1], tile.shape[-2])
                tile[..., :extent, :] = blend(tiles[i - 1][j], tile, extent, dim=-2)
            if j > 0:
                extent = min(plan.col_overlaps[j - 1], tile.shape[-1])
                tile[..., :extent] = blend(row[j - 1], tile, extent, dim=-1)
            keep_h = tile.shape[-2] - (plan.row_overlaps[i] if i < last_row else 0)
            keep_w = tile.shape[-1] - (plan.col_overlaps[j] if j < last_col else 0)
            y, x = plan.row_starts[i], plan.col_starts[j]
            out[..., y:y + keep_h, x:x + keep_w] = tile[..., :keep_h, :keep_w]
    return out


class ChunkJoiner:
    """Takes decoded tiles in any order and hands finished frames to `emit(frames (C, n, H, W))` in clip order.

    A chunk is stitched once all its tiles are in and the chunk before it is done; its own frames go out at once
    (cross-faded with the previous chunk's tail), its tail waits for the next chunk. Tiles are dropped as soon as
    their chunk is stitched, so at most a few chunks' tiles are held."""

    def __init__(self, plan: DecodePlan, emit):
        self.plan, self.emit = plan, emit
        self.tiles: dict[int, object] = {}
        self.next_chunk, self.tail, self.emitted = 0, None, 0

    def add(self, index: int, tile) -> None:
        self.tiles[index] = tile
        grid = self.plan.grid
        while self.next_chunk < self.plan.chunks and all(
                i in self.tiles for i in range(self.next_chunk * grid, (self.next_chunk + 1) * grid)):
            self._join_chunk(self.next_chunk)
            self.next_chunk += 1
        if self.next_chunk == self.plan.chunks and self.tail is not None:
            self._emit(self.tail)
            self.tail = None

    @property
    def done(self) -> bool:
        return self.next_chunk == self.plan.chunks and self.tail is None

    def _join_chunk(self, chunk: int) -> None:
        plan, first = self.plan, chunk * self.plan.grid
        cols = len(plan.col_starts)
        grid = [[self.tiles.pop(first + r * cols + c) for c in range(cols)] for r in range(len(plan.row_starts))]
        frames = stitch(grid, plan)
        span = plan.chunk_stride * plan.temporal_ratio
        own = frames[:, :span][:, plan.pre_padding:]
        if self.tail is not None:
            faded = blend(self.tail, own, plan.frame_overlap, dim=1)
            self._emit(faded)
            own = own[:, faded.shape[1]:]
        self._emit(own)
        self.tail = frames[:, span:2 * span][:, plan.pre_padding:] if plan.has_tail else None

    def _emit(self, frames) -> None:
        count = min(frames.shape[1], self.plan.frames - self.emitted)
        if count > 0:
            self.emit(frames[:, :count])
            self.emitted += count
