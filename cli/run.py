"""`h3gen render`: resolve everything that can be checked before a weight loads, then run."""

from __future__ import annotations

import contextlib
import signal
import tempfile
from pathlib import Path

from h3gen.cli.ui import reporter_for
from h3gen.errors import UsageError


class Interrupted(BaseException):
    """SIGINT or SIGTERM: the clip in flight is discarded and the run ends with 128 + the signal number.

    A BaseException, so the per-clip `except Exception` in the render loop lets it through.
    """

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signal_name, self.exit_code = signal.Signals(signum).name, 128 + signum
        self.results = []  # clips finished before the signal


@contextlib.contextmanager
def stop_on_signals():
    """Turn SIGINT and SIGTERM into `Interrupted` in the main thread; a second one ends the process at once."""

    def stop(signum, frame):
        signal.signal(signum, signal.SIG_DFL)
        raise Interrupted(signum)

    previous = {signum: signal.signal(signum, stop) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def check_writable(directory: Path) -> None:
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".h3gen-probe-"):
            pass
    except OSError as e:
        raise UsageError(f"output directory {directory} is not writable ({e.strerror or e})",
                         "pass -o with a directory you can write to") from None


def check_plugins(found, strict: bool, reporter) -> None:
    for name, why in found.failed:
        if strict:
            raise UsageError(f"plugin '{name}' {why}",
                             "fix or uninstall it, leave it out with H3GEN_LOAD_PLUGINS, or drop --strict-plugins")
        reporter.say(f"h3gen: plugin '{name}' {why} (skipped)")


def check_unique_outputs(requests, preset_name: str, prompts: Path) -> None:
    """Two lines that would write one file: the second would silently replace the first."""
    from h3gen.render import clip_name

    first_line = {}
    for request in requests:
        name = clip_name(request, preset_name)
        if name in first_line:
            raise UsageError(f"{prompts}:{request.line}: writes {name}, as line {first_line[name]} does",
                             "give the clips different ids or seeds")
        first_line[name] = request.line


def skip_finished(requests, output: Path, preset_name: str, save_latents: bool, reporter) -> list:
    """Results for the clips a previous run already wrote (file there and valid): a rerun resumes."""
    from h3gen.render import already_done

    from h3gen.outputs import record

    finished = [already_done(request, output, preset_name, save_latents) for request in requests]
    for result in filter(None, finished):
        record(output, result, preset_name, "skipped")
        reporter.clip_done(result)
    return [result for result in finished if result]


def run_render(prompts, output, preset_name, model, seed, overrides, json_out, save_latents,
               force=False, strict_plugins=False) -> int:
    with stop_on_signals():
        try:
            return _run_render(prompts, output, preset_name, model, seed, overrides, json_out, save_latents, force,
                               strict_plugins)
        except Interrupted as stop:
            reporter_for(0, False, "").say(f"h3gen: stopped by {stop.signal_name}; run the same command again to resume")
            return stop.exit_code


def _run_render(prompts, output, preset_name, model, seed, overrides, json_out, save_latents, force,
                strict_plugins) -> int:
    from h3gen.contract import check_adapters
    from h3gen.plugins.manager import registry
    from h3gen.preset import resolve
    from h3gen.prompts import read_prompts

    found = registry()
    preset = resolve(preset_name, found, overrides)
    requests = read_prompts(prompts, seed, preset.request)
    check_unique_outputs(requests, preset.name, prompts)
    check_writable(output)
    reporter = reporter_for(len(requests), json_out, preset.name)
    check_plugins(found, strict_plugins, reporter)
    repo = model_repo(model, reporter)
    check_adapters(preset, requests, repo.root)  # an adapter's step/shift/task contract, before any weight loads
    results = [] if force else skip_finished(requests, output, preset.name, save_latents, reporter)
    finished = {result.request.index for result in results}
    pending = [request for request in requests if request.index not in finished]
    stopped = None
    if pending:  # weights load only when there is something to render
        reporter.say(f"h3gen: {len(pending)} clip(s) to render, preset {preset.name}, model {repo.root}")
        try:
            results += render_pending(pending, output, save_latents, preset, found, repo, reporter, force)
        except Interrupted as stop:
            results += stop.results
            stopped = stop
    reporter.summary(sorted(results, key=lambda r: r.request.index), len(requests))
    if stopped:
        reporter.say(f"h3gen: stopped by {stopped.signal_name}: the clip in flight was discarded; run the same "
                     "command again to render the rest (clips already written are kept and skipped)")
        return stopped.exit_code
    return 0 if all(r.ok for r in results) else 1


def model_repo(model, reporter):
    from h3gen.repo import ModelRepo

    if model is None:
        from h3gen.tiny import TINY_NOTICE, ensure_tiny_model

        model = ensure_tiny_model()
        reporter.say(f"note: {TINY_NOTICE}")
    return ModelRepo(model)


def render_pending(requests, output, save_latents, preset, found, repo, reporter, force=False) -> list:
    """Load the stages once and render every request; on a signal, `Interrupted.results` holds the finished ones."""
    from h3gen.quiet import quiet_libraries
    from h3gen.render import Renderer

    quiet_libraries()
    renderer = Renderer(preset, found, repo, reporter)
    attention = getattr(renderer.stages["sampler"], "attention_backend", None)
    reporter.say(f"h3gen: loaded on {renderer.runtime.device} ({preset.runtime['dtype']})"
                 + (f", attention {attention}" if attention else ""))
    if renderer.runtime.device.startswith("cuda"):
        from h3gen.memory import cuda_fit_warning

        warning = cuda_fit_warning(requests, repo.path("transformer") / "config.json", renderer.runtime.dtype.itemsize)
        if warning:
            reporter.say(f"h3gen: {warning}")
    results, interrupted = [], False
    reporter.start()
    try:
        for result in renderer.render(requests, output, save_latents, force):
            results.append(result)
    except Interrupted as stop:
        stop.results, interrupted = results, True
        raise
    finally:
        results += renderer.close(discard=interrupted)  # the same list `Interrupted.results` holds
        reporter.stop()
    return results
