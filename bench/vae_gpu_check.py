"""Full-size MiniMax-H3 video VAE decode on one GPU: diffusers' decode against h3gen's `fast` stage, random weights.

Usage (diffusers importable; h3gen installed):
    python3 bench/vae_gpu_check.py -o vae_gpu_check.json [--tiny] [--only=NAME,...] [--profile=NAME,...]
Builds AutoencoderKLMiniMaxH3 at full size (2.6 B params, bf16 with the checkpoint's fp32 islands) with random
weights, decodes random latents of the 10 s 1344x768 clip (1, 24, 72, 48, 84), and for each variant prints and
records: seconds from latents to uint8 frames in host memory, peak GPU memory, and the max / mean absolute
difference of its uint8 frames from diffusers' (`diffusers` as the reference stage runs it). It also times the
uint8 conversion + device-to-host copy alone (Triton kernel into pinned memory against the torch reference) and
checks the kernel's uint8 values equal the reference's. A failing variant (out of memory, say) is recorded and the
run goes on; variants are skipped once the run nears 5 minutes. --tiny runs a tiny config on the CPU as a dry run.
"""
import argparse
import json
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

import torch

BUDGET_S = 260  # variants still to run are skipped past this, so the whole run stays under 5 minutes

# Full size per the model card / diffusers 0.42.1 defaults: 16x spatial, 4x temporal, 24 latent channels, CNN
# encoder, ViT decoder of 36 layers with 32 heads of 64.
FULL_VAE = dict(in_channels=3, out_channels=3, latent_channels=24, block_out_channels=(128, 256, 256, 512, 512, 1024),
                layers_per_block=2, spatial_downsample_factors=(2, 2, 2, 2, 1, 1),
                temporal_downsample_factors=(1, 2, 2, 1, 1, 1), decoder_num_layers=36, decoder_num_attention_heads=32,
                decoder_attention_head_dim=64, decoder_num_register_tokens=4, decoder_ffn_mult=4, clip_length=17,
                token_drop=3)
# core/tiny.py's video VAE with two decoder layers.
TINY_VAE = dict(block_out_channels=(8, 8, 8, 8, 8, 8), layers_per_block=1, norm_num_groups=4, decoder_num_layers=2,
                decoder_num_attention_heads=2, decoder_attention_head_dim=16)
FULL_LATENTS, TINY_LATENTS = (1, 24, 72, 48, 84), (1, 24, 12, 20, 22)
FULL_PARAMS = 2.6e9

# name -> FastVAE config; "diffusers" is the reference and always runs first.
VARIANTS = {
    "exact": dict(exact=True),
    "fast-b4": dict(tile_batch=4),
    "fast-b8": dict(tile_batch=8),
    "fast-b16": dict(tile_batch=16),
    "fast-auto": dict(),
    "fast-fused-norms": dict(exact_norms=False),
    "fast-fused-norms-auto": dict(exact_norms=False, attention="auto"),
    "fast-b8-sdpa-flash": dict(tile_batch=8, attention="sdpa-flash"),
    "fast-b8-compile": dict(tile_batch=8, compile=True, exact_norms=False),
    "fast-auto-fa4": dict(attention="flash-attn-4"),
    "fast-b8-tile320": dict(tile_batch=8, tile_height=320, tile_width=320),
    "fast-b8-tile256x384": dict(tile_batch=8, tile_height=256, tile_width=384),
    # FP8 linears in the decoder blocks (the quant stage with roles = ["vae"]): a stated tolerance, not diffusers'.
    "fast-fp8": dict(fp8={}, exact_norms=False),
    "fast-fp8-exact-norms": dict(fp8={}),
    "fast-fp8-fast-accum": dict(fp8=dict(fast_accum=True), exact_norms=False),
}
# The FP8 presets' decoder on other tilings, overlaps kept at diffusers' 64 px: fewer, larger tiles recompute less of
# the overlaps (GEMM work scales with the tokens, attention with the tokens squared per tile). 240 px rows cover the
# 768 px frame in 4 tiles with no slack; diffusers' 256 x 256 tiles cut the 1344 x 768 frame into 28 per chunk.
VARIANTS.update({f"fast-fp8-fast-accum-tile{height}x{width}": dict(fp8=dict(fast_accum=True), exact_norms=False,
                                                                     tile_height=height, tile_width=width)
                 for height, width in ((240, 320), (240, 224), (240, 384), (304, 320), (304, 224))})
