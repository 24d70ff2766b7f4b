"""Full-size MiniMax-H3 DiT on one GPU: diffusers' forward against h3gen's FastH3Transformer, random weights.

Usage (diffusers importable, e.g. on PYTHONPATH; h3gen installed):
    python3 bench/dit_gpu_check.py [PHASES] [--only=NAME,...] [--tiny]
PHASES, comma separated (default all): kernels (Triton kernels vs torch references, full-size shapes),
attn (attention alone per backend; fa3 and fa3-fp8 also 50 calls back to back, with the SM clock and power
nvidia-smi reads meanwhile, as every timed forward records them), ref (diffusers as shipped and with SDPA forced
to cuDNN), fast (the fast model, built from the reference's weights, per switch combination; accuracy needs `ref`
in the same run).
--only keeps those forward variants (reference and fast, as named in the printed table).
--profile=NAME,... with the `profile` phase: the CUDA kernels of one forward of those variants, by total time.
--tiny runs a small config on the CPU as a dry run. Results: $OUT/dit_gpu_check.json (written as it goes).
On a machine without diffusers: `pip install --no-deps --target /tmp/site diffusers==0.42.1 importlib_metadata`
from carried wheels and put /tmp/site on PYTHONPATH; flash-attn-4 (optional) likewise, plus
<target>/nvidia_cutlass_dsl/dsl_packages on PYTHONPATH. All phases take about 4 minutes on one H200.
"""
import json
import os
import sys
import time
from pathlib import Path

import torch

OUT = Path(os.environ.get("OUT", "."))
TINY = "--tiny" in sys.argv
PROFILE = next((a.split("=", 1)[1].split(",") for a in sys.argv if a.startswith("--profile=")), ())
ONLY = next((a.split("=", 1)[1].split(",") for a in sys.argv if a.startswith("--only=")), None)
args = [a for a in sys.argv[1:] if not a.startswith("--")]
PHASES = args[0].split(",") if args else ["kernels", "attn", "ref", "fast"]
DEVICE = torch.device("cpu" if TINY else "cuda")
TINY_CONFIG = dict(num_attention_heads=2, attention_head_dim=128, hidden_size=64, num_layers=3, num_refiner_layers=1,
                   ffn_dim=128, text_dim=32, freq_dim=32, time_embed_hidden_dim=64, time_embed_dim=32)
# 10 s, 1344x768, 243 frames: video latents (1, 24, 72, 48, 84), 405 audio latents x 2 channels, 256 text tokens.
LAYOUT = dict(text=8, frames=3, height=4, width=6, audio=5) if TINY else dict(text=256, frames=72, height=48,
                                                                              width=84, audio=405)
results = {}
BLOCK_IO = {}  # block index -> (input, output) of diffusers' block, for per-block parity free of depth amplification




def log(key, value):
    results[key] = value
    print(f"[{time.strftime('%H:%M:%S')}] {key}: {json.dumps(value)}", flush=True)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "dit_gpu_check.json").write_text(json.dumps(results, indent=1))


def sync():
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def timed(fn):
    sync()
    start = time.perf_counter()
    out = fn()
    sync()
    return out, time.perf_counter() - start


