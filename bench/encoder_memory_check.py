"""Where the device memory of a streamed text encoder goes, step by step: the full-size random Qwen3-VL encoder of
`h3gen bench --random-weights full`, loaded by h3gen's encode stage with its layers streamed, under an allocator
cap as `--vram` sets it.

Usage: python3 bench/encoder_memory_check.py [PRESET] [VRAM_GIB]   (default h3-base-fp8 24)
Prints the allocated GiB after the encoder is made in host memory, every 10 layers quantized, around group
offloading, and after each of two encodes, with the largest device tensors still alive at the end.
"""
import gc
import sys
import time

import torch

GIB = 2**30


def allocated(where: str) -> None:
    torch.cuda.synchronize()
    print(f"[{time.strftime('%H:%M:%S')}] {where}: {torch.cuda.memory_allocated() / GIB:.2f} GiB allocated, "
          f"peak {torch.cuda.max_memory_allocated() / GIB:.2f}", flush=True)


def largest_device_tensors(count: int = 8) -> None:
    found = {}
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor) and obj.is_cuda:
                found[obj.untyped_storage().data_ptr()] = (obj.untyped_storage().nbytes(), tuple(obj.shape), obj.dtype)
        except Exception:
            continue
    for nbytes, shape, dtype in sorted(found.values(), key=lambda item: -item[0])[:count]:
        print(f"    {nbytes / GIB:.3f} GiB {shape} {dtype}")
    print(f"    {len(found)} device storages, {sum(n for n, _, _ in found.values()) / GIB:.2f} GiB in all")


def main() -> None:
    import diffusers.hooks

    from h3gen.bench.random_weights import FullSizeRandom
    from h3gen.config.preset import resolve
    from h3gen.inputs.request import Request
    from h3gen.models.repo import ModelRepo
    from h3gen.models.tiny import ensure_tiny_model
    from h3gen.plugins.manager import registry
    from h3gen.run import budget
    from h3gen.run.render import Runtime
    from h3gen.run.timing import StageTimer
    from h3gen.stages.clip import Clip

    preset_name = sys.argv[1] if len(sys.argv) > 1 else "h3-base-fp8"
    vram = float(sys.argv[2]) if len(sys.argv) > 2 else 24.0
    found = registry()
    preset = resolve(preset_name, found, [f"runtime.vram_gib={vram}", "encode.stream_layers=true",
                                          "encode.cache=false"])
    budget.hold_to("cuda", vram)
    source = FullSizeRandom(ModelRepo(ensure_tiny_model()))
    runtime = Runtime("cuda", torch.bfloat16, StageTimer("cuda"))
    quant_name, quant_config = preset.stages["quant"]
    runtime.quant = found.stage("quant", quant_name)(quant_config, runtime)
    runtime.quant.load(source)
    runtime.cache = None

    quantize_part, parts = runtime.quantize_part, []

    def counted(role, module, prefix):
        result = quantize_part(role, module, prefix)
        parts.append(prefix)
        if len(parts) % 10 == 0:
            allocated(f"{len(parts)} parts quantized ({prefix})")
        return result

    runtime.quantize_part = counted
    apply = diffusers.hooks.apply_group_offloading

    def traced(*args, **kwargs):
        allocated("before group offloading")
        apply(*args, **kwargs)
        allocated("after group offloading")

    diffusers.hooks.apply_group_offloading = traced
    name, config = preset.stages["encode"]
    encode = found.stage("encode", name)(config, runtime)
    encode.load(source)
    started = time.perf_counter()
    encode.load_encoder()
    allocated(f"encoder loaded and streaming ({time.perf_counter() - started:.1f} s)")
    prompt = " ".join(["a"] * 256)
    for attempt in range(2):
        clip = Clip(request=Request(index=0, prompt=prompt, seed=0, width=1344, height=768, frames=243, id="m"),
                    path=None, preset=preset.name)
        started = time.perf_counter()
        encode.run(clip)
        allocated(f"encode {attempt + 1} ({time.perf_counter() - started:.2f} s)")
        del clip
    largest_device_tensors()


if __name__ == "__main__":
    main()