# The same decoder with cuDNN's FP8 attention on its 64-wide heads (attention was 1.33 s of its 4.83 s).
VARIANTS["fast-fp8-fast-accum-cudnn-fp8"] = dict(fp8=dict(fast_accum=True), exact_norms=False, attention="cudnn-fp8")
# FlashAttention-3 there, bf16 and FP8 (fa3-fwd takes 64-wide heads).
VARIANTS.update({f"fast-fp8-fast-accum-{backend}": dict(fp8=dict(fast_accum=True), exact_norms=False, attention=backend)
                 for backend in ("fa3", "fa3-fp8")})
# The FP8 presets' decoder at more tiles a forward than 16 (392 tiles at the 10 s clip = 14 x 28 = 8 x 49).
VARIANTS.update({f"fast-fp8-fast-accum-fa3-fp8-b{n}": dict(VARIANTS["fast-fp8-fast-accum-fa3-fp8"], tile_batch=n)
                 for n in (28, 49)})
TINY_VARIANTS = {"exact": dict(exact=True, tile_batch=1), "fast-b3": dict(tile_batch=3),
                 "fast-fused-norms": dict(exact_norms=False), "fast-fp8": dict(fp8={}, exact_norms=False),
                 "fast-auto": dict(), "fast-b4-tile128": dict(tile_batch=4, tile_height=128, tile_width=128,
                                                             overlap=32)}




class Bench:
    def __init__(self, args):
        self.tiny, self.out = args.tiny, Path(args.output)
        self.device = torch.device("cpu" if self.tiny else "cuda")
        self.dtype = torch.float32 if self.tiny else torch.bfloat16
        self.began = time.perf_counter()
        self.results = {"variants": {}}
        self.first_frames = None  # (variant, frames) of the first variant run

    def record(self, key, value, variant=None):
        place = self.results["variants"].setdefault(variant, {}) if variant else self.results
        place[key] = value
        print(f"[{time.perf_counter() - self.began:6.1f}s] {variant + ' ' if variant else ''}{key}: "
              f"{json.dumps(value)}", flush=True)
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.write_text(json.dumps(self.results, indent=1))

    def sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def timed(self, fn):
        self.sync()
        start = time.perf_counter()
        out = fn()
        self.sync()
        return out, time.perf_counter() - start

    def reset_peak(self):
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()

    def peak_gib(self):
        return round(torch.cuda.max_memory_allocated() / 2**30, 2) if self.device.type == "cuda" else 0.0


def build_vae(bench):
    """Full-size (or tiny) AutoencoderKLMiniMaxH3 with random weights, on the device, fp32 where the checkpoint is."""
    from diffusers import AutoencoderKLMiniMaxH3

    torch.manual_seed(1101)
    config = dict(TINY_VAE if bench.tiny else FULL_VAE, latents_mean=(torch.randn(24) * 0.1).tolist(),
                  latents_std=(1 + torch.rand(24) * 0.5).tolist())
    previous = torch.get_default_dtype()
    torch.set_default_dtype(bench.dtype)
    try:
        with torch.device(bench.device):
            vae = AutoencoderKLMiniMaxH3(**config).eval()
    finally:
        torch.set_default_dtype(previous)
    keep = set(AutoencoderKLMiniMaxH3._keep_in_fp32_modules)
    with torch.no_grad():
        for name, param in vae.named_parameters():
            if keep & set(name.split(".")):
                param.data = param.data.float()  # as from_pretrained keeps them
            # diffusers starts the residual scales and register tokens at zero: the decoder blocks would do nothing.
            if "scale" in name or "register" in name:
                param.normal_(0, 0.1)
    params = sum(p.numel() for p in vae.parameters())
    bench.record("vae_params", params)
    if not bench.tiny:
        assert abs(params - FULL_PARAMS) < 0.15 * FULL_PARAMS, f"{params / 1e9:.2f} B params, expected about 2.6 B"
    return vae


