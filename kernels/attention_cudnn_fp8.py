"""FP8 attention through cuDNN's fused SDPA (nvidia-cudnn-frontend, optional): Q, K, V quantized per tensor, the
softmax probabilities scaled into FP8's range inside cuDNN. Hopper's cuDNN writes the output in FP8 too: every
output row is a convex combination of V's rows, so V's scale bounds it and serves as the output's scale."""
import functools
import math

import torch

FP8, FP8_MAX, P_SCALE = torch.float8_e4m3fn, 448.0, 448.0
SCALARS = ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")


@functools.cache
def cudnn_module():
    from h3gen.kernels.attention import optional

    return optional("cudnn")


class _FP8Graph:
    """One built cuDNN graph per (B, H, L, D) and device."""

    def __init__(self, cudnn, batch, heads, length, head_dim):
        self.cudnn, self.handle = cudnn, cudnn.create_handle()
        fp8, fp32 = cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT
        graph = cudnn.pygraph(io_data_type=fp8, intermediate_data_type=fp32, compute_data_type=fp32,
                              handle=self.handle)
        dims, strides = [batch, heads, length, head_dim], [length * heads * head_dim, head_dim, heads * head_dim, 1]
        self.inputs = [graph.tensor(name=name, dim=dims, stride=strides, data_type=fp8) for name in "qkv"]
        self.scalars = [graph.tensor(name=name, dim=[1] * 4, stride=[1] * 4, data_type=fp32) for name in SCALARS]
        q, k, v = self.inputs
        scales = dict(zip(SCALARS, self.scalars))
        try:
            outputs = graph.sdpa_fp8(q=q, k=k, v=v, **scales, generate_stats=False,
                                     attn_scale=1 / math.sqrt(head_dim), use_causal_mask=False)
        except TypeError:  # frontends before generate_stats
            outputs = graph.sdpa_fp8(q=q, k=k, v=v, **scales, is_inference=True,
                                     attn_scale=1 / math.sqrt(head_dim), use_causal_mask=False)
        self.out, _, *amaxes = outputs
        self.out.set_output(True).set_dim(dims).set_stride(strides).set_data_type(fp8)
        for amax in amaxes:
            amax.set_output(True).set_dim([1] * 4).set_stride([1] * 4).set_data_type(fp32)
        self.amaxes = amaxes
        graph.validate()
        graph.build_operation_graph()
        graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        graph.check_support()
        graph.build_plans()
        self.graph, self.workspace_size = graph, graph.get_workspace_size()

    def variant_pack(self, q8, k8, v8, descales, out) -> dict:
        """The graph's tensors bound to these inputs, `out` and fresh scalars; cuDNN set to the current stream."""
        device = q8.device
        scalars = [*descales, torch.tensor(1 / P_SCALE, device=device), torch.tensor(P_SCALE, device=device),
                   1 / descales[2]]
        amax_buffers = [torch.empty(1, 1, 1, 1, device=device) for _ in self.amaxes]
        self.cudnn.set_stream(handle=self.handle, stream=torch.cuda.current_stream(device).cuda_stream)
        return {**dict(zip(self.inputs, (q8, k8, v8))), self.out: out,
                **{t: s.reshape(1, 1, 1, 1).float() for t, s in zip(self.scalars, scalars)},
                **dict(zip(self.amaxes, amax_buffers))}

    def __call__(self, q8, k8, v8, descales, out):
        pack = self.variant_pack(q8, k8, v8, descales, out)
        workspace = torch.empty(self.workspace_size, dtype=torch.uint8, device=q8.device)
        self.graph.execute(pack, workspace, handle=self.handle)
        return out


@functools.cache
def _graph(batch, heads, length, head_dim, device_index):
    return _FP8Graph(cudnn_module(), batch, heads, length, head_dim)


def quantize_tensor(x):
    """(fp8 tensor, fp32 descale) with x ~= fp8 * descale, in two passes over `x`: the infinity norm reads it
    without a temporary, and the scaled product (rounded in x's dtype) is at most 448 * (1 + 2^-8), which e4m3's
    round-to-nearest brings back to 448, so no clamp is needed."""
    amax = torch.linalg.vector_norm(x, float("inf")).float().clamp(min=1e-12)
    return (x * (FP8_MAX / amax)).to(FP8), amax / FP8_MAX


def attention_fp8_cudnn(q, k, v):
    """`q`, `k`, `v` (B, L, H, D) CUDA tensors -> (B, L, H, D) in q's dtype."""
    if cudnn_module() is None:
        raise RuntimeError("the cudnn-fp8 attention backend needs nvidia-cudnn-frontend: pip install "
                           "'h3gen[fp8-attention]', or choose another backend")
    quantized = [quantize_tensor(t) for t in (q, k, v)]
    graph = _graph(*q.shape[:1], q.shape[2], q.shape[1], q.shape[3], q.device.index)
    out = torch.empty(q.shape, dtype=FP8, device=q.device)
    graph(*(t for t, _ in quantized), [s for _, s in quantized], out)
    return out.to(q.dtype).mul_(quantized[2][1])
