"""The run loop: check everything that can be checked before a weight loads, skip what is written, render the
rest, report the end. The command line (h3gen.cli) and the workers (h3gen.parallel) both drive a run through here,
and hear of its progress only through a reporter (h3gen.run.report)."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import os
import signal
import tempfile
from pathlib import Path

from h3gen.errors import H3genError, ModelError, UsageError
from h3gen.run.report import SilentReporter
from h3gen.run.settings import RunSettings
from h3gen.text import shown


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # SIGHUP: a closed terminal, an ssh session dropped


class Interrupted(BaseException):
    """SIGINT, SIGTERM or SIGHUP (or stdout's reader gone, as SIGPIPE: h3gen.cli.ui): the clip on the device is
    discarded (a decoded one's background mux is finished) and the run ends with 128 + the signal number.

    A BaseException, so the per-clip `except Exception` in the render loop lets it through.
    """

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signal_name, self.exit_code = signal.Signals(signum).name, 128 + signum
        self.results = []  # clips finished before the signal
        self.discarded = 0  # clips started and not written: on the device, or muxing


_held = {"depth": 0, "signum": None}  # signals_held's state: how deep, and the signal that came meanwhile


@contextlib.contextmanager
def signals_held():
    """Hold a stop signal while a clip's result is recorded and reported: the manifest, the summary and --json then
    never disagree about a clip. The signal is raised as `Interrupted` when the outermost block ends."""
    _held["depth"] += 1
    try:
        yield
    finally:
        _held["depth"] -= 1
        signum, _held["signum"] = _held["signum"], None if not _held["depth"] else _held["signum"]
        if signum is not None and not _held["depth"]:
            raise Interrupted(signum)


@contextlib.contextmanager
def stop_on_signals(created: list[Path] = (), as_logged=str):
    """Turn SIGINT, SIGTERM and SIGHUP into `Interrupted` in the main thread; a second one, of any of the three, ends
    the process at once, with one line (as `as_logged` writes a line of the run's log), its clips' partial files and
    claims removed, and the output directories it made (`created`, innermost first) while they are empty."""

    def end_at_once(signum, frame):
        from h3gen.run.outputs import drop_held_claims

        drop_held_claims()
        with contextlib.suppress(OSError):
            remove_if_empty(created)
        line = as_logged(f"h3gen: ended at once by a second signal ({signal.Signals(signum).name}); the clips in "
                         "flight were dropped, and running the same command again renders them")
        os.write(2, f"{line}\n".encode())
        os._exit(128 + signum)

    def stop(signum, frame):
        for each in STOP_SIGNALS:
            signal.signal(each, end_at_once)
        if _held["depth"]:
            _held["signum"] = signum
            return
        raise Interrupted(signum)

    previous = {signum: signal.signal(signum, stop) for signum in STOP_SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


@dataclasses.dataclass
class Batch:
    """A checked run: everything resolved before a weight loads."""

    preset: object
    found: object
    requests: list  # this run's share of the prompts file (all of it without --shard)
    repo: object
    reporter: object
    run_fields: dict  # the fingerprint fields every clip shares (h3gen.run.fingerprint)
    memory_plan: object = None  # h3gen.run.budget.MemoryPlan on a GPU, None on the CPU
    created: list = dataclasses.field(default_factory=list)  # the output directories the run made (innermost first)


def silent(total: int, json_out: bool, preset: str) -> SilentReporter:
    """A reporter factory for checks that say nothing (the launcher's: its workers' rank 0 says it all again)."""
    return SilentReporter()


def prepare(settings: RunSettings, preset, found, make_reporter=silent, check_layout=None) -> Batch:
    """Check the prompts file, output directory, plugins, model and adapter contracts, then make the run's reporter:
    `make_reporter(total clips in the file, json_out, preset name)`. `check_layout(preset, repo, found)` checks how
    the run is spread over processes (h3gen.parallel.launch's for workers), with the rest."""
    from h3gen.config.contract import check_adapters, check_cache
    from h3gen.config.preset import check_stage_configs
    from h3gen.inputs.prompts import read_prompts, shard_requests
    from h3gen.run.outputs import check_room
    from h3gen.run.render import pick_device
    from h3gen.run.resume import clip_name

    # two lines that write one file are refused across shards too: two shards must not write one file
    every = read_prompts(settings.prompts, settings.seed, preset.request, lambda r: clip_name(r, preset.name))
    requests = shard_requests(every, settings.shard)
    created = missing_directories(settings.output)
    check_writable(settings.output)
    try:
        check_device(preset.runtime["device"])
        if not settings.dry_run:  # a dry run changes nothing in the output directory
            clear_leftovers_of(requests, settings.output, preset.name)
        others = partial_files_beside(every, settings.output, preset.name)
        # A dry run too: it says what the run would do. A run whose clips are all there may render none: each clip
        # that renders is checked for room before its GPU time (Renderer.room_for).
        if requests and (settings.force or any(not (settings.output / clip_name(r, preset.name)).exists()
                                               for r in requests)):
            check_room(settings.output)
        # Clips are numbered by their place in the whole file, so [i/n] means the same in every shard.
        reporter = make_reporter(len(every), settings.json_out, preset.name)
        if settings.shard and not requests:
            index, count = settings.shard
            reporter.say(f"h3gen: shard {index}/{count} holds none of the {len(every)} prompt(s) of "
                         f"{settings.prompts} (prompt k of the file, from 0, goes to shard k mod {count}): "
                         "nothing to do")
        if others:
            shown = ", ".join(path.name for path in others[:3]) + (", ..." if len(others) > 3 else "")
            reporter.say(f"h3gen: note: {settings.output} holds {len(others)} partial file(s) of clips this prompts "
                         f"file does not name ({shown}): a killed run left them, or another run is writing them; a "
                         "run of their prompts removes them, or delete them once no other run writes there")
        check_plugins(found, settings.strict_plugins, reporter)
        repo = model_repo(settings.model)
        check_model_kind(preset, repo, settings.model is None)
        # An adapter's step/shift/task contract, and the partition ref2va runs: before any weight loads.
        check_adapters(preset, requests, repo.root, settings.prompts)
        check_ref2va_partition(requests, repo, settings.prompts)
        check_cache(preset, found)
        check_stage_configs(preset, found, repo, pick_device(preset.runtime["device"]))
        if check_layout is not None:
            check_layout(preset, repo, found)
        memory_plan = plan_memory_budget(preset, requests, repo, reporter, settings.parallel.workers or 1)
    except BaseException:
        remove_if_empty(created)  # a refused run leaves no directory it made behind
        raise
    if settings.dry_run:
        remove_if_empty(created)  # nor does a dry run
    from h3gen.run.fingerprint import run_fields

    return Batch(preset, found, requests, repo, reporter, run_fields(preset, found, repo), memory_plan, created)


def check_ref2va_partition(requests, repo, prompts: Path) -> None:
    """ref2va runs the transformer_ref/ partition: a model directory without it, or with it incomplete, is refused at
    the prompts file's first ref2va line, not after the other weights load."""
    from h3gen.models.repo import ModelRepo

    first = next((r for r in requests if r.task == "ref2va"), None)
    if first is None or getattr(repo, "root", None) is None:
        return
    if not (repo.root / "transformer_ref").is_dir():
        raise ModelError(f"{prompts}:{first.line}: a ref2va clip (references) runs the transformer_ref/ partition, "
                         f"which {repo.root} does not have",
                         "download transformer_ref/ of MiniMaxAI/MiniMax-H3 into the model directory, or drop the "
                         "ref2va lines")
    ModelRepo(repo.root, components=("transformer_ref",))  # safetensors only, complete and readable


def missing_directories(output: Path) -> list[Path]:
    """`output` and the folders above it that are not there yet (innermost first): what a run that writes into
    `output` makes, for `remove_if_empty`."""
    return [d for d in [output, *output.parents] if not d.exists()]


def remove_if_empty(created: list[Path]) -> None:
    """Remove the directories this run made for its output (innermost first) while they are empty."""
    for made in created:
        if not made.is_dir() or any(made.iterdir()):
            return
        made.rmdir()


def plan_memory_budget(preset, requests, repo, reporter, processes: int = 1):
    """The run's memory plan (h3gen.run.budget; None on the CPU, where the clips must fit the host memory free in
    each of this machine's `processes`), which the sampler and encoder follow, said once."""
    from h3gen.run.budget import planned
    from h3gen.run.render import pick_device

    plan = planned(preset, requests, repo, pick_device(preset.runtime["device"]), processes)
    if plan is not None:
        reporter.say(f"h3gen: {plan.describe()}")
    return plan


def check_writable(directory: Path) -> None:
    from h3gen.run import outputs

    if directory.exists() and not directory.is_dir():
        raise UsageError(f"output directory {directory} is not a directory", "pass -o with a directory, or a path not "
                         "yet taken")
    dangling = next((d for d in [directory, *directory.parents] if d.is_symlink() and not d.exists()), None)
    if dangling is not None:
        raise UsageError(f"output directory {directory} cannot be created: {dangling} is a link to "
                         f"{os.readlink(dangling)}, which is not there",
                         "create the folder the link points to, or pass -o with another directory")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".h3gen-probe-"):
            pass
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):  # not the folder's fault: its disk's, as a full disk mid-run is
            outputs.check_room(next(d for d in [directory, *directory.parents] if d.is_dir()))
        what = "cannot be created" if not directory.is_dir() else "is not writable"
        why = e.strerror or str(e)
        if directory.is_dir() and e.errno == errno.ENOENT:  # /proc: there, yet no file can be made in it
            why = "no file can be created in it"
        raise UsageError(f"output directory {directory} {what} ({why})",
                         "pass -o with a directory you can write to") from None
    try:
        outputs.check_manifest(directory)
    except OSError as e:
        raise UsageError(f"the run's manifest {e.filename} cannot be written ({e.strerror})",
                         "move what is in its place away, or pass -o with another directory") from None


def clear_leftovers_of(requests, output: Path, preset_name: str) -> None:
    """What a killed run left of this run's clips (partial files, locks) goes, unless a live run still holds it."""
    from h3gen.run import outputs
    from h3gen.run.resume import clip_name

    for request in requests:
        outputs.clear_leftovers(output / clip_name(request, preset_name))


def partial_files_beside(requests, output: Path, preset_name: str) -> list[Path]:
    """The hidden partial files in `output` of clips none of `requests` names. They are only named: clearing them
    would take locks other runs may want."""
    from h3gen.run import outputs
    from h3gen.run.resume import clip_name

    return outputs.partial_files_of_others(output, [output / clip_name(r, preset_name) for r in requests])


def check_device(device: str) -> None:
    """A CUDA device asked for where torch sees none: said as such, not as the model failing to load."""
    if not device.startswith("cuda"):
        return
    import torch

    if not torch.cuda.is_available():
        raise UsageError(f"runtime.device is {device} but no CUDA device is visible",
                         "use --set runtime.device=cpu (or auto), or run where torch sees a GPU")


def check_plugins(found, strict: bool, reporter) -> None:
    from h3gen.plugins.manager import NOT_INSTALLED, package_of

    for name, why in found.failed:
        package = package_of(name)
        uninstall = f" (pip uninstall {package})" if package else ""
        fix = ("correct the name in H3GEN_LOAD_PLUGINS or install the plugin" if why.startswith(NOT_INSTALLED)
               else f"fix or uninstall it{uninstall}, leave it out with H3GEN_LOAD_PLUGINS")
        if strict:
            others = [other for other, _ in found.failed if other != name]
            also = f"; plugin(s) {', '.join(map(repr, others))} failed too (h3gen plugins says why)" if others else ""
            raise UsageError(f"plugin '{name}' {why}{also}",
                             f"{fix}, or run without --strict-plugins and H3GEN_STRICT_PLUGINS")
        reporter.warn(f"h3gen: plugin '{name}' {why} (skipped; {fix})")


def check_model_kind(preset, repo, embedded: bool, baseline: bool = False, bench: bool = False) -> None:
    """A preset made for the tiny model on a real repository, or for a real one on the tiny model, renders nothing
    worth having: stop before any weight loads. `baseline`: the preset is `h3gen bench`'s baseline; `bench`: the
    check is `h3gen bench`'s, which can run any preset on random weights instead."""
    needs, has = preset.model["needs"], repo.kind()
    if needs in ("any", has):
        return
    if needs == "MiniMax-H3":
        given = ("no --model was given, so the embedded tiny model stands in" if embedded
                 else f"{repo.root} holds a tiny model")
    else:
        given = f"{repo.root} is a MiniMax-H3 repository"
    if preset.sources.get("model.needs") == "--set":  # the run's own --set asks for the other kind of model
        raise UsageError(f"--set model.needs={needs}, and {given}",
                         "leave out --set model.needs, or pass --model DIR with the model it names")
    anyway = f"or --set model.needs=any to run preset {preset.name} on it anyway"
    if needs != "MiniMax-H3":
        raise UsageError(f"preset {preset.name} is made for the tiny smoke-test model, and {given}",
                         f"leave out --preset (h3-base), pick one from `h3gen presets list`, {anyway}")
    instead = "--baseline none" if baseline else "--preset tiny"
    if bench:
        from h3gen.run.render import pick_device

        gpu = pick_device(preset.runtime["device"]).startswith("cuda")
        instead = f"--random-weights full{'' if gpu else ' on a GPU'} (its architecture, random weights), {instead}"
    raise UsageError(f"preset {preset.name} needs a MiniMax-H3 repository, and {given}",
                     f"pass --model DIR (or H3GEN_MODEL) with the MiniMax-H3 repository, {instead}, {anyway}")


def model_repo(model):
    from h3gen.models.repo import ModelRepo

    if model is None:
        from h3gen.models.tiny import ensure_tiny_model

        model = ensure_tiny_model()
    return ModelRepo(model)


def note_tiny(settings: RunSettings, reporter) -> None:
    """Said when the embedded tiny model is about to render: not when every clip is already there."""
    if settings.model is None:
        from h3gen.models.tiny import TINY_NOTICE

        reporter.say(f"note: {TINY_NOTICE}")


def say_to_render(batch: Batch, settings: RunSettings, pending: list, where: str = "") -> None:
    """The run's header, when it has clips to render: how many, the preset and the model (`where` they run)."""
    if pending:
        note_tiny(settings, batch.reporter)
        batch.reporter.say(f"h3gen: {len(pending)} clip(s) to render, preset {batch.preset.name}, model "
                           f"{batch.repo.root}{where}")


def plan(batch: Batch, settings: RunSettings) -> list:
    """What a run would do with each clip, without loading a weight: (request, path, the skip check's result) per
    request, in file order; a result of None: it would render."""
    from h3gen.run.resume import already_done, clip_name

    return [(request, settings.output / clip_name(request, batch.preset.name),
             already_done(request, settings.output, batch.preset.name, settings.save_latents, batch.run_fields,
                          settings.redo))
            for request in batch.requests]


def note_moved_seeds(batch: Batch, settings: RunSettings, planned: list) -> None:
    """Warn when the clips `plan` leaves to render moved off their default seeds (h3gen.run.resume.moved_seeds)."""
    from h3gen.run.resume import moved_seeds, to_render

    pending = [request for request, _, found in planned if to_render(found)]
    moved = moved_seeds(pending, batch.requests, settings.output, batch.preset.name, settings.seed)
    if moved:
        batch.reporter.warn(f"h3gen: note: {moved}")


def skip_finished(batch: Batch, settings: RunSettings, announce=None) -> list:
    """Results for the clips a previous run already wrote (file there, valid, same fingerprint): a rerun resumes;
    and for those it wrote with other settings (conflicts), which this run leaves alone; none of either that
    `settings.redo` renders again. `announce(pending)` says the run's header before each clip's line."""
    from h3gen.run.outputs import record
    from h3gen.run.resume import DAMAGED, to_render

    preset_name, reporter, output = batch.preset.name, batch.reporter, settings.output
    planned = plan(batch, settings)
    if announce is not None:
        announce([request for request, _, found in planned if to_render(found)])
    note_moved_seeds(batch, settings, planned)
    finished, unnoted = [], None
    for result in filter(None, (found for _, _, found in planned)):
        if to_render(result):  # a damaged MP4 is news even to --quiet: something changed a file h3gen wrote whole
            tell = reporter.warn if result.error.startswith(DAMAGED) else reporter.say
            tell(f"note: {shown(str(result.path))} is {result.error}")
        else:  # its file tells that it is done, whether or not its line is added to the manifest (a full disk)
            unnoted = record(output, result, preset_name, result.status) or unnoted
            finished.append(result)
            reporter.clip_done(result)
    if unnoted is not None:
        reporter.say(f"note: cannot write {shown(unnoted.filename)}: {unnoted.strerror or unnoted}; the clips already "
                     "written are skipped all the same, without their line")
    return finished


def render_batch(settings: RunSettings, preset, found, make_reporter) -> int:
    """A one-process run: check, skip what is written, render the rest, report; the exit status."""
    batch = prepare(settings, preset, found, make_reporter)
    reporter, requests = batch.reporter, batch.requests
    results = skip_finished(batch, settings, functools.partial(say_to_render, batch, settings))
    finished = {result.request.index for result in results}
    pending = [request for request in requests if request.index not in finished]
    stopped = None
    try:
        if pending:  # weights load only when there is something to render
            try:
                results += render_pending(pending, settings, preset, found, batch.repo, reporter,
                                          memory_plan=batch.memory_plan,
                                          there=[result for result in results if result.status == "skipped"])
            except Interrupted as stop:
                results += stop.results
                stopped = stop
            except H3genError as error:
                summary_before(error, reporter, results, len(requests))
                raise
    finally:
        remove_if_empty(batch.created)  # a run that wrote nothing (it failed to load, say) leaves no directory
    return report_end(reporter, results, len(requests), stopped)


def summary_before(error, reporter, results: list, total: int) -> None:
    """The summary of a run an error ends once its clips began to render (not in loading), so that it agrees with
    the manifest; the error's line follows it."""
    if hasattr(error, "results"):
        reporter.summary(sorted(results + error.results, key=lambda r: r.request.index), total)


def report_end(reporter, results, total: int, stopped=None, say_stopped: bool = True) -> int:
    """The summary, and the exit status: 0 all written, 1 some failed or without a manifest line, 128 + signal when
    stopped, or when the reporter ends the run with one (stdout's reader gone after the last clip started: 141 all
    the same). With workers the launcher says why they stopped (`say_stopped` False): only it knows whether the
    signal came from the user."""
    reporter.summary(sorted(results, key=lambda r: r.request.index), total)
    if stopped:
        if say_stopped:
            reporter.warn(stopped_line(stopped.signal_name, stopped.discarded, total - len(results)))
        return stopped.exit_code
    signum = reporter.ended_by()
    if signum:
        reporter.warn("h3gen: stdout's reader went away once no clip was left to start: the clips in flight were "
                      "finished, and manifest.jsonl holds every clip's record")
        return 128 + signum
    return 0 if all(r.ok and not r.unrecorded for r in results) else 1


def stopped_line(signal_name: str, discarded: int | None, unfinished: int | None = None) -> str:
    """The line a stopped run ends with; `discarded`: the clips in flight it dropped, `unfinished`: the clips of the
    run without a result (None: not known here)."""
    if unfinished == 0 and not discarded:
        return f"h3gen: stopped by {signal_name} as the run ended: every clip has its result"
    dropped = ("any clip in flight was discarded" if discarded is None else "no clip was in flight" if not discarded
               else "the clip in flight was discarded" if discarded == 1
               else f"the {discarded} clips in flight were discarded")
    return (f"h3gen: stopped by {signal_name}: {dropped}; run the same command again to render the rest (clips "
            "already written are kept and skipped)")


def idle_gpus_note(clips: int, gpus: int) -> str:
    """What a one-process run of `clips` clips on a machine of `gpus` GPUs leaves idle, and the flag that would not."""
    if clips < 2 or gpus < 2:
        return ""
    return (f"this run renders on one GPU and the other {gpus - 1} of this machine stay idle; --gpus {min(gpus, clips)} "
            f"renders {'a clip on each' if clips >= gpus else f'the {clips} clips at once'}")


def render_pending(requests, settings: RunSettings, preset, found, repo, reporter, group=None, leader=0,
                   memory_plan=None, there=()) -> list:
    """Load the stages once and render every request; on a signal, `Interrupted.results` holds the finished ones.
    `there`: results of valid clips the run found written, whose sizes tell what the next clips will take.

    With `group` (a process group of two or more ranks rendering each clip together; `leader` is its first rank)
    this rank renders its share of every clip, and only the leader gets results."""
    from h3gen.run.quiet import quiet_libraries
    from h3gen.run.render import Renderer

    quiet_libraries()
    if group is None:
        renderer = Renderer(preset, found, repo, reporter, memory_plan)
    else:
        from h3gen.parallel.group_render import GroupRenderer

        renderer = GroupRenderer(preset, found, repo, reporter, group, leader, memory_plan)
    for result in there:
        renderer.learn_size(result)
    notes = "".join(f", {note}" for note in (stage.load_note() for stage in renderer.stages.values()) if note)
    reporter.say(f"h3gen: loaded on {renderer.runtime.device} ({preset.runtime['dtype']}){notes}")
    if renderer.runtime.device.startswith("cuda") and group is None and not settings.parallel.workers:
        import torch

        idle = idle_gpus_note(len(requests), torch.cuda.device_count())
        if idle:
            reporter.say(f"h3gen: note: {idle}")
    from h3gen.run.memory import cuda_fit_warning, host_fit_warning

    fits = cuda_fit_warning if renderer.runtime.device.startswith("cuda") else host_fit_warning
    warning = fits(requests, repo.transformer_config(), renderer.runtime.dtype.itemsize)
    if warning:
        reporter.warn(f"h3gen: {warning}")
    interrupted = False
    reporter.start()
    try:
        try:
            for _ in renderer.render(requests, settings.output, settings.save_latents, settings.redo):
                pass  # every result is in renderer.results from the moment its manifest line is written
        except Interrupted:
            interrupted = True
            raise
        finally:
            renderer.close(discard=interrupted)  # the clips it finishes join renderer.results too
            reporter.stop()
    except Interrupted as stop:  # in the render or in close()
        stop.results, stop.discarded = renderer.results, renderer.discarded
        raise
    except H3genError as error:  # an error that ends the run (a model no clip can use, a group's lost rank)
        error.results = renderer.results
        raise
    return renderer.results