class GpuClocks:
    """The SM clock (MHz) and board power (W) nvidia-smi reads every 100 ms while the block runs, summarized in
    `summary`; empty on the CPU or where nvidia-smi is missing. Tells a kernel slower in the model than alone from a
    clock lowered by sustained load."""

    def __enter__(self):
        import shutil
        import subprocess

        self.proc, self.summary = None, {}
        if DEVICE.type == "cuda" and shutil.which("nvidia-smi"):
            self.proc = subprocess.Popen(["nvidia-smi", "-i", str(torch.cuda.current_device()), "-lms", "100",
                                          "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits"],
                                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        return self

    def __exit__(self, *exc):
        if self.proc is None:
            return
        self.proc.terminate()
        samples = []
        for line in self.proc.communicate()[0].splitlines():
            try:
                samples.append(tuple(float(x) for x in line.split(",")))
            except ValueError:
                continue
        if samples:
            clocks, power = sorted(c for c, _ in samples), sorted(p for _, p in samples)
            self.summary = dict(sm_mhz_min=clocks[0], sm_mhz_median=clocks[len(clocks) // 2], sm_mhz_max=clocks[-1],
                                power_w_median=power[len(power) // 2], samples=len(samples))


def gib(n_bytes):
    return round(n_bytes / 2**30, 2)


def peak_reset():
    global LIVE_BYTES
    if DEVICE.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        LIVE_BYTES = torch.cuda.memory_allocated()


LIVE_BYTES = 0  # allocated at the last peak_reset: the model, plus whatever this script keeps (captured blocks)


def peak_gib(weight_bytes=0):
    """Peak of a process holding only the model: its weights plus the peak above what was live at the reset."""
    if DEVICE.type != "cuda":
        return None
    return gib(weight_bytes + torch.cuda.max_memory_allocated() - LIVE_BYTES)


def similarity(actual, expected):
    a, e = actual.float().flatten(), expected.float().flatten()
    return float((a - e).norm() / e.norm()), float(torch.nn.functional.cosine_similarity(a, e, dim=0))


def compare(actual, expected):
    """Relative L2 error and cosine similarity of (video, audio) velocities, both flattened together."""
    rel_err, cos = similarity(torch.cat([t.flatten() for t in actual]), torch.cat([t.flatten() for t in expected]))
    return dict(rel_err=rel_err, cos=cos, video_rel_err=similarity(actual[0], expected[0])[0],
                audio_rel_err=similarity(actual[1], expected[1])[0])


def forward_flop(config, seq_len):
    inner = config["num_attention_heads"] * config["attention_head_dim"]
    hidden, ffn, layers = config["hidden_size"], config["ffn_dim"], config["num_layers"]
    linear = layers * 2 * seq_len * (hidden * inner * 4 + 3 * hidden * ffn)
    return linear + layers * 4 * seq_len * seq_len * inner


def schedule_timesteps(steps=50, video_shift=12.0, audio_shift=3.0):
    """t = 1 - sigma for every forward of a shifted rectified-flow schedule (terminal point excluded)."""
    sigma = torch.linspace(1.0, 0.0, steps)[:-1]
    shifted = lambda s: s * sigma / (1 + (s - 1) * sigma)
    return 1 - shifted(video_shift), 1 - shifted(audio_shift)


def layout_inputs(config, step=10):
    from diffusers.modular_pipelines.minimax_h3.before_denoise import (MiniMaxH3PrepareLayoutStep,
                                                                       MiniMaxH3SetTimestepsStep)
    n = LAYOUT
    positions, tags, video_idx, audio_idx, text_idx, cond_video, cond_audio = (
        MiniMaxH3PrepareLayoutStep.build_packed_sequence(torch.ones(n["text"], dtype=torch.long), n["frames"],
                                                         n["height"], n["width"], n["audio"], (1, 2, 2), 2, 2, 0, ()))
    video_t, audio_t = schedule_timesteps()
    timestep, timestep_indices = MiniMaxH3SetTimestepsStep.build_row_timesteps(
        video_idx, audio_idx, cond_video, cond_audio, n["text"], float(video_t[step]), float(audio_t[step]), 1.0, 1.0)
    g = torch.Generator(DEVICE).manual_seed(0)
    patch_dim = config["in_channels"] * 4
    inputs = dict(
        hidden_states=torch.randn(1, video_idx.numel(), patch_dim, device=DEVICE, generator=g),
        audio_hidden_states=torch.randn(1, audio_idx.numel(), config["audio_in_channels"], device=DEVICE, generator=g),
        encoder_hidden_states=torch.randn(1, n["text"], config["text_dim"], device=DEVICE, generator=g,
                                          dtype=torch.bfloat16),
        timestep=timestep, timestep_indices=timestep_indices, token_tags=tags, position_ids=positions.float(),
        video_indices=video_idx, audio_indices=audio_idx, text_indices=text_idx)
    # The AdaLN table's groups as the sampler builds them: each forward's distinct timesteps, in a batch of their own.
    groups = tuple(torch.unique(torch.tensor([float(v), float(a)])) for v, a in zip(video_t, audio_t))
    return {k: v.to(DEVICE) for k, v in inputs.items()}, groups


def full_size_config() -> dict:
    """diffusers' MiniMaxH3Transformer3DModel config as its constructor's defaults give it: the full-size DiT."""
    import inspect

    from diffusers import MiniMaxH3Transformer3DModel

    return {k: p.default for k, p in inspect.signature(MiniMaxH3Transformer3DModel.__init__).parameters.items()
            if p.default is not inspect.Parameter.empty}


def draw_random_(data, name, generator):
    """Fill `data`, the parameter `name`, with normal random values and no zeros: norm weights N(1, 0.1), the rest
    N(0, 0.02)."""
    is_norm_weight = "norm" in name and data.ndim == 1
    return data.normal_(1.0 if is_norm_weight else 0.0, 0.1 if is_norm_weight else 0.02, generator=generator)


def random_reference(config):
    """diffusers' model at `config`, bf16 with the fp32 modules fp32, normal random weights (no zeros anywhere)."""
    from diffusers import MiniMaxH3Transformer3DModel

    from h3gen.models.dit.blocks import rotary_inv_freq
    from h3gen.models.dit.checkpoint import is_fp32_key

    with torch.device("meta"):
        model = MiniMaxH3Transformer3DModel(**config)
    g = torch.Generator(DEVICE).manual_seed(1234)
    # Parameter by parameter straight from meta: `to_empty` would first allocate every weight in fp32 (123 GiB).
    for module_name, module in model.named_modules():
        for name, param in list(module._parameters.items()):
            if param is None:
                continue
            full_name = f"{module_name}.{name}" if module_name else name
            dtype = torch.float32 if is_fp32_key(full_name) else torch.bfloat16
            data = draw_random_(torch.empty(param.shape, device=DEVICE, dtype=dtype), full_name, g)
            module._parameters[name] = torch.nn.Parameter(data, requires_grad=False)
    model.rope.inv_freq = rotary_inv_freq(model.rope.rope_freq_dim, model.config.rope_theta).to(DEVICE)
    return model.eval().requires_grad_(False)


def warm_then_time(model, inputs, call, capture=None):
    """One forward through the first two blocks (JIT, autotune, compile), then one timed full forward: its output,
    seconds and `GpuClocks` summary. With `capture` (a dict), the warm-up records each of those blocks' input and
    output for `block_parity`."""
    blocks = model.transformer_blocks
    model.transformer_blocks = blocks[:2]
    hooks = []
    if capture is not None:
        for index, block in enumerate(model.transformer_blocks):
            record = lambda module, args, out, index=index: capture.__setitem__(index, (args[0].clone(), out.clone()))
            hooks.append(block.register_forward_hook(record))
    try:
        timed(lambda: call(model, inputs))
    finally:
        model.transformer_blocks = blocks
        for hook in hooks:
            hook.remove()
    peak_reset()
    with GpuClocks() as clocks:
        out, seconds = timed(lambda: call(model, inputs))
    return out, seconds, clocks.summary


def phase_kernels():
    from h3gen.kernels import (gated_residual, head_amax, qk_norm_rope, qk_norm_rope_fp8, quantize_rows,
                               rmsnorm_modulate, swiglu)
    from h3gen.models.dit.blocks import rotary_angles, rotary_inv_freq

    def bench(fn):
        fn()
        _, seconds = timed(lambda: [fn() for _ in range(5)])
        return round(seconds / 5 * 1e3, 3)

    hidden, heads, seq_len = (64, 2, 40) if TINY else (5376, 56, 73642)
    g = torch.Generator(DEVICE).manual_seed(0)
    rnd = lambda *shape: torch.randn(*shape, device=DEVICE, generator=g).to(torch.bfloat16)
    x, y = rnd(1, seq_len, hidden), rnd(1, seq_len, hidden)
    weight = 1 + 0.1 * rnd(hidden)
    table, rows = 0.5 * rnd(6, 6 * hidden), torch.randint(0, 6, (seq_len,), device=DEVICE)
    cos, sin = rotary_angles(torch.randint(0, 300, (seq_len, 3), device=DEVICE), rotary_inv_freq(16, 1e4).to(DEVICE))
    qkv = rnd(1, seq_len, 3 * heads * 128)
    cases = {
        "rmsnorm_modulate": (rmsnorm_modulate, (x, weight, 1e-5, table, rows, 3, 4)),
        "gated_residual": (gated_residual, (x, y, table, rows, 5)),
        "swiglu": (swiglu, (rnd(1, seq_len, 2 * (128 if TINY else 14336)),)),
        "qk_norm_rope": (qk_norm_rope, (qkv, heads, 1 + 0.1 * rnd(128), 1 + 0.1 * rnd(128), 1e-5, cos, sin)),
        # the FFN's down projection input, the widest rows FP8 linears quantize
        "quantize_rows": (quantize_rows, (rnd(seq_len, 128 if TINY else 14336),)),
        # the norm straight to an FP8 linear's rows, against the norm then quantize_rows
        "rmsnorm_modulate_quantized": (rmsnorm_modulate, (x, weight, 1e-5, table, rows, 3, 4)),
        # v's per-head scale for fa3-fp8, on its strided view of the projection
        "head_amax": (head_amax, (qkv[..., 2 * heads * 128:].unflatten(-1, (heads, 128)),)),
        "qk_norm_rope_fp8": (qk_norm_rope_fp8, (qkv, heads, 1 + 0.1 * rnd(128), 1 + 0.1 * rnd(128), 1e-5, cos, sin)),
    }
    for name, (module, case_args) in cases.items():
        fast, ref = getattr(module, name), getattr(module, f"{name}_reference")
        actual, expected = fast(*case_args), ref(*case_args)
        actual, expected = (actual, expected) if isinstance(actual, tuple) else ((actual,), (expected,))
        err = max(float((a.float() - e.float()).abs().max() / e.float().abs().max()) for a, e in zip(actual, expected))
        differing = sum(int((a != e).sum()) for a, e in zip(actual, expected)) / sum(e.numel() for e in expected)
        log(f"kernel_{name}", dict(max_rel_err=err, differing_fraction=differing, triton_ms=bench(lambda: fast(*case_args)),
                                   torch_ms=bench(lambda: ref(*case_args))))
    if DEVICE.type == "cuda":
        # the video decoder's Q/K: a batch of 16 tiles of 1797 tokens, 32 heads of 64, float32 norm weight of ones
        decoder_qk = (rnd(1, 16 * 1797, 3 * 2048), 32, torch.ones(64, device=DEVICE), torch.ones(64, device=DEVICE),
                      1e-5, *(t.float() for t in rnd(2, 16 * 1797, 48)))
        qk_norm_rope_launch_shapes(bench, {"dit": cases["qk_norm_rope"][1], "decoder": decoder_qk})
        qk_norm_rope_fp8_launch_shapes(bench, {"dit": cases["qk_norm_rope_fp8"][1], "decoder": decoder_qk})
        rmsnorm_modulate_launch_shapes(bench, cases["rmsnorm_modulate"][1])


def qk_norm_rope_launch_shapes(bench, cases):
    """The Q/K kernel's time per launch shape, and whether a shape changes any value: the shape decides the order
    Triton sums a head's squares in, so it is part of the kernel's numerics."""
    from h3gen.kernels.qk_norm_rope import qk_norm_rope_triton

    for label, args in cases.items():
        expected = qk_norm_rope_triton(*args)
        for heads_block in (8, 16, 32, 64):
            for warps in (2, 4, 8):
                run = lambda: qk_norm_rope_triton(*args, heads_block=heads_block, num_warps=warps)
                equal = all(torch.equal(a, e) for a, e in zip(run(), expected))
                log(f"qk_norm_rope_{label}_h{heads_block}w{warps}", dict(ms=bench(run), equal=equal))


def qk_norm_rope_fp8_launch_shapes(bench, cases):
    """The e4m3 Q/K/V kernel of fa3-fp8 per launch shape (rows and heads a program, warps), with the bytes it moves
    per second: it reads the whole projection in bf16 and v once more for its scale, and writes q, k and v once in
    e4m3; `equal` says whether a shape keeps the default's values."""
    from h3gen.kernels.qk_norm_rope_fp8 import SWEPT_LAUNCH_SHAPES, bytes_moved, qk_norm_rope_fp8_triton

    for label, args in cases.items():
        moved = bytes_moved(args[0])
        expected = qk_norm_rope_fp8_triton(*args)
        for rows, heads_block, warps in SWEPT_LAUNCH_SHAPES:
            run = lambda: qk_norm_rope_fp8_triton(*args, rows_block=rows, heads_block=heads_block, num_warps=warps)
            equal = all(torch.equal(a, e) for a, e in zip(run(), expected))
            ms = bench(run)
            log(f"qk_norm_rope_fp8_{label}_r{rows}h{heads_block}w{warps}",
                dict(ms=ms, tb_per_s=round(moved / ms / 1e9, 2), equal=equal))


def rmsnorm_modulate_launch_shapes(bench, args):
    """The modulated norm per warp count, bf16 and straight to FP8 rows: the warps set the order a row's squares
    are summed in, so `equal` says whether a count keeps the default's values."""
    from h3gen.kernels.rmsnorm_modulate import rmsnorm_modulate_quantized_triton, rmsnorm_modulate_triton

    outputs = lambda result: result if isinstance(result, tuple) else (result,)
    for name, fn in (("bf16", rmsnorm_modulate_triton), ("fp8", rmsnorm_modulate_quantized_triton)):
        expected = outputs(fn(*args))
        for warps in (4, 8, 16):
            run = lambda: fn(*args, num_warps=warps)
            equal = all(torch.equal(a, e) for a, e in zip(outputs(run()), expected))
            log(f"rmsnorm_modulate_{name}_w{warps}", dict(ms=bench(run), equal=equal))


def phase_attention():
    from h3gen.kernels.attention import BACKENDS, attention, backend_name

    seq_len = 300 if TINY else 73642
    q, k, v = torch.randn(3, 1, seq_len, 56, 128, device=DEVICE, dtype=torch.bfloat16).unbind(0)
    log("attention_auto_backend", backend_name(DEVICE))
    expected = None
    for name in BACKENDS:
        if TINY and name != "sdpa":
            continue
        try:
            out, first = timed(lambda: attention(q, k, v, name))
            _, seconds = timed(lambda: attention(q, k, v, name))
            expected = out if expected is None else expected
            log(f"attention_{name}", dict(seconds=round(seconds, 4), first_call_s=round(first, 2),
                                          tflops=attention_tflops(seq_len, seconds),
                                          rel_err_vs_first=float((out.float() - expected.float()).norm()
                                                                 / expected.float().norm())))
        except Exception as exc:  # an optional backend may be missing on this machine
            log(f"attention_{name}_error", repr(exc)[:300])
    # As the model hands them over: q, k, v strided views of one fused projection (rows 3 x 56 x 128 apart), which
    # attention alone on three contiguous tensors does not see.
    packed = torch.cat([q.flatten(2), k.flatten(2), v.flatten(2)], dim=-1)  # (1, L, 3 * 7168), as to_qkv writes it
    views = [packed[..., i * 7168:(i + 1) * 7168].unflatten(-1, (56, 128)) for i in range(3)]
    for name in ("fa3", "flash-attn-4", "sdpa-cudnn") if DEVICE.type == "cuda" else ():
        try:
            log(f"attention_{name}_model_layout", attention_row(lambda: attention(*views, name), expected, seq_len))
        except Exception as exc:
            log(f"attention_{name}_model_layout_error", repr(exc)[:300])
    if DEVICE.type == "cuda":
        sustained_attention(q, k, v, seq_len)
        flash_attn_4_options(q, k, v, expected)
        fp8_attention_configs(q, k, v, expected)
        cudnn_fp8_plans(q, k, v, expected)


def attention_tflops(seq_len, seconds):
    """TFLOP/s of one attention call over 56 heads of 128 at `seq_len` rows."""
    return round(4 * seq_len**2 * 56 * 128 / seconds / 1e12, 1)


def sustained_attention(q, k, v, seq_len, calls=50):
    """`calls` back-to-back calls per backend, as the 50 blocks of a forward make them (without the GEMMs between),
    with the clock they ran at: the per-call time a forward can expect, against one call from an idle GPU."""
    from h3gen.kernels.attention import attention

    for name in ("fa3", "fa3-fp8"):
        try:
            timed(lambda: attention(q, k, v, name))
            with GpuClocks() as clocks:
                _, seconds = timed(lambda: [attention(q, k, v, name) for _ in range(calls)])
            per_call = seconds / calls
            log(f"attention_{name}_sustained", dict(calls=calls, seconds_per_call=round(per_call, 4),
                                                    tflops=attention_tflops(seq_len, per_call),
                                                    clocks=clocks.summary))
        except Exception as exc:
            log(f"attention_{name}_sustained_error", repr(exc)[:300])


def attention_row(run, expected, seq_len):
    out, first = timed(run)
    _, seconds = timed(run)
    return dict(seconds=round(seconds, 4), first_call_s=round(first, 2),
                tflops=attention_tflops(seq_len, seconds),
                rel_err_vs_first=float((out.float() - expected.float()).norm() / expected.float().norm()))


def flash_attn_4_options(q, k, v, expected):
    """flash-attn-4's Hopper forward per tile shape and MMA flags; the fastest the `fast` phase's options variant
    uses."""
    try:
        from flash_attn.cute.interface import _flash_attn_fwd
    except Exception:
        return
    best = (results.get("attention_flash-attn-4", {}).get("seconds", float("inf")), None)
    tiles = ((128, 128), (128, 176), (128, 144), (128, 160), (192, 128))
    for tile, rs, overlap in [(t, True, True) for t in tiles] + [((128, 128), False, True), ((128, 128), True, False),
                                                                 ((128, 176), False, True)]:
        options = dict(tile_mn=tile, mma_pv_is_rs=rs, intra_wg_overlap=overlap)
        name = f"attention_flash-attn-4_tile{tile[0]}x{tile[1]}{'' if rs else '_noRS'}{'' if overlap else '_noOL'}"
        try:
            row = attention_row(lambda: _flash_attn_fwd(q, k, v, **options)[0], expected, q.shape[1])
            log(name, row)
            best = min(best, (row["seconds"], options), key=lambda pair: pair[0])
        except Exception as exc:
            log(f"{name}_error", repr(exc)[:300])
    log("flash_attn_4_best_options", best[1])


def fp8_attention_configs(q, k, v, expected):
    """The Triton FP8 kernel per launch configuration, and the quantization it includes, on its own."""
    from h3gen.kernels import attention_fp8

    seq_len = q.shape[1]
    _, seconds = timed(lambda: attention_fp8.quantize(q, k, v))
    log("attention_fp8_quantize", dict(seconds=round(seconds, 4)))
    for block_m, block_n, warps, stages in ((128, 128, 8, 3), (128, 64, 8, 3), (128, 64, 4, 4), (64, 128, 4, 3)):
        name = f"attention_triton-fp8_m{block_m}n{block_n}w{warps}s{stages}"
        try:
            log(name, attention_row(lambda: attention_fp8.attention_fp8_triton(
                q, k, v, block_m=block_m, block_n=block_n, num_warps=warps, num_stages=stages), expected, seq_len))
        except Exception as exc:
            log(f"{name}_error", repr(exc)[:300])


def cudnn_fp8_plans(q, k, v, expected):
    """Every execution plan cuDNN's heuristics offer for the FP8 SDPA graph (the backend runs the first), each timed
    alone on the quantized inputs, with its output's error."""
    from h3gen.kernels import attention_cudnn_fp8 as fp8

    if fp8.cudnn_module() is None:
        return
    quantized = [fp8.quantize_tensor(t) for t in (q, k, v)]
    graph = fp8._graph(q.shape[0], q.shape[2], q.shape[1], q.shape[3], q.device.index)
    out = torch.empty(q.shape, dtype=fp8.FP8, device=q.device)
    pack = graph.variant_pack(*(t for t, _ in quantized), [s for _, s in quantized], out)
    count = graph.graph.get_execution_plan_count()
    log("attention_cudnn-fp8_plans", count)
    for index in range(count):
        name = f"attention_cudnn-fp8_plan{index}"
        try:
            graph.graph.build_plan_at_index(index)
            workspace = torch.empty(graph.graph.get_workspace_size_plan_at_index(index), dtype=torch.uint8,
                                    device=q.device)

            def run():
                graph.graph.execute_plan_at_index(pack, workspace, index, handle=graph.handle)
                return out.to(q.dtype).mul_(quantized[2][1])

            row = attention_row(run, expected, q.shape[1])
            row["plan"] = graph.graph.get_plan_name_at_index(index)
            log(name, row)
        except Exception as exc:
            log(f"{name}_error", repr(exc)[:300])


def run_reference(config, inputs, time_forwards):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model = random_reference(config)
    log("reference_params_B", round(sum(p.numel() for p in model.parameters()) / 1e9, 2))
    log("reference_weights_GiB", gib(sum(p.numel() * p.element_size() for p in model.parameters())))
    flop = forward_flop(config, inputs["position_ids"].shape[0])
    outputs = {}
    if not time_forwards:
        return model, outputs
    # diffusers against itself with another attention kernel: the spread a correct bf16 forward has on these weights.
    variants = [("diffusers", None)] if TINY else [("diffusers", None), ("diffusers_cudnn", SDPBackend.CUDNN_ATTENTION),
                                                   ("diffusers_flash", SDPBackend.FLASH_ATTENTION)]
    for name, backend in variants:
        if ONLY and name not in ONLY:
            continue
        def call(m, kw, backend=backend):
            if backend is None:
                return m(**kw, return_dict=False)
            with sdpa_kernel([backend]):
                return m(**kw, return_dict=False)
        with torch.no_grad():
            out, seconds, clocks = warm_then_time(model, inputs, call, BLOCK_IO if name == "diffusers" else None)
        outputs[name] = out
        row = dict(seconds=round(seconds, 2), tflops=round(flop / seconds / 1e12, 1),
                   peak_GiB=peak_gib(sum(p.numel() * p.element_size() for p in model.parameters())),
                   weights_GiB=results["reference_weights_GiB"], attention=str(backend.name).lower() if backend else "sdpa",
                   clocks=clocks)
        if name != "diffusers" and "diffusers" in outputs:
            row.update(compare(out, outputs["diffusers"]))
        log(name, row)
    return model, outputs


def run_fast(config, inputs, schedule, reference, outputs):
    from h3gen.models.dit.transformer import FastH3Transformer

    flop = forward_flop(config, inputs["position_ids"].shape[0])
    model, seconds = timed(lambda: FastH3Transformer.from_reference(reference, use_triton=False, adaln_table=False))
    peak_reset()
    log("fast_from_reference_s", round(seconds, 1))
    cudnn = "sdpa" if TINY else "sdpa-cudnn"
    try:
        import flash_attn.cute  # noqa: F401
        fa4 = "sdpa" if TINY else "flash-attn-4"
    except Exception as exc:
        log("flash_attn_4_unavailable", repr(exc)[:200])
        fa4 = None
    variants = [("fused", dict(use_triton=False, adaln_table=False, attention_backend=cudnn)),
                ("fused+triton", dict(use_triton=True, adaln_table=False, attention_backend=cudnn)),
                "precompute",
                ("fused+triton+table", dict(use_triton=True, adaln_table=True, attention_backend=cudnn))]
    # Norm statistics from torch: with diffusers' own attention pick the forward should be bit-equal to diffusers'.
    variants.append(("table+sdpa+exact-norms", dict(use_triton=True, adaln_table=True, attention_backend="sdpa",
                                                    exact_norms=True)))
    if fa4:
        variants.append(("fused+triton+table+fa4", dict(use_triton=True, adaln_table=True, attention_backend=fa4)))
        variants.append(("table+fa4+exact-norms", dict(use_triton=True, adaln_table=True, attention_backend=fa4,
                                                       exact_norms=True)))
        if results.get("flash_attn_4_best_options"):
            variants += ["fa4-best-options", ("table+fa4-best-options", dict(use_triton=True, adaln_table=True,
                                                                              attention_backend=fa4))]
    from h3gen.kernels.attention import choose_backend

    fa3 = None if TINY or choose_backend(DEVICE, "fa3").fallback_reason else "fa3"
    if fa3:  # FlashAttention-3 (fa3-fwd): auto's pick on Hopper when installed
        variants.append(("table+fa3", dict(use_triton=True, adaln_table=True, attention_backend=fa3)))
    best_attention = fa3 or fa4 or cudnn
    # FP8 attention on bf16 linears, then FP8 linears (the swap is for good: these come after every bf16 variant).
    fp8_attention = ["triton-fp8"] + ([] if TINY else ["cudnn-fp8"]) + (["fa3-fp8"] if fa3 else [])
    variants += [(f"table+{name}", dict(use_triton=True, adaln_table=True, attention_backend=name))
                 for name in fp8_attention]
    # FP8 runs as the FP8 presets do: the feed-forward over 16k-row passes, for the memory budget.
    chunk = 8 if TINY else 16384
    # First all FP8 linears but the feed-forward's down projection (with fast accumulation, as the FP8 presets run):
    # kept in bf16 it takes a block's FP8 error from 5.3e-2 to 4.4e-2 (bench/fp8_block_error.py, one full-width block
    # on the CPU). Then the down projections too, every FP8 linear back to exact accumulation.
    variants += ["fp8-linears-but-down", (f"fp8-but-down+fast-accum+table+{best_attention}", dict(
        use_triton=True, adaln_table=True, attention_backend=best_attention, ffn_chunk_rows=chunk))]
    variants += ["fp8-linears", (f"fp8+table+{best_attention}", dict(use_triton=True, adaln_table=True,
                                                                       attention_backend=best_attention,
                                                                       ffn_chunk_rows=chunk))]
    variants += [(f"fp8+table+{name}", dict(use_triton=True, adaln_table=True, attention_backend=name,
                                            ffn_chunk_rows=chunk)) for name in fp8_attention]
    # The same FP8 linears with scaled_mm's fast accumulation.
    variants += ["fp8-fast-accum"] + [(f"fp8+fast-accum+table+{name}", dict(use_triton=True, adaln_table=True,
                                                                            attention_backend=name, ffn_chunk_rows=chunk))
                                      for name in (best_attention, fp8_attention[-1])]
    if not TINY:  # inductor on the CPU needs a C++ toolchain; the dry run skips compilation
        variants += [("compile+table", dict(use_triton=False, compile_blocks=True, attention_backend=best_attention)),
                     ("compile+triton+table", dict(use_triton=True, attention_backend=best_attention))]
    for variant in variants:
        if variant == "precompute":
            _, seconds = timed(lambda: model.precompute_adaln(schedule))
            log("adaln_precompute", dict(seconds=round(seconds, 2), timesteps=int(model.adaln_timesteps.numel()),
                                         weights_GiB=gib(model.resident_bytes()),
                                         table_GiB=gib(sum(b.adaln_table.numel() * 2 for b in model.transformer_blocks))))
            continue
        if variant == "fa4-best-options":
            from h3gen.kernels import attention as attention_module

            attention_module.FLASH_ATTN_4_OPTIONS.update(results["flash_attn_4_best_options"])
            attention_module._flash_attn_4.cache_clear()
            continue
        if variant == "fp8-fast-accum":
            from h3gen.models.quant_linear import FP8RowwiseLinear

            for module in model.modules():
                if isinstance(module, FP8RowwiseLinear):
                    module.fast_accum = True
            continue
        if variant == "fp8-linears-but-down":
            if not ONLY or any(name.startswith("fp8") for name in ONLY):
                swap_fp8_linears(model, skip={"down"}, fast_accum=True)
            continue
        if variant == "fp8-linears":
            if not ONLY or any(name.startswith("fp8+") for name in ONLY):
                swap_fp8_linears(model)
            continue
        name, switches = variant
        if ONLY and name not in ONLY:
            if switches.get("compile_blocks"):  # later variants assume the blocks are compiled
                model.configure(compile_blocks=True)
            continue
        try:
            model.configure(**{"exact_norms": False, **switches})
            out, seconds, clocks = warm_then_time(model, inputs, lambda m, kw: m(**kw))
            row = dict(seconds=round(seconds, 2), tflops=round(flop / seconds / 1e12, 1),
                       peak_GiB=peak_gib(model.resident_bytes()),
                       weights_GiB=gib(model.resident_bytes()), attention=model.attention_used(),
                       clocks=clocks)
            row.update(block_parity(model, inputs))
            for ref_name, ref_out in outputs.items():
                row.update({f"{k}_vs_{ref_name}": v for k, v in compare(out, ref_out).items()
                            if k in ("rel_err", "cos") or ref_name == "diffusers"})
            log(name, row)
            if "profile" in PHASES and name in PROFILE:
                profile_forward(model, inputs, name)
        except Exception as exc:
            import traceback
            traceback.print_exc()
            log(f"{name}_error", repr(exc)[:400])


def swap_fp8_linears(model, skip=(), fast_accum=False):
    """The DiT blocks' remaining bf16 linears but those named in `skip` become FP8; every FP8 linear then accumulates
    as `fast_accum` says."""
    from h3gen.stages.quant import SCOPES
    from h3gen.models.quant_linear import FP8RowwiseLinear, swap_linears

    matmul = "reference" if TINY else "scaled_mm"
    _, seconds = timed(lambda: swap_linears(model, lambda linear: FP8RowwiseLinear.from_linear(linear, matmul),
                                            SCOPES["dit"], set(skip)))
    for module in model.modules():
        if isinstance(module, FP8RowwiseLinear):
            module.fast_accum = fast_accum
    peak_reset()
    log("fp8_linears", dict(seconds=round(seconds, 1), weights_GiB=gib(model.resident_bytes())))


def profile_forward(model, inputs, label):
    """The CUDA kernels of one forward, by total time: where the seconds beyond matmuls and attention go."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA if DEVICE.type == "cuda" else ProfilerActivity.CPU]) as prof:
        _, seconds = timed(lambda: model(**inputs))
    rows = sorted(prof.key_averages(), key=lambda e: e.device_time_total, reverse=True)
    total = sum(e.device_time_total for e in rows)
    top = [dict(kernel=e.key[:90], ms=round(e.device_time_total / 1e3, 1), calls=e.count) for e in rows[:25]]
    log(f"profile_{label}", dict(total_ms=round(total / 1e3, 1), wall_ms=round(seconds * 1e3, 1), top=top))
    log(f"gaps_{label}", idle_gaps(prof))


def idle_gaps(prof, largest=12):
    """Where the device sat idle inside the forward: the time between one kernel's end (the latest end so far) and
    the next kernel's start, with the kernels on either side of the largest gaps."""
    from torch.autograd import DeviceType

    kernels = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                     if e.device_type == DeviceType.CUDA)
    if not kernels:
        return {}
    gaps, reach, last = [], kernels[0][1], kernels[0][2]
    for start, end, name in kernels[1:]:
        if start > reach:
            gaps.append((start - reach, last, name))
        if end >= reach:
            reach, last = end, name
    gaps.sort(reverse=True)
    return dict(span_ms=round((reach - kernels[0][0]) / 1e3, 1), idle_ms=round(sum(g[0] for g in gaps) / 1e3, 1),
                gaps=len(gaps), over_1ms=sum(g[0] > 1e3 for g in gaps),
                largest=[dict(ms=round(g / 1e3, 2), after=a[:70], before=b[:70]) for g, a, b in gaps[:largest]])


def block_parity(model, inputs):
    """Each captured diffusers block against the fast model's block on the same input."""
    from h3gen.models.dit.blocks import rotary_angles

    index, from_table = model.adaln_index(inputs["timestep"], inputs["timestep_indices"], inputs["token_tags"])
    cos, sin = rotary_angles(inputs["position_ids"], model.rope_inv_freq)
    temb = model.time_embedder(inputs["timestep"])
    row = {}
    for k, (hidden, expected) in BLOCK_IO.items():
        block = model.transformer_blocks[k]
        out = block(hidden, block.adaln_table if from_table else block.adaln_rows(temb), index, cos, sin)
        row[f"block{k}_rel_err"], row[f"block{k}_cos"] = similarity(out, expected)
    return row


def print_table():
    print(f"\n{'variant':28s} {'s/fwd':>7s} {'TFLOP/s':>8s} {'attention':>13s} {'peak GiB':>9s} {'weights':>8s} "
          f"{'rel err':>9s} {'cos':>9s}", flush=True)
    for name, row in results.items():
        if isinstance(row, dict) and "seconds" in row and "tflops" in row and "peak_GiB" in row:
            rel = row.get("rel_err_vs_diffusers", row.get("rel_err", float("nan")))
            cos = row.get("cos_vs_diffusers", row.get("cos", float("nan")))
            print(f"{name:28s} {row['seconds']:7.2f} {row['tflops']:8.1f} {row['attention']:>13s} "
                  f"{str(row['peak_GiB']):>9s} {row['weights_GiB']:8.2f} {rel:9.2e} {cos:9.6f}", flush=True)


def main():
    log("device", torch.cuda.get_device_name(0) if DEVICE.type == "cuda" else "cpu")
    log("versions", dict(torch=torch.__version__, triton=__import__("triton").__version__,
                         diffusers=__import__("diffusers").__version__))
    config = full_size_config() | (TINY_CONFIG if TINY else {})
    torch.set_grad_enabled(False)
    if "kernels" in PHASES:
        phase_kernels()
    if "attn" in PHASES:
        phase_attention()
    inputs, schedule = layout_inputs(config)
    log("seq_len", int(inputs["position_ids"].shape[0]))
    log("forward_pflop", round(forward_flop(config, inputs["position_ids"].shape[0]) / 1e15, 3))
    if "ref" in PHASES or "fast" in PHASES:
        reference, outputs = run_reference(config, inputs, time_forwards="ref" in PHASES)
    if "fast" in PHASES:
        run_fast(config, inputs, schedule, reference, outputs)
    print_table()
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
