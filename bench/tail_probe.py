"""Diagnostic: what a clip's mux has left to do when its decode ends (a batch's last-clip tail), and why.

The mux starts with the decode and encodes each chunk of frames as it lands; what is left when the decode ends is
what no next clip hides after the last one. This decodes one clip of the preset with its background mux, as the
run loop does, with the soundtrack encoded ahead of the frames (`ArrivingMedia.audio_ahead`) or after them. Per
variant, median of `--repeat`: the decode's wall time, how many frames the mux had read when it ended, the tail
(decode end to file written) and its parts (the video encode's end, the audio's packets muxed, the file synced), and
whether the MP4 is the same bytes in every variant.

    python3 bench/tail_probe.py [--preset fasth3-fp8] [--seconds 10] [--repeat 3] [-o tail.json]
    python3 bench/tail_probe.py --preset tiny --set vae.use=fast --tiny --seconds 2 --repeat 1   # on the CPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path


def main() -> None:
    import torch

    from h3gen.bench.batch import batch_requests
    from h3gen.bench.sweep import BenchPlan, add_probe_options, probe_renderer
    from h3gen.run import arriving
    from h3gen.stages import mux
    from h3gen.stages.clip import Clip

    parser = argparse.ArgumentParser()
    add_probe_options(parser)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("-o", "--output", type=Path, default=Path("tail.json"))
    args = parser.parse_args()

    renderer = probe_renderer(args.preset, 1, args.set, args.tiny)
    preset, plan = renderer.preset, BenchPlan(presets=[args.preset])
    if args.tiny:
        plan.width, plan.height = 64, 64
    [request] = batch_requests(plan, args.seconds, 1)
    stages, cuda = renderer.stages, renderer.runtime.device.startswith("cuda")
    if not (stages["vae"].hands_over_frames and stages["mux"].background):
        raise SystemExit(f"{args.preset}'s decode does not hand its frames to a background mux: nothing to probe")
    clip = Clip(request=request, path=Path("/tmp/tail-probe.mp4"), preset=preset.name)
    stages["encode"](clip, report=False)
    renderer.unload(stages["encode"])
    clip = stages["sampler"](clip)
    latents = (clip.video_latents.clone(), clip.audio_latents.clone())

    marks = {}

    def marked(name, call):
        """`call`, noting when its first call of a write starts (`name` + "_start") and when its last one ends."""
        def wrapper(*a, **k):
            marks.setdefault(f"{name}_start", time.perf_counter())
            out = call(*a, **k)
            marks[name] = time.perf_counter()
            return out
        return wrapper

    mux._encode_video = marked("video", mux._encode_video)
    mux._fsync = marked("synced", mux._fsync)
    read, iterate = [0], arriving.ArrivingMedia.__iter__

    def counted(media):
        for frame in iterate(media):
            read[0] += 1
            yield frame

    arriving.ArrivingMedia.__iter__ = counted
    ahead = arriving.ArrivingMedia.audio_ahead

    def once(index: int, audio_ahead: bool) -> dict:
        arriving.ArrivingMedia.audio_ahead = ahead if audio_ahead else (lambda media: None)
        path = Path(f"/tmp/tail-probe-{index}.mp4")
        path.unlink(missing_ok=True)
        clip = Clip(request=request, path=path, preset=preset.name)
        clip.video_latents, clip.audio_latents = (t.clone() for t in latents)
        clip.arriving, read[0] = arriving.ArrivingMedia(), 0
        marks.clear()
        if cuda:
            torch.cuda.synchronize()
        began = time.perf_counter()
        job = stages["mux"].submit(clip)
        stages["vae"](clip)
        decoded, frames_read = time.perf_counter(), read[0]
        job.result()
        written = time.perf_counter()
        # The tail's parts: the video's last frames and flush, the audio's packets and the MP4's index written, the
        # file and its folder synced to disk and the file renamed into place.
        return dict(decode_s=decoded - began, frames_read_at_decode_end=frames_read, tail_s=written - decoded,
                    video_left_s=marks["video"] - decoded, audio_and_index_s=marks["synced_start"] - marks["video"],
                    sync_s=written - marks["synced_start"], bytes=path.read_bytes())

    once(0, True)  # warm: compiles and tunes once
    variants, files = [], set()
    for audio_ahead in (False, True):
        runs = [once(1 + i, audio_ahead) for i in range(args.repeat)]
        files.update(run.pop("bytes") for run in runs)
        row = {key: round(statistics.median(run[key] for run in runs), 3) for key in runs[0]}
        row.update(audio_ahead=audio_ahead, tails=[round(run["tail_s"], 3) for run in runs])
        variants.append(row)
        print(json.dumps(row), flush=True)
    renderer.close()
    report = dict(preset=preset.name, seconds=args.seconds, frames=request.frames, repeat=args.repeat,
                  same_bytes_in_every_variant=len(files) == 1, variants=variants,
                  device=torch.cuda.get_device_name() if cuda else "cpu")
    print(json.dumps(report, indent=1))
    args.output.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
