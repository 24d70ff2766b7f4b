"""`h3gen render`: resolve the preset, pick one process or workers, run, and turn the outcome into an exit status."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

from h3gen.cli.ui import as_logged, plugin_registry, reporter_for, results_only_on_stdout
from h3gen.errors import UsageError, WriteError
from h3gen.run.loop import Interrupted, missing_directories, remove_if_empty, stop_on_signals
from h3gen.run.settings import RunSettings

WORKER_ENTRY = "h3gen.cli.worker"  # what torchrun starts: a worker that draws with this command's reporters


def run_render(settings: RunSettings, began: float) -> int:
    """`began`: the time.time() the command began, which the run's wall time counts from, in one process or in
    workers."""
    created = missing_directories(settings.output)  # a run stopped before its checks made a place for them too
    try:  # outside the handlers' block: a signal as the block ends (the run done) is caught here too
        with stop_on_signals(created, as_logged):
            return _run_render(settings, began)
    except BrokenPipeError:  # stdout's reader gone in a dry run: the command ends as SIGPIPE ends it
        raise
    except OSError as e:  # a write outside any clip: one line, never a traceback
        import errno

        if e.errno == errno.ENOMEM:  # no write's fault: the host's memory (h3gen.cli.main says so)
            raise
        from h3gen.run.outputs import write_error

        raise WriteError(write_error(Path(e.filename or settings.output), e),
                         "a rerun resumes: clips already written are kept and skipped") from None
    except Interrupted as stop:
        remove_if_empty(created)
        reporter_for(0, False, "", quiet=settings.quiet).warn(
            f"h3gen: stopped by {stop.signal_name}; run the same command again to resume")
        return stop.exit_code


def _run_render(settings: RunSettings, began: float) -> int:
    from h3gen.config.preset import resolve
    from h3gen.run.loop import prepare, render_batch

    found = plugin_registry()
    if settings.strict_plugins:  # the broken plugin is the error, not the preset it would have registered
        from h3gen.run.loop import check_plugins

        check_plugins(found, True, None)
    preset = resolve(settings.preset, found, list(settings.overrides))
    settings = with_preset_workers(settings, preset)
    layout = None
    if settings.parallel.workers:
        from h3gen.parallel.launch import launch_workers, layout_check

        layout = layout_check(settings.parallel)
    else:
        check_one_process(settings)
    if settings.dry_run:  # refused as the run would be
        return dry_run(prepare(settings, preset, found, functools.partial(reporter_for, quiet=settings.quiet),
                               check_layout=layout), settings)
    if layout is not None:
        batch = prepare(settings, preset, found, check_layout=layout)
        try:
            return launch_workers(batch, settings, WORKER_ENTRY, began)
        finally:
            remove_if_empty(batch.created)  # workers that wrote nothing (they failed to load, say) leave no directory
    with results_only_on_stdout():  # a stage's own prints go to stderr
        return render_batch(settings, preset, found, functools.partial(reporter_for, since=began, quiet=settings.quiet))


def dry_run(batch, settings: RunSettings) -> int:
    """One line per clip on stdout (a JSON record with --json): render, skip, conflict or busy, and why. Exits 1 when a
    clip would conflict, as the run itself would."""
    import json

    from h3gen.run.loop import note_moved_seeds, plan
    from h3gen.run.outputs import held_elsewhere
    from h3gen.run.records import request_fields
    from h3gen.run import fingerprint
    from h3gen.run.resume import held_with_other_settings, to_render

    conflicts, planned = 0, plan(batch, settings)
    note_moved_seeds(batch, settings, planned)
    for request, path, found in planned:
        action = "render" if to_render(found) else "skip" if found.status == "skipped" else "conflict"
        why = found.error if found is not None and found.error else None
        if action == "render" and held_elsewhere(path):
            other = held_with_other_settings(path, fingerprint.clip_fields(batch.run_fields, request), bool(request.id))
            action, why = ("conflict", other) if other else ("busy", "another h3gen run is rendering it")
        conflicts += action == "conflict"
        if settings.json_out:
            # busy is no problem: its error is null, as in the run's record of the clip
            print(json.dumps({**request_fields(path, request, batch.preset.name), "action": action,
                              "error": why if action != "busy" else None, "frames": request.frames}), flush=True)
        else:
            print(f"{action:8s} {path}" + (f": {why}" if why else ""), flush=True)
    return 1 if conflicts else 0


def check_one_process(settings: RunSettings) -> None:
    parallel = settings.parallel
    if parallel.ulysses:
        raise UsageError("--ulysses splits a clip across workers, and this run has one process",
                         "add --gpus N or --cpu-workers N")
    machines = [flag for flag, value in (("--nnodes", parallel.nnodes), ("--node-rank", parallel.node_rank),
                                         ("--rdzv-endpoint", parallel.rdzv_endpoint), ("--rdzv-id", parallel.rdzv_id))
                if value is not None]
    if machines:
        raise UsageError(f"{machines[0]} joins machines of a run of workers, and this run has one process",
                         "add --gpus N or --cpu-workers N")


def with_preset_workers(settings: RunSettings, preset) -> RunSettings:
    """Workers asked for by flags, else by the preset's [parallel]; none keeps the run in this process."""
    parallel = settings.parallel
    if parallel.gpus is not None and parallel.cpu_workers is not None:
        raise UsageError("--gpus and --cpu-workers both given", "--gpus N for GPU workers, --cpu-workers N for CPU ones")
    taken = []
    if parallel.gpus is None and parallel.cpu_workers is None:  # the preset's, when the command line says nothing
        parallel = dataclasses.replace(parallel, gpus=preset.parallel["gpus"] or None,
                                       cpu_workers=preset.parallel["cpu_workers"] or None)
        taken += [key for key in ("gpus", "cpu_workers") if preset.parallel[key]]
    if not parallel.ulysses and preset.parallel["ulysses"]:
        if not parallel.workers:
            raise UsageError(f"{preset_key(preset, 'ulysses')}{preset.parallel['ulysses']} splits a clip "
                             "across workers, and this run has one process",
                             "add --gpus N or --cpu-workers N, or set parallel.ulysses to 0")
        parallel = dataclasses.replace(parallel, ulysses=preset.parallel["ulysses"])
        taken.append("ulysses")
    parallel = dataclasses.replace(parallel, named={key: preset_key(preset, key) for key in taken})
    for key in ("gpus", "cpu_workers"):
        if getattr(parallel, key) is not None and getattr(parallel, key) < 1:
            preset_workers = [f"--set parallel.{k}=0" for k in ("gpus", "cpu_workers") if preset.parallel[k]]
            raise UsageError(f"{parallel.said(key)}: at least one worker", "ask for 1 or more" + (
                f"; {' '.join(preset_workers)} runs the preset's clips in one process" if preset_workers else ""))
    return dataclasses.replace(settings, parallel=parallel)


def preset_key(preset, key: str) -> str:
    """Where a [parallel] value came from, as errors name it before the value: a --set of it, or the preset."""
    if preset.sources.get(f"parallel.{key}") == "--set":
        return f"--set parallel.{key}="
    return f"preset {preset.name}'s [parallel] {key} = "
