"""The largest magnitude of each (batch, head) of a (B, L, heads, head_dim) tensor, read once: the scale FP8
attention takes for v. v arrives as a strided view of the fused q, k, v projection; torch's reduction over that
view runs at a fraction of the memory's bandwidth, this kernel reads it at full rate. A maximum is exact, so the
two agree bit for bit."""
import torch
import triton
import triton.language as tl


def head_amax_reference(x):
    """(B, L, heads, head_dim) -> (B, heads) float32."""
    return torch.linalg.vector_norm(x, float("inf"), dim=(1, 3)).float()


@triton.jit
def _head_amax_kernel(x_ptr, out_ptr, seq_len, heads, batch_stride, row_stride, ROWS: tl.constexpr,
                      HEAD_DIM: tl.constexpr, HEADS_BLOCK: tl.constexpr):
    block, batch = tl.program_id(0), tl.program_id(1).to(tl.int64)
    head = tl.program_id(2) * HEADS_BLOCK + tl.arange(0, HEADS_BLOCK)
    dim = tl.arange(0, HEAD_DIM)
    amax = tl.zeros([HEADS_BLOCK], dtype=tl.float32)
    for offset in range(ROWS):
        row = (block * ROWS + offset).to(tl.int64)
        mask = (row < seq_len) & (head < heads)[:, None]
        x = tl.load(x_ptr + batch * batch_stride + row * row_stride + head[:, None] * HEAD_DIM + dim[None, :],
                    mask=mask, other=0.0)
        amax = tl.maximum(amax, tl.max(tl.abs(x.to(tl.float32)), axis=1))
    tl.atomic_max(out_ptr + batch * heads + head, amax, mask=head < heads)


def head_amax_triton(x, rows=32, heads_block=8):
    batch, seq_len, heads, head_dim = x.shape
    assert x.stride(3) == 1 and x.stride(2) == head_dim, "each row's heads must lie side by side"
    out = torch.zeros((batch, heads), dtype=torch.float32, device=x.device)  # magnitudes are >= 0
    grid = (triton.cdiv(seq_len, rows), batch, triton.cdiv(heads, heads_block))
    _head_amax_kernel[grid](x, out, seq_len, heads, x.stride(0), x.stride(1), ROWS=rows, HEAD_DIM=head_dim,
                            HEADS_BLOCK=heads_block, num_warps=4)
    return out


def head_amax(x):
    """(B, L, heads, head_dim) -> (B, heads) float32: the Triton kernel on a GPU for bf16 and fp32 heads."""
    if x.is_cuda and x.dtype in (torch.bfloat16, torch.float32) and x.stride(3) == 1 and x.stride(2) == x.shape[3]:
        return head_amax_triton(x)
    return head_amax_reference(x)
