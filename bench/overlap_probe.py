"""Diagnostic: does one clip's decode overlap the next clip's DiT forwards on one GPU?

A batch renders clip after clip: each clip's DiT forwards, then its decode, with the device idle for neither. This
times, on full-size random weights and the preset's own stages: the next clip's forwards alone, a clip's decode
alone, then both at once (the decode on a side stream, from a host thread). Overlap pays where the sum of the two
alone exceeds the time of both at once. Also checks the overlapped decode's frames equal the decode's alone.

    python3 bench/overlap_probe.py [--preset fasth3-fp8] [--forwards 1] [--seconds 10] [-o overlap.json]
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path


def main() -> None:
    import numpy as np
    import torch

    from h3gen.bench.batch import batch_requests
    from h3gen.bench.sweep import BenchPlan, probe_renderer
    from h3gen.stages.clip import Clip

    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="fasth3-fp8")
    parser.add_argument("--forwards", type=int, default=1)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--priorities", default="0,-1", help="the decode stream's priorities to try (-1: higher)")
    parser.add_argument("-o", "--output", type=Path, default=Path("overlap.json"))
    args = parser.parse_args()

    renderer = probe_renderer(args.preset, args.forwards)
    preset, stages = renderer.preset, renderer.stages
    requests = batch_requests(BenchPlan(presets=[args.preset]), args.seconds, 3)
    clips = [Clip(request=r, path=Path(f"/tmp/{r.id}.mp4"), preset=preset.name) for r in requests]
    for clip in clips:
        stages["encode"](clip, report=False)
    renderer.unload(stages["encode"])

    def decoded(latents):
        clip = Clip(request=requests[0], path=Path("/tmp/x.mp4"), preset=preset.name)
        clip.video_latents, clip.audio_latents = (t.clone() for t in latents)
        return stages["vae"](clip)

    def timed(call):
        torch.cuda.synchronize()
        began = time.perf_counter()
        out = call()
        torch.cuda.synchronize()
        return out, time.perf_counter() - began

    first = stages["sampler"](clips[0])  # warm: compiles and tunes everything once
    latents = (first.video_latents, first.audio_latents)
    reference = decoded(latents).frames.copy()
    _, dit_alone = timed(lambda: stages["sampler"](clips[1]))
    alone, vae_alone = timed(lambda: decoded(latents))
    same_alone = bool(np.array_equal(alone.frames, reference))

    report = dict(preset=preset.name, forwards=args.forwards, seconds=args.seconds, dit_alone_s=round(dit_alone, 3),
                  vae_alone_s=round(vae_alone, 3), sum_alone_s=round(dit_alone + vae_alone, 3),
                  frames_equal_alone=same_alone, overlapped=[], device=torch.cuda.get_device_name())
    for priority in map(int, args.priorities.split(",")):
        side, result = torch.cuda.Stream(priority=priority), {}

        def decode_on_side():
            with torch.cuda.stream(side):
                began = time.perf_counter()
                result["clip"] = decoded(latents)
                side.synchronize()
                result["vae_s"] = time.perf_counter() - began

        def both():
            thread = threading.Thread(target=decode_on_side)
            side.wait_stream(torch.cuda.current_stream())
            thread.start()
            stages["sampler"](clips[2])
            thread.join()

        _, both_s = timed(both)
        report["overlapped"].append(dict(
            priority=priority, both_s=round(both_s, 3), vae_in_overlap_s=round(result["vae_s"], 3),
            saved_s=round(dit_alone + vae_alone - both_s, 3),
            frames_equal=bool(np.array_equal(result["clip"].frames, reference))))
    print(json.dumps(report, indent=1))
    args.output.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