def denormalized(vae, latents):
    mean = torch.tensor(vae.config.latents_mean, device=latents.device).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std, device=latents.device).view(1, -1, 1, 1, 1)
    return (latents * std + mean).to(vae.dtype)


def diffusers_frames(vae, latents):
    """The reference stage's decode: diffusers' tiled decode, then the torch uint8 conversion, then the host copy."""
    from h3gen.kernels.frames import frames_reference
    from h3gen.models.vae.host_frames import PIXEL_MEAN, PIXEL_STD

    video = vae.decode(denormalized(vae, latents), return_dict=False)[0]
    mean, std = (torch.tensor(v, device=latents.device) for v in (PIXEL_MEAN, PIXEL_STD))
    return frames_reference(video[0], mean, std).cpu()


def run_reference(bench, vae, latents):
    bench.reset_peak()
    with torch.inference_mode():
        diffusers_frames(vae, latents[:, :, :7])  # warm up on one temporal chunk: the same tile shapes
        frames, seconds = bench.timed(lambda: diffusers_frames(vae, latents))
    bench.record("seconds", round(seconds, 3), "diffusers")
    bench.record("peak_gib", bench.peak_gib(), "diffusers")
    if bench.device.type == "cuda":
        # A render pins one clip's frames once and torch's host allocator hands the block back for every later
        # clip; allocate it here so the variants are timed as from the second clip on.
        _, pin_seconds = bench.timed(lambda: torch.empty(frames.shape, dtype=torch.uint8, pin_memory=True))
        bench.record("pin_first_clip_s", round(pin_seconds, 3))
    return frames


def frames_and_copy(bench, vae, latents):
    """uint8 + device-to-host of a decoded video alone: the reference's torch ops and `.cpu()` against the Triton
    kernel per 17-frame chunk into pinned memory; the kernel's values must equal the reference's."""
    from h3gen.kernels.frames import frames_reference, to_frames
    from h3gen.models.vae.host_frames import PIXEL_MEAN, PIXEL_STD

    with torch.inference_mode():
        video = vae.decode(denormalized(vae, latents[:, :, :12]), return_dict=False)[0][0]  # 39 frames
        mean, std = (torch.tensor(v, device=bench.device) for v in (PIXEL_MEAN, PIXEL_STD))
        expected, torch_seconds = bench.timed(lambda: frames_reference(video, mean, std).cpu())
        pinned = torch.empty(expected.shape, dtype=torch.uint8, pin_memory=bench.device.type == "cuda")

        def kernel():
            for start in range(0, video.shape[1], 17):
                pinned[start:start + 17].copy_(to_frames(video[:, start:start + 17], mean, std), non_blocking=True)

        kernel()
        _, kernel_seconds = bench.timed(kernel)
    per_clip = 243 / video.shape[1]
    bench.record("uint8_d2h", {"frames": video.shape[1], "torch_s": round(torch_seconds, 4),
                               "kernel_pinned_s": round(kernel_seconds, 4),
                               "torch_s_per_10s_clip": round(torch_seconds * per_clip, 3),
                               "kernel_pinned_s_per_10s_clip": round(kernel_seconds * per_clip, 3),
                               "mismatched_values": int((pinned != expected).sum())})


