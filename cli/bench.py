"""`h3gen bench`: parse the plan, pick the weights, run, write the results."""

from __future__ import annotations

import json
from pathlib import Path

from h3gen.errors import UsageError

STAGES = ("encode", "dit", "vae", "mux")
# Over this many pixels a clip (160x160 at 5 s), a CPU benchmark runs minutes a stage: the run says so before it starts.
CPU_QUICK_PIXELS = 160 * 160 * 124


def parse_plan(presets, baseline, durations, size, repeat, warmup, stages, forwards, text_tokens):
    from h3gen.bench.sweep import BenchPlan
    from h3gen.inputs.prompts import check_clip, parse_size

    try:
        seconds = [float(d) for d in durations.split(",")]
    except ValueError:
        raise UsageError(f"cannot read --durations {durations!r}", "seconds, comma-separated: e.g. --durations "
                         "5,10,15") from None
    width, height = parse_size(size)
    for duration in seconds:  # as `h3gen render` checks a prompt's
        check_clip(duration, width, height, f"--durations {durations}", f"--size {size}")
    chosen = tuple(s.strip() for s in stages.split(",") if s.strip())
    if not chosen:
        raise UsageError(f"--stages {stages!r} names no stage", f"choose from {','.join(STAGES)}")
    unknown = set(chosen) - set(STAGES)
    if unknown:
        raise UsageError(f"unknown stage '{sorted(unknown)[0]}' in --stages", f"choose from {','.join(STAGES)}")
    # A preset or duration given twice is timed once: one record per (preset, duration, stage).
    return BenchPlan(presets=list(dict.fromkeys(presets)), baseline=None if baseline == "none" else baseline,
                     durations=list(dict.fromkeys(seconds)), width=width, height=height, repeat=repeat, warmup=warmup,
                     stages=tuple(dict.fromkeys(chosen)), forwards=forwards, text_tokens=text_tokens)


def weights_source(random_weights, model):
    from h3gen.models.repo import ModelRepo
    from h3gen.models.tiny import ensure_tiny_model

    if random_weights not in (None, "full", "tiny"):
        raise UsageError(f"--random-weights {random_weights!r}", "use full or tiny")
    if random_weights == "full":
        from h3gen.bench.random_weights import FullSizeRandom

        return FullSizeRandom(ModelRepo(ensure_tiny_model()))
    if random_weights == "tiny" or model is None:
        return ModelRepo(ensure_tiny_model())
    return ModelRepo(model)


def check_forwards(preset, registry, forwards: int | None, option: str) -> None:
    """K forwards timed of a preset's N: more than N would time forwards no clip of it runs."""
    from h3gen.bench.sweep import preset_forwards, reuses_forwards

    if not forwards or reuses_forwards(preset, registry):  # a step cache times all its forwards
        return
    full = preset_forwards(preset)
    if forwards > full:
        raise UsageError(f"{option} {forwards} is over preset {preset.name}'s {full} DiT forwards a clip",
                         f"give at most {full}")


def check_commit_variable() -> None:
    """H3GEN_COMMIT goes into every record as the commit measured: a commit hash, or the records would not say."""
    import os
    import re

    text = os.environ.get("H3GEN_COMMIT")
    if text and not re.fullmatch(r"[0-9a-f]{7,40}", text.strip()):
        raise UsageError(f"H3GEN_COMMIT is {text!r}, not a commit hash",
                         "set it to the hash of the commit the source was checked out at (git rev-parse HEAD), or "
                         "unset it")


