"""`h3gen bench --batch N`: N clips through the renderer exactly as `h3gen render` takes them, one preset after
another, to measure what a batch costs beyond its DiT forwards.

Per clip, the critical path is the clip's DiT plus whatever the device waits for before the next clip's DiT can
start (the sampler's layout and noise, decode, transfer, and the mux when it is not in the background).
`extra_per_clip_s` is that wait: the batch's wall time (the text encoding and loading excluded) minus the time of
the DiT forwards, over the clips. With `forwards`
set, clips per hour are also given for the preset's own forward count, from the measured per-forward time and
the measured extra. The baseline renders clip by clip, so nothing overlaps across its clips: `baseline_clips` can
give it fewer clips than the batch at the same per-clip costs. `warmup` clips go first in the same render and are
not timed, so the kernels' first-call compilation is outside the batch (0 keeps it in); the clock starts when the
first timed clip does. The batch ends when its last clip's file is written; unloading the weights after it is not
part of the batch, as loading them is not (`unload_s` gives it). `last_clip_tail_s` is the time from the last clip's
decode to that end: its mux, which no next clip hides; `last_clip_mux_left_s` is the part of it until the mux
returned (the file written), the rest is the clip's finish (its manifest line and record). `between_clips_s` is
the mean time from one clip's decode to the next clip's start: what the device waits for between clips beyond the
mux. `baseline_forwards` runs the baseline at fewer forwards than the measured presets (each preset is compared at
its own count all the same, from the baseline's per-forward seconds). With `warm_cache`, each preset's batch runs
twice over one fresh embedding cache: the second run's encode seconds are what a rerun over the same prompts pays
(`encoder_loads` says whether it loaded the encoder).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from h3gen.bench.report import header, note_lines
from h3gen.bench.sweep import (BenchPlan, adapter_overrides, cache_overrides, forget_failed_run, forward_overrides,
                               host_gib, preset_forwards, said_failed)
from h3gen.run.report import SilentReporter
from h3gen.stages.clip import FORWARDS_PART
from h3gen.inputs.request import Request, frames_for_duration


class BatchReporter(SilentReporter):
    """Records the seconds every clip spent per stage; says only when a clip is done."""

    def __init__(self, say):
        self.say = self.warn = say
        self.stages, self.started, self.decoded, self.finished = {}, {}, {}, {}
        self.muxed = {}  # when each clip's mux returned, on whichever thread it ran

    def time_mux(self, mux) -> None:
        """Note when `mux` (the stage) returns each clip."""
        run = mux.run

        def timed(clip):
            try:
                return run(clip)
            finally:
                self.muxed[clip.request.index] = time.perf_counter()

        mux.run = timed

    def clip_started(self, clip):
        self.started[clip.request.id] = time.perf_counter()

    def stage_done(self, clip, kind, seconds):
        self.stages.setdefault(clip.request.index, {})[kind] = seconds
        if kind == "vae":
            self.decoded[clip.request.index] = time.perf_counter()

    def clip_done(self, result):
        self.finished[result.request.index] = time.perf_counter()
        self.say(f"bench: {clip_label(result.request)} {'ok' if result.ok else 'failed: ' + result.error}")


def clip_label(request: Request) -> str:
    """"warm-up clip 1", "clip 2": a batch's clips counted apart from the untimed ones before them."""
    kind, number = request.id.rsplit("-", 1)
    return f"{'warm-up clip' if kind == 'warmup' else 'clip'} {int(number) + 1}"


def batch_requests(plan: BenchPlan, seconds: float, clips: int, warmup: int = 0) -> list[Request]:
    """`warmup` clips, then `clips` timed ones: ids warmup-i and batch-i."""
    names = [f"warmup-{i}" for i in range(warmup)] + [f"batch-{i}" for i in range(clips)]
    return [Request(index=i, prompt=" ".join([name] + ["a"] * (plan.text_tokens - 1)), seed=plan.seed + i,
                    width=plan.width, height=plan.height, frames=frames_for_duration(seconds), id=name)
            for i, name in enumerate(names)]


