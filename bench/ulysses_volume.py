"""What Ulysses sequence parallelism sends per rank for the full-size DiT, and the forward time that predicts.

    python bench/ulysses_volume.py [--forward-s 16.3] [--link-gbs 450] [--all-to-all-share 0.75]

Per block a rank sends q, k, v of its rows for the other ranks' heads, then the attention output of the other ranks'
rows for its own heads; after the last block the row slices are gathered once. The prediction splits one GPU's
forward time evenly over k (matmuls by rows, attention by heads; the replicated text refiner and patch projections
are small) and adds the all-to-all time with no overlap, since attention waits for its inputs. CPU only.
"""

import argparse

from h3gen.parallel.ulysses import row_counts

ROWS, BLOCKS, HIDDEN, HEADS, HEAD_DIM, BF16 = 73_642, 50, 5376, 56, 128, 2  # the 10 s 1344x768 layout


def bytes_sent(ranks: int, rows: int = ROWS) -> tuple[int, int]:
    """(per block, per forward) bytes the busiest rank sends."""
    local = max(row_counts(rows, ranks))
    to_heads = 3 * local * (HEADS - HEADS // ranks) * HEAD_DIM * BF16  # its rows, the other ranks' heads
    to_rows = (rows - local) * (HEADS // ranks) * HEAD_DIM * BF16  # the other ranks' rows, its heads
    gather = (ranks - 1) * local * HIDDEN * BF16
    per_block = to_heads + to_rows
    return per_block, BLOCKS * per_block + gather


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--forward-s", type=float, default=16.3, help="one DiT forward on one GPU, seconds")
    parser.add_argument("--link-gbs", type=float, default=450.0, help="GPU link bandwidth per direction, GB/s")
    parser.add_argument("--all-to-all-share", type=float, default=0.75, help="share of it an all-to-all reaches")
    args = parser.parse_args()
    rate = args.link_gbs * 1e9 * args.all_to_all_share
    print(f"{ROWS} rows, {BLOCKS} blocks, {HEADS}x{HEAD_DIM} heads, bf16; {args.forward_s} s per forward on one GPU, "
          f"all-to-all at {rate / 1e9:.0f} GB/s")
    print(f"{'k':>2} {'MB/block':>9} {'GB/forward':>11} {'compute s':>10} {'comm s':>7} {'forward s':>10} "
          f"{'speedup':>8} {'efficiency':>11}")
    for ranks in (1, 2, 4, 8):
        per_block, per_forward = bytes_sent(ranks)
        compute, comm = args.forward_s / ranks, per_forward / rate
        forward = compute + comm
        print(f"{ranks:>2} {per_block / 1e6:>9.1f} {per_forward / 1e9:>11.2f} {compute:>10.3f} {comm:>7.3f} "
              f"{forward:>10.3f} {args.forward_s / forward:>8.2f} {args.forward_s / forward / ranks:>10.1%}")


if __name__ == "__main__":
    main()