def run_bench_command(presets, baseline, durations, size, repeat, warmup, random_weights, model, stages, forwards,
                      text_tokens, output, batch=None, warm_cache=False, baseline_clips=None, sets=(),
                      baseline_forwards=None, found=None):
    import sys

    from h3gen.bench.sweep import run_bench
    from h3gen.bench.report import write_results
    from h3gen.cli.ui import plugin_registry, results_only_on_stdout
    from h3gen.config.preset import parse_override, resolve
    from h3gen.bench.batch import batch_requests
    from h3gen.run.budget import check_budget, check_host_fits
    from h3gen.run.loop import (Interrupted, check_model_kind, check_writable, missing_directories, remove_if_empty,
                                stop_on_signals)
    from h3gen.run.quiet import quiet_libraries
    from h3gen.run.render import pick_device

    check_commit_variable()
    if (warm_cache or baseline_clips or baseline_forwards) and not batch:
        option = ("--warm-cache" if warm_cache else "--baseline-clips" if baseline_clips
                  else "--baseline-forwards")
        raise UsageError(f"{option} belongs to a batch benchmark", "add --batch N")
    if batch and tuple(s.strip() for s in stages.split(",")) != STAGES:
        raise UsageError(f"--stages {stages} belongs to the per-stage benchmark: a batch times whole clips, "
                         "every stage",
                         "drop --stages, or --batch to time the stages apart")
    tiny = random_weights == "tiny" or random_weights is None and model is None  # `weights_source`'s tiny model
    durations, size = durations or ("5" if tiny else "10"), size or ("32x32" if tiny else "1344x768")
    plan = parse_plan(presets, baseline, durations, size, repeat, warmup, stages, forwards, text_tokens)
    plan.warm_cache, plan.baseline_clips, plan.overrides = warm_cache, baseline_clips, list(sets)
    plan.baseline_forwards = baseline_forwards
    found = plugin_registry() if found is None else found  # the command's own, which reported the plugins that failed
    # A typo fails now, not after the first preset's minutes.
    resolved = [resolve(name, found, plan.overrides) for name in plan.presets]
    for preset in resolved:
        check_budget(preset.runtime["vram_gib"], pick_device(preset.runtime["device"]))
        limit = getattr(preset.stages["encode"][1], "max_tokens", None)
        if limit is not None and text_tokens > limit:
            raise UsageError(f"--text-tokens {text_tokens} is over preset {preset.name}'s encoder limit of {limit}",
                             f"give at most {limit}")
    if plan.baseline:  # [model] says what a preset is made for, not how it runs: --set model.needs=any reaches it
        resolved.append(resolve(plan.baseline, found, [s for s in plan.overrides if parse_override(s)[0] == "model"]))
    for index, preset in enumerate(resolved):
        is_baseline = bool(plan.baseline) and index == len(resolved) - 1
        option = "--baseline-forwards" if is_baseline and baseline_forwards else "--forwards"
        check_forwards(preset, found, (baseline_forwards or forwards) if is_baseline else forwards, option)
    quiet_libraries()
    source = weights_source(random_weights, model)
    if random_weights is None:  # random weights stand in for whichever model a preset is made for
        for index, preset in enumerate(resolved):
            check_model_kind(preset, source, model is None, bench=True,
                             baseline=bool(plan.baseline) and index == len(resolved) - 1)

    def say(text):
        print(text, file=sys.stderr, flush=True)

    [longest] = batch_requests(plan, max(plan.durations), 1)
    on_cpu = [preset for preset in resolved if pick_device(preset.runtime["device"]) == "cpu"]
    for preset in on_cpu:  # a clip the host cannot hold on the CPU: refused as render refuses it, not killed later
        check_host_fits(preset, [longest], source)
    created = missing_directories(Path(output))
    check_writable(Path(output))  # now, not after the benchmark's minutes
    if on_cpu and longest.width * longest.height * longest.frames > CPU_QUICK_PIXELS:
        say(f"bench: note: on the CPU a {longest.width}x{longest.height} clip of {max(plan.durations):g} s takes "
            "minutes a stage, even on the tiny model; --size 32x32 --durations 5 times the CPU path in seconds")

    try:  # a stage's own prints go to stderr; stdout has the files written
        with stop_on_signals(created), results_only_on_stdout():
            if batch:
                from h3gen.bench.batch import run_batch, write_batch_results

                paths = write_batch_results(run_batch(plan, found, source, random_weights, batch, say), output)
            else:
                paths = write_results(run_bench(plan, found, source, random_weights, say), output)
    except Interrupted as stop:  # the results are written whole at the end, so none are
        say(f"h3gen: bench stopped by {stop.signal_name}: no results written; run the same command again")
        return stop.exit_code
    finally:
        remove_if_empty(created)  # a bench that wrote nothing leaves no directory it made
    say(paths["md"].read_text())
    for path in paths.values():
        print(path)
    failed = [record for record in json.loads(paths["json"].read_text())["records"]
              if str(record.get("notes", "")).startswith("failed:")]
    if failed:  # the others' numbers are written all the same
        say(f"bench: {len(failed)} of the runs failed (their records' notes say why)")
    return 1 if failed else 0
