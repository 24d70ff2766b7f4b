"""`h3gen render`: resolve everything that can be checked before a weight loads, then run."""

from __future__ import annotations

import tempfile
from pathlib import Path

from h3gen.cli.ui import reporter_for
from h3gen.errors import UsageError


def check_writable(directory: Path) -> None:
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".h3gen-probe-"):
            pass
    except OSError as e:
        raise UsageError(f"output directory {directory} is not writable ({e.strerror or e})",
                         "pass -o with a directory you can write to") from None


def run_render(prompts, output, preset_name, model, seed, overrides, json_out, save_latents) -> int:
    from h3gen.plugins.manager import registry
    from h3gen.preset import resolve
    from h3gen.prompts import read_prompts
    from h3gen.repo import ModelRepo

    found = registry()
    preset = resolve(preset_name, found, overrides)
    requests = read_prompts(prompts, seed, preset.request)
    check_writable(output)
    reporter = reporter_for(len(requests), json_out, preset.name)
    if model is None:
        from h3gen.tiny import TINY_NOTICE, ensure_tiny_model

        model = ensure_tiny_model()
        reporter.say(f"note: {TINY_NOTICE}")
    repo = ModelRepo(model)
    reporter.say(f"h3gen: {len(requests)} clip(s), preset {preset.name}, model {repo.root}")

    from h3gen.quiet import quiet_libraries
    from h3gen.render import Renderer

    quiet_libraries()

    renderer = Renderer(preset, found, repo, reporter)
    reporter.say(f"h3gen: loaded on {renderer.runtime.device} ({preset.runtime['dtype']})")
    reporter.start()
    try:
        results = renderer.render(requests, output, save_latents)
    finally:
        reporter.stop()
    reporter.summary(results)
    return 0 if all(r.ok for r in results) else 1