def run_batch(plan: BenchPlan, registry, source, random_weights: str | None, clips: int, say=print) -> list[dict]:
    names = ([(plan.baseline, True)] if plan.baseline else []) + [(name, False) for name in plan.presets]
    records = []
    with tempfile.TemporaryDirectory(prefix="h3gen-batch-") as workdir:
        for seconds in plan.durations:
            for name, baseline in names:
                preset = plan.preset(name, baseline, registry)
                full_forwards = preset_forwards(preset)
                # A folder of each batch's own: the baseline and a measured preset may share a name.
                folder = Path(workdir) / f"{'baseline' if baseline else 'preset'}-{name}-{seconds:g}s"
                cache_dir = folder / "embedding-cache" if plan.warm_cache else None
                forwards = (plan.baseline_forwards or plan.forwards) if baseline else plan.forwards
                overrides = (forward_overrides(preset, forwards, registry) + cache_overrides(preset, cache_dir)
                             + adapter_overrides(random_weights))
                if baseline:  # the baseline renders clip by clip: nothing in the background
                    overrides.append("mux.workers=0")
                preset = plan.preset(name, baseline, registry, *overrides)
                count = (plan.baseline_clips or clips) if baseline else clips
                for run in ("cold", "warm") if plan.warm_cache else (None,):
                    say(f"bench: batch of {count} x {seconds:g} s clips with {name}"
                        + (f", {run} embedding cache" if run else ""))
                    failed = False
                    try:
                        requests = batch_requests(plan, seconds, count, plan.warmup)
                        record = time_batch(preset, registry, source, requests, folder / f"clips-{run}",
                                            full_forwards, baseline, say)
                    except Exception as e:  # one preset failing must not lose the others' numbers
                        said_failed(say, f"batch with {name}", e)
                        record = dict(preset=name, baseline=baseline, stage="batch", clips=count,
                                      notes=f"failed: {type(e).__name__}: {e}"[:500])
                        failed = True
                    if failed:  # past the except block, its exception and what it held are garbage now
                        forget_failed_run(preset)
                    records.append(record | (dict(embedding_cache=run) if run else {}))
    base = next((r for r in records if r.get("baseline") and r.get("clips_per_hour")
                 and r.get("embedding_cache") != "warm"), None)
    for record in records:
        record.update(vs_baseline=None, vs_baseline_same_forwards=None)  # the keys are there with no baseline too
        if base and record.get("clips_per_hour"):
            record["vs_baseline"] = round(record["clips_per_hour_full"] / base["clips_per_hour_full"], 3)
            # The baseline on this preset's own schedule: its measured seconds per forward and per clip beyond them.
            same = clips_per_hour(record["full_forwards"], base["per_forward_s"], base["extra_per_clip_s"],
                                  base["encode_s"] / base["clips"])
            record["vs_baseline_same_forwards"] = (1.0 if record is base else  # itself, not its projection
                                                   round(record["clips_per_hour_full"] / same, 3))
    return records


def clips_per_hour(forwards: int, per_forward_s: float, extra_per_clip_s: float, encode_per_clip_s: float) -> float:
    """Clips an hour at `forwards` DiT forwards a clip, from measured per-forward and per-clip costs."""
    return 3600 / (forwards * per_forward_s + extra_per_clip_s + encode_per_clip_s)


