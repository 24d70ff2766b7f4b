"""Times the mux of one 10 s 1344x768 clip on this machine's CPU: the RGB frames converted to yuv420p ahead of the
encoder on several threads (the mux) against the encoder's own conversion on its calling thread, alone and beside
a busy Python thread (the run loop launching the decode) at Python's default switch interval and at the background
mux's (`MUX_SWITCH_INTERVAL_S`), and the conversion alone, on blocky and on noise frames (noise is the worst case for
x264).

    python3 bench/mux_probe.py [--frames 243] [--json OUT]
"""

import argparse
import json
import sys
import tempfile
import threading
import time

import av
from av.video.reformatter import VideoReformatter
import numpy as np

from h3gen.stages import mux


def clip_frames(count, kind):
    rng = np.random.default_rng(0)
    if kind == "noise":
        return rng.integers(0, 256, (count, 768, 1344, 3), dtype=np.uint8)
    coarse = rng.integers(0, 256, (8, 96, 168, 3), dtype=np.uint8)
    blocks = np.repeat(np.repeat(coarse, 8, axis=1), 8, axis=2)
    frames = np.concatenate([blocks] * (count // 8 + 1))[:count].astype(np.int16)
    return (frames + rng.integers(0, 8, frames.shape)).clip(0, 255).astype(np.uint8)


def timed_write(frames, busy):
    stop, loops = threading.Event(), [0]

    def spin():
        while not stop.is_set():
            loops[0] += 1

    spinner = threading.Thread(target=spin) if busy else None
    if spinner:
        spinner.start()
    start = time.perf_counter()
    soundtrack = np.full((2, len(frames) * 32000 // 24), 0.1, np.float32)
    mux.write_mp4(f"{tempfile.gettempdir()}/mux-probe.mp4", frames, soundtrack, preset="veryfast", x264_threads=8)
    seconds = time.perf_counter() - start
    stop.set()
    if spinner:
        spinner.join()
    return {"s": round(seconds, 3), "python_loops_per_s": round(loops[0] / seconds)}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--frames", type=int, default=243)
    parser.add_argument("--json")
    args = parser.parse_args()
    ahead, default = mux._yuv420p, sys.getswitchinterval()
    encoder = lambda reformatter, pixels, threads: av.VideoFrame.from_ndarray(pixels, "rgb24")  # noqa: E731
    results = {}
    for kind in ("blocks", "noise"):
        frames = clip_frames(args.frames, kind)
        for name, convert in (("encoder converts", encoder), ("converted ahead", ahead)):
            mux._yuv420p = convert
            for busy, interval in ((False, default), (True, default), (True, mux.MUX_SWITCH_INTERVAL_S)):
                sys.setswitchinterval(interval)
                key = f"{kind}, {name}" + (f", busy thread, switch interval {interval * 1e3:g} ms" if busy else "")
                results[key] = timed_write(frames, busy)
                print(key, results[key], flush=True)
            sys.setswitchinterval(default)
        mux._yuv420p = ahead
        start, reformatter = time.perf_counter(), VideoReformatter()
        for pixels in frames[:48]:
            mux._yuv420p(reformatter, pixels, 8)
        results[f"{kind}, conversion alone ms a frame"] = round((time.perf_counter() - start) / 48 * 1e3, 2)
        print(kind, "conversion alone", results[f"{kind}, conversion alone ms a frame"], "ms a frame", flush=True)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(results, out, indent=1)


if __name__ == "__main__":
    main()