def fast_stage(bench, vae, config, decoders):
    from h3gen.run.render import Runtime
    from h3gen.stages.vae import FastVAE, FastVAEConfig
    from h3gen.models.vae.vit import FastViTDecoder
    from h3gen.run.timing import StageTimer

    config = dict(config)
    fp8 = config.pop("fp8", None)  # the fp8-rowwise quant stage's knobs, roles = ["vae"]
    if fp8 is not None:
        knobs, fp8 = fp8, f"fp8 {sorted(fp8.items())}"
        if fp8 not in decoders:
            decoders[fp8] = fp8_copy(vae, **knobs)
        vae = decoders[fp8]
    stage = FastVAE(FastVAEConfig(**config), Runtime(bench.device.type, bench.dtype, StageTimer(bench.device.type)))
    stage.vae = vae
    config = stage.config
    key = "exact" if config.exact else (config.attention, config.compile, config.exact_norms, fp8)
    if key not in decoders:  # one fused decoder per choice of its switches; its QKV weights are shared
        decoders[key] = ((lambda tiles: vae.decoder(vae.post_quant_conv(tiles))) if key == "exact"
                         else FastViTDecoder(vae, config.attention, config.compile, config.exact_norms))
    stage.decoder = decoders[key]
    return stage


def fp8_copy(vae, **knobs):
    """A copy of `vae` with its decoder blocks' linears quantized by the fp8-rowwise quant stage (roles = ["vae"],
    `knobs` its other config keys)."""
    import copy

    from h3gen.stages.quant import FP8Rowwise, FP8RowwiseConfig

    device = next(vae.parameters()).device
    quant = FP8Rowwise(FP8RowwiseConfig(roles=["vae"], **knobs), SimpleNamespace(device=device.type))
    quant.load(None)
    return quant.transform("vae", copy.deepcopy(vae))


def run_variant(bench, vae, latents, name, config, reference, decoders):
    stage = fast_stage(bench, vae, config, decoders)
    bench.reset_peak()
    plan = stage.plan(latents.shape)
    bench.record("tiles", {"per_chunk": plan.grid, "chunks": plan.chunks,
                           "batch": len(stage.batches(plan)[0])}, name)
    with torch.inference_mode():
        if config.get("compile"):
            stage.decode_frames(latents).wait()  # compiles every batch shape the timed run meets
        else:
            stage.decode_frames(latents[:, :, :7]).wait()
        frames, seconds = bench.timed(lambda: stage.decode_frames(latents).wait())
    bench.record("seconds", round(seconds, 3), name)
    bench.record("peak_gib", bench.peak_gib(), name)
    frames = torch.from_numpy(frames)
    if frames.shape != reference.shape:
        bench.record("error", f"frames {tuple(frames.shape)}, diffusers {tuple(reference.shape)}", name)
        return
    difference = frames_difference(bench, frames, reference)
    bench.record("uint8_max_abs", difference[0], name)
    bench.record("uint8_mean_abs", difference[1], name)
    # Whether the frames are those of the first variant run: another grouping of the same tiles should change none.
    if bench.first_frames is None:
        bench.first_frames = (name, frames)
    else:
        bench.record(f"frames_equal_to {bench.first_frames[0]}", bool(torch.equal(frames, bench.first_frames[1])), name)


# Kernel families by name: cuBLAS GEMMs, attention (cuDNN, flash), h3gen's Triton kernels; the rest is "other".
KERNEL_FAMILIES = (("gemm", ("nvjet", "gemm", "xmma")), ("attention", ("flash", "fmha", "cudnn", "sdpa")),
                   ("triton", ("_kernel",)))