def time_batch(preset, registry, source, requests, out_dir: Path, full_forwards: int, baseline: bool, say) -> dict:
    from h3gen.run import budget
    from h3gen.run.render import Renderer, pick_device

    reporter = BatchReporter(say)
    began = time.perf_counter()
    memory_plan = budget.planned(preset, requests, source, pick_device(preset.runtime["device"]))
    renderer = Renderer(preset, registry, source, reporter, memory_plan)
    reporter.time_mux(renderer.stages["mux"])
    loaded = time.perf_counter()
    results, host = [], 0.0
    try:
        results = list(renderer.render(requests, out_dir))
        host = host_gib()  # with every stage still loaded
    finally:
        closing = time.perf_counter()
        results += renderer.close()
    unloaded = time.perf_counter()
    failed = [r.error for r in results if not r.ok]
    if failed:
        raise RuntimeError(f"{len(failed)} clip(s) failed: {failed[0]}")
    warmup = sum(r.id.startswith("warmup") for r in requests)
    results = [r for r in results if not r.request.id.startswith("warmup")]
    # From the first timed clip: the first chunk's prompts were encoded before it; a batch past 8 clips (the first
    # encoding chunk, h3gen.run.render.chunk_sizes) has its later chunks' encoding in the wall, as a render does.
    ended = max(reporter.finished[r.request.index] for r in results)  # the last file written
    wall = ended - reporter.started[results[0].request.id]
    starts = [reporter.started[r.request.id] for r in results]
    waits = [start - reporter.decoded[r.request.index] for r, start in zip(results, starts[1:])]
    per_clip = [reporter.stages.get(r.request.index, {}) | r.seconds for r in results]
    encoder_loads = getattr(renderer.stages["encode"], "encoder_loads", None)
    encode = sum(s.get("encode", 0.0) for s in per_clip)
    # The forwards alone where the sampler times them: its work outside them (layout, noise) is a per-clip cost.
    dit = [s.get(FORWARDS_PART, s.get("sampler", 0.0)) for s in per_clip]
    forwards = max(r.forwards for r in results) or 1
    per_forward = sum(dit) / len(dit) / forwards
    extra = (wall - sum(dit)) / len(results)
    return dict(preset=preset.name, baseline=baseline, stage="batch", clips=len(results),
                duration_s=round(requests[0].duration, 4), size=f"{requests[0].width}x{requests[0].height}",
                load_s=round(loaded - began, 2), warmup_clips=warmup, wall_s=round(wall, 2),
                encode_s=round(encode, 3),
                encode_s_per_clip=[round(s.get("encode", 0.0), 4) for s in per_clip], encoder_loads=encoder_loads,
                dit_s_per_clip=round(sum(dit) / len(dit), 3), forwards=forwards, per_forward_s=round(per_forward, 3),
                vae_s_per_clip=round(sum(s.get("vae", 0.0) for s in per_clip) / len(per_clip), 3),
                mux_s_per_clip=round(sum(s.get("mux", 0.0) for s in per_clip) / len(per_clip), 3),
                extra_per_clip_s=round(extra, 3),
                # after the last clip's decode: its mux, which no next clip hides
                last_clip_tail_s=round(ended - reporter.decoded[results[-1].request.index], 3),
                last_clip_mux_left_s=round(reporter.muxed[results[-1].request.index]
                                           - reporter.decoded[results[-1].request.index], 3),
                between_clips_s=round(sum(waits) / len(waits), 3) if waits else None,
                unload_s=round(unloaded - closing, 3),
                clips_per_hour=round(3600 * len(results) / (wall + encode), 1),
                full_forwards=full_forwards,
                clips_per_hour_full=round(clips_per_hour(full_forwards, per_forward, extra, encode / len(results)), 1),
                vram_gib=preset.runtime["vram_gib"] or None, peak_gib=max((r.peak_gib or 0.0 for r in results),
                                                                         default=0.0) or None,
                host_gib=round(host, 3) or None,
                notes=f"{forwards} forward(s) per clip timed; clips_per_hour_full uses {full_forwards}"
                      + (f"; {memory_plan.describe()}" if memory_plan is not None else ""))


BATCH_COLUMNS = ("clips", "encode_s", "per_forward_s", "vae_s_per_clip", "mux_s_per_clip", "extra_per_clip_s",
                 "last_clip_tail_s", "last_clip_mux_left_s", "between_clips_s", "clips_per_hour", "clips_per_hour_full",
                 "vs_baseline", "vs_baseline_same_forwards", "vram_gib", "peak_gib", "host_gib")


def table_cell(value) -> str:
    """A value of the table: '-' where none was measured, a float to three decimals at most."""
    return "-" if value is None else f"{round(value, 3):g}" if isinstance(value, float) else str(value)


def batch_markdown(result: dict) -> str:
    lines = [header(result), "", "| preset | " + " | ".join(BATCH_COLUMNS) + " |",
             "| --- " * (len(BATCH_COLUMNS) + 1) + "|"]
    for r in result["records"]:
        name = r["preset"] + (" (baseline, clip by clip)" if r.get("baseline") else "")
        name += f", {r['embedding_cache']} embedding cache" if r.get("embedding_cache") else ""
        lines.append(f"| {name} | " + " | ".join(table_cell(r.get(k)) for k in BATCH_COLUMNS) + " |")
    lengths = ", ".join(dict.fromkeys(f"{r['duration_s']:.2f} s" for r in result["records"] if r.get("duration_s")))
    legend = ["", f"Columns: clips of {lengths}; clips_per_hour is the timed clips over the batch's wall time (the "
              "first clip's start to the last file written) and encode_s; clips_per_hour_full is 3600 over a clip's "
              "seconds at the preset's full forwards (forwards x per_forward_s, extra_per_clip_s, its share of "
              "encode_s); encode_s is every timed clip's prompt encoding together; the other _s columns are per "
              "clip, or of the batch's last clip"
              + ("; vs_baseline is clips_per_hour_full over the baseline's, each at its own forwards a clip, and "
                 "vs_baseline_same_forwards the baseline projected to this preset's forwards."
                 if any(r.get("vs_baseline") for r in result["records"]) else ".")]
    return "\n".join(lines + [""] + note_lines(result["records"]) + legend) + "\n"


def write_batch_results(records: list[dict], out_dir: Path) -> dict[str, Path]:
    import json

    from h3gen.bench.report import environment

    result = {**environment(), "records": records}
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = result["created"].replace(":", "").replace("+0000", "Z") + "-batch"
    paths = {ext: out_dir / f"{stem}.{ext}" for ext in ("json", "md")}
    paths["json"].write_text(json.dumps(result, indent=1) + "\n")
    paths["md"].write_text(batch_markdown(result))
    return paths
