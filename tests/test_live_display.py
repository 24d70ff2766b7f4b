"""The live display on a terminal when Ctrl-C stops a run: the stopped clip's bar goes with the display, and a run
that finished no clip prints its counts, not an empty table."""

import io
import os
import re
import signal
import time
from pathlib import Path
from types import SimpleNamespace

from rich.console import Console

from h3gen.inputs.request import Request
from h3gen.stages.clip import Clip

PROMPTS = ("a red fox trots through fresh snow", "waves crash on a rocky shore")


def screen(output: str) -> list[str]:
    """The lines a terminal shows after `output`, for the little of VT100 a rich live display writes: carriage
    return, line feed, erase line and cursor up (colours and the cursor's visibility change no text)."""
    lines, row, column = [""], 0, 0
    for token in re.split(r"(\x1b\[[0-9;?]*[A-Za-z]|\r|\n)", output):
        up = re.fullmatch(r"\x1b\[(\d*)A", token)
        if token == "\n":
            row, column = row + 1, 0
            lines += [""] * (row + 1 - len(lines))
        elif token == "\r":
            column = 0
        elif token == "\x1b[2K":
            lines[row] = ""
        elif up:
            row = max(0, row - int(up.group(1) or 1))
        elif token and not token.startswith("\x1b"):
            line = lines[row].ljust(column)
            lines[row] = line[:column] + token + line[column + len(token):]
            column += len(token)
    return [line.rstrip() for line in lines if line.strip()]


class StoppedByCtrlC:
    """A renderer whose first clip is drawn on the display, three denoise steps in, when Ctrl-C comes."""

    def __init__(self, preset, found, repo, reporter, memory_plan=None):
        self.reporter, self.results, self.discarded = reporter, [], 0
        self.stages, self.runtime = {}, SimpleNamespace(device="cpu", dtype=SimpleNamespace(itemsize=4))

    def render(self, requests, out_dir, save_latents, force):
        clip = Clip(requests[0], out_dir / "a.mp4")
        self.reporter.clip_started(clip)
        for step in range(1, 4):
            self.reporter.step(clip, step, 10)
        self.reporter.progress.refresh()  # the bar is on the screen
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(10)  # the signal ends the wait
        yield

    def close(self, discard):
        self.discarded = int(discard)  # the clip on the display


def test_ctrl_c_takes_the_stopped_clip_s_bar_away_and_prints_no_empty_table(monkeypatch, tmp_path):
    from h3gen.cli import ui
    from h3gen.run import loop, quiet, render

    terminal = io.StringIO()
    monkeypatch.setattr(ui, "Console", lambda **_: Console(file=terminal, force_terminal=True, width=200,
                                                           color_system=None))
    monkeypatch.setattr(render, "Renderer", StoppedByCtrlC)
    monkeypatch.setattr(quiet, "quiet_libraries", lambda: None)
    reporter = ui.LiveReporter(len(PROMPTS))
    requests = [Request(i, prompt, i, 32, 32, 124, line=i + 1) for i, prompt in enumerate(PROMPTS)]
    settings = SimpleNamespace(output=tmp_path, save_latents=False, redo="")
    preset = SimpleNamespace(runtime={"dtype": "float32"})

    with loop.stop_on_signals():
        try:
            repo = SimpleNamespace(transformer_config=dict)  # full size's shape: a 32x32 clip fits in memory
            loop.render_pending(requests, settings, preset, None, repo, reporter)
        except loop.Interrupted as stop:
            code = loop.report_end(reporter, stop.results, len(requests), stop)

    assert code == 130
    assert "[1/2] a red fox" in terminal.getvalue()  # drawn while the clip rendered
    assert not reporter.progress.tasks and not reporter.progress.live.is_started
    assert "h3gen render summary" not in terminal.getvalue()  # no table without a finished clip
    assert screen(terminal.getvalue()) == [  # no bar left: neither the clip's nor the batch's
        "h3gen: loaded on cpu (float32)", "0 of 2 clips written, 2 not rendered (0s in all)",
        "h3gen: stopped by SIGINT: the clip in flight was discarded; run the same command again to render the rest "
        "(clips already written are kept and skipped)"]


def test_the_summary_on_a_narrow_terminal_keeps_each_clip_s_whole_name(monkeypatch):
    """A name wider than its column folds onto more lines; none is cut short."""
    from h3gen.cli import ui
    from h3gen.run.records import ClipResult

    terminal = io.StringIO()
    monkeypatch.setattr(ui, "Console", lambda **_: Console(file=terminal, force_terminal=True, width=80,
                                                           color_system=None))
    name = "a-lighthouse-on-a-cliff-at-night-with-waves-breaking-below-take-2.mp4"
    request = Request(0, "a lighthouse", 1, 32, 32, 124, line=1)
    result = ClipResult(request, Path("out") / name, True, {"sampler": 1.0}, 1.0)
    ui.LiveReporter(1).summary([result])
    cells = "".join(line.split("│")[1].strip() for line in terminal.getvalue().splitlines() if line.startswith("│"))
    assert name in cells


def test_a_dumb_terminal_and_a_quiet_run_get_no_live_display(monkeypatch):
    import sys

    from h3gen.cli.ui import LiveReporter, PlainReporter, QuietReporter, reporter_for

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    monkeypatch.setenv("TERM", "xterm-256color")
    assert type(reporter_for(2, False, "tiny")) is LiveReporter
    assert type(reporter_for(2, False, "tiny", quiet=True)) is QuietReporter
    monkeypatch.setenv("TERM", "dumb")
    assert type(reporter_for(2, False, "tiny")) is PlainReporter


def test_a_quiet_run_stopped_before_its_clips_are_all_rendered_says_the_counts(capsys, tmp_path):
    """Clips not rendered need someone as a failed one does; a run that wrote all it had says nothing."""
    from h3gen.cli.ui import QuietReporter
    from h3gen.inputs.request import Request
    from h3gen.run.records import ClipResult

    written = ClipResult(Request(0, "x", 0, 32, 32, 124), tmp_path / "a.mp4", True, {}, 0.0)
    QuietReporter(3).summary([written], 3)
    assert "1 of 3 clips written, 2 not rendered" in capsys.readouterr().err
    QuietReporter(1).summary([written], 1)
    assert capsys.readouterr().err == ""


def test_a_stop_as_the_run_ends_does_not_ask_for_a_rerun():
    from h3gen.run.loop import stopped_line

    assert stopped_line("SIGINT", 0, 0) == "h3gen: stopped by SIGINT as the run ended: every clip has its result"
    assert "run the same command again" in stopped_line("SIGINT", 0, 2)
    assert "run the same command again" in stopped_line("SIGINT", 1, 0)


def test_a_long_prompt_is_abridged_in_the_plain_lines(capsys):
    from types import SimpleNamespace

    from h3gen.cli.ui import PlainReporter

    request = SimpleNamespace(index=0, width=32, height=32, frames=124, seed=7, prompt="a fox " * 100_000)
    PlainReporter(1).clip_started(SimpleNamespace(request=request, path=Path("x.mp4")))
    line = capsys.readouterr().err.strip().split(" ", 2)[2]  # after the date and time
    assert line == f"[1/1] x.mp4: 32x32 124 frames, seed 7: {'a fox ' * 50}... (600000 characters)"