def profile_variant(bench, vae, latents, name, config, decoders):
    """Where one decode's device time goes: totals per kernel family, and the top kernels."""
    from torch.profiler import ProfilerActivity, profile

    cuda = bench.device.type == "cuda"  # the CPU dry run profiles host ops instead
    seconds = (lambda e: e.device_time_total / 1e6) if cuda else (lambda e: e.self_cpu_time_total / 1e6)
    stage = fast_stage(bench, vae, config, decoders)
    with torch.inference_mode(), profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        bench.timed(lambda: stage.decode_frames(latents).wait())
    rows = sorted(prof.key_averages(), key=seconds, reverse=True)
    families = {}
    for event in rows:
        family = next((f for f, keys in KERNEL_FAMILIES if any(k in event.key for k in keys)), "other")
        families[family] = families.get(family, 0.0) + seconds(event)
    bench.record("profile_s", {f: round(s, 3) for f, s in families.items()}, name)
    bench.record("profile_top", [dict(kernel=e.key[:80], s=round(seconds(e), 3), calls=e.count)
                                 for e in rows[:12]], name)


def frames_difference(bench, frames, reference):
    """Max and mean |a - b| of two uint8 (T, H, W, 3) host arrays, frame chunk by frame chunk on the device."""
    largest, total = 0, 0
    for start in range(0, frames.shape[0], 17):
        a, b = (t[start:start + 17].to(bench.device).int() for t in (frames, reference))
        diff = (a - b).abs()
        largest, total = max(largest, int(diff.max())), total + int(diff.sum())
    return largest, round(total / frames.numel(), 4)


def summary(bench):
    print(f"\n{'variant':24} {'seconds':>8} {'peak GiB':>9} {'max|d|':>7} {'mean|d|':>8}  note")
    for name, row in bench.results["variants"].items():
        note = row.get("error", "")[:60]
        print(f"{name:24} {row.get('seconds', '-'):>8} {row.get('peak_gib', '-'):>9} "
              f"{row.get('uint8_max_abs', '-'):>7} {row.get('uint8_mean_abs', '-'):>8}  {note}")
    if "uint8_d2h" in bench.results:
        print("uint8 + D2H:", json.dumps(bench.results["uint8_d2h"]))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-o", "--output", required=True, help="where the JSON results go")
    parser.add_argument("--tiny", action="store_true", help="tiny config on the CPU, a dry run")
    parser.add_argument("--only", default="", help="comma-separated variant names (diffusers always runs)")
    parser.add_argument("--profile", default="", help="comma-separated variant names: one decode's CUDA kernels")
    args = parser.parse_args()
    bench = Bench(args)
    if not bench.tiny:
        bench.record("device", torch.cuda.get_device_name())
    import diffusers

    from h3gen.kernels.attention import backend_name

    bench.record("versions", {"torch": torch.__version__, "diffusers": diffusers.__version__})
    bench.record("attention_auto", backend_name(bench.device))
    vae = build_vae(bench)
    generator = torch.Generator(bench.device).manual_seed(1101)
    latents = torch.randn(TINY_LATENTS if bench.tiny else FULL_LATENTS, generator=generator, device=bench.device)
    reference = run_reference(bench, vae, latents)
    try:
        frames_and_copy(bench, vae, latents)
    except Exception as error:
        bench.record("uint8_d2h_error", f"{type(error).__name__}: {error}")
    variants = TINY_VARIANTS if bench.tiny else VARIANTS
    wanted = [n for n in args.only.split(",") if n] or list(variants)
    decoders = {}
    for name in wanted:
        if time.perf_counter() - bench.began > BUDGET_S:
            bench.record("error", "skipped: time budget", name)
            continue
        try:
            run_variant(bench, vae, latents, name, variants[name], reference, decoders)
            if name in args.profile.split(","):
                profile_variant(bench, vae, latents, name, variants[name], decoders)
        except Exception as error:  # out of memory, a backend missing: record it and go on
            bench.record("error", f"{type(error).__name__}: {str(error)[:300]}", name)
            traceback.print_exc()
        if bench.device.type == "cuda":
            torch.cuda.empty_cache()
    summary(bench)


if __name__ == "__main__":
    main()
