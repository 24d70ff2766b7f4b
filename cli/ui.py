"""What the user sees on stderr while a run works: a live rich display on a terminal, plain lines otherwise, or only
what went wrong (-q). Each implements the run loop's reporter protocol (h3gen.run.report).

stdout is kept for results (`--json`), so every display here writes to stderr; while clips render, anything else
written to stdout goes to stderr too (`results_only_on_stdout`).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

from rich.console import Console
from rich.markup import escape as markup_escape
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                           TimeRemainingColumn)
from rich.table import Table

from h3gen.run.records import clip_record
from h3gen.run.report import SilentReporter
from h3gen.text import abridged, shown

STAGE_ORDER = ("encode", "sampler", "vae", "mux")
# Seconds between two plain lines of a stage's progress (H3GEN_HEARTBEAT_S): often enough to see a run is alive.
HEARTBEAT_S = 60.0


def duration_text(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s" if rest >= 60 else f"{rest}s"


def seconds_text(seconds: dict) -> str:
    return "  ".join(f"{k} {seconds[k]:.2f}s" for k in STAGE_ORDER if k in seconds)


_results = None  # stdout, while `results_only_on_stdout` keeps it for the results


@contextlib.contextmanager
def results_only_on_stdout():
    """While it lasts, stdout carries only the lines `print_result` writes: anything else written there (a plugin's
    print, a library's output, from Python or from C) goes to stderr, so `--json` stays one record a line."""
    global _results
    try:
        stdout = sys.stdout.fileno()
    except (AttributeError, ValueError):  # no descriptor (a test runner's buffer: io.UnsupportedOperation)
        stdout = None
    if _results is not None or stdout is None:
        yield
        return
    sys.stdout.flush()
    _results = os.fdopen(os.dup(stdout), "w", encoding=sys.stdout.encoding, errors=sys.stdout.errors)
    os.dup2(sys.stderr.fileno(), stdout)
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            sys.stdout.flush()
        os.dup2(_results.fileno(), stdout)  # where results went: stdout, or /dev/null once its reader had gone
        with contextlib.suppress(OSError):
            _results.close()
        _results = None


def plugin_registry():
    """The plugins' registry, loaded with stdout kept for results: what a plugin prints as it is imported or
    registers goes to stderr, not into a list, a completion or --json."""
    from h3gen.plugins.manager import registry

    with results_only_on_stdout():
        return registry()


def print_result(line: str) -> bool:
    """One line on stdout; False when its reader has gone (`| head -1`). Any other failure to write it (a full disk)
    ends the run with a WriteError that names standard output, not the clips' folder."""
    from h3gen.errors import WriteError

    try:
        print(line, file=_results or sys.stdout, flush=True)
        return True
    except BrokenPipeError:
        silence_stdout()
        return False
    except OSError as e:
        silence_stdout()
        raise WriteError(f"cannot write the --json lines to standard output ({e.strerror or e})",
                         "give standard output somewhere with room; a rerun resumes, keeping the clips written") \
            from None


def silence_stdout() -> None:
    """Point stdout at /dev/null once its reader has gone, so the interpreter's last flush has somewhere to go."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, (_results or sys.stdout).fileno())
    os.close(devnull)


def heartbeat_seconds() -> float:
    """H3GEN_HEARTBEAT_S, or the default when it is unset or empty."""
    import math

    from h3gen.errors import UsageError

    text = os.environ.get("H3GEN_HEARTBEAT_S", "").strip()
    try:
        seconds = float(text) if text else HEARTBEAT_S
    except ValueError:
        seconds = math.nan
    if not seconds >= 0:  # nan too
        raise UsageError(f"H3GEN_HEARTBEAT_S is '{text}', not a number of seconds from 0 up",
                         f"set it to 0 or more seconds, or unset it for the default {HEARTBEAT_S:g}")
    return seconds


class PlainReporter(SilentReporter):
    """One line per event: what cron and make logs want."""

    def __init__(self, total: int, json_out: bool = False, preset: str = "", since: float | None = None):
        """`since`: the time.time() the command began, when before this reporter (the run's wall time counts from
        it: a worker's reporter starts after the launcher and torchrun have)."""
        self.total, self.json_out, self.preset = total, json_out, preset
        self.console = Console(stderr=True, highlight=False, soft_wrap=True)
        self.stdout_gone = self.reader_gone = False  # a stop not yet raised; the reader gone, for good
        self.began = time.monotonic() - (max(0.0, time.time() - since) if since is not None else 0.0)
        self.heartbeat = heartbeat_seconds()
        self.clip_began, self.last_beat = {}, {}  # request index -> monotonic time

    def check_stdout(self) -> None:
        """After stdout's reader has gone, the run ends as SIGPIPE ends other tools, with 141: when the next clip
        goes to the device, so every clip finished so far is counted, and the clips in flight are discarded as on
        any signal. (Rank 0 of a worker run also reports the other groups' clips,
        from a thread of its own; those go on to the end.)"""
        if self.stdout_gone and threading.current_thread() is threading.main_thread():
            from h3gen.run.loop import Interrupted

            self.stdout_gone = False
            raise Interrupted(signal.SIGPIPE)

    def ended_by(self):
        return signal.SIGPIPE if self.reader_gone else None

    def say(self, text: str) -> None:
        """A line for a log: timestamped, escaped (a prompt can hold anything). A log that cannot be written (its
        disk full) loses the line; the run goes on, its clips and manifest.jsonl written as ever."""
        try:
            self.console.print(timestamped(shown(text)), markup=False)
        except OSError:
            pass

    def warn(self, text: str) -> None:
        self.say(text)

    def clip_started(self, clip):
        self.check_stdout()
        request = clip.request
        self.clip_began[request.index] = self.last_beat[request.index] = time.monotonic()
        self.say(f"[{request.index + 1}/{self.total}] {clip.path.name}: {request.width}x{request.height} "
                 f"{request.frames} frames, seed {request.seed}: {abridged(request.prompt)}")

    def stage_done(self, clip, kind, seconds):
        self.say(f"[{clip.request.index + 1}/{self.total}] {kind} {seconds:.2f}s")

    def step(self, clip, step, steps):
        """A heartbeat inside the sampler: `[1/3] sampler step 12/49, 6m10s, ETA 18m`, every `heartbeat` seconds."""
        index, now = clip.request.index, time.monotonic()
        began = self.clip_began.setdefault(index, now)
        if now - self.last_beat.setdefault(index, began) < self.heartbeat:
            return
        self.last_beat[index] = now
        spent = now - began
        self.say(f"[{index + 1}/{self.total}] sampler step {step}/{steps}, {duration_text(spent)}, "
                 f"ETA {duration_text(spent / step * (steps - step))}")

    def clip_done(self, result):
        if result.status == "conflict":
            self.warn(f"[{result.request.index + 1}/{self.total}] {result.path}: {result.error}")
        elif result.skipped:
            self.say(f"[{result.request.index + 1}/{self.total}] skipped {result.path}: "
                     + (result.note or "already there and valid (--force renders it again)"))
        elif result.ok:
            reused = (f", {result.forwards_reused} of {result.forwards} forwards reused" if result.forwards_reused
                      else "")
            self.say(f"[{result.request.index + 1}/{self.total}] wrote {result.path} in {result.end_to_end:.2f}s "
                     f"(RTF {result.rtf:.2f}{reused})")
            if result.unrecorded:
                self.warn(f"[{result.request.index + 1}/{self.total}] {result.path} has no manifest line: "
                          f"{result.unrecorded}")
        else:
            self.warn(f"[{result.request.index + 1}/{self.total}] FAILED {result.path}: {result.error}")
        if self.json_out and not print_result(json.dumps(clip_record(result, self.preset))):
            self.stdout_gone = self.reader_gone = True  # later lines go to /dev/null, and do not clear it

    def summary(self, results, total: int | None = None):
        """The table of clips, then one line of counts with the run's wall time, and one line per clip not written
        with its reason."""
        if results:  # a run stopped before any clip finished has no table to show
            self.print_table([summary_row(r) for r in results])
        trouble, total = [r for r in results if not r.ok], len(results) if total is None else total
        # Clips not rendered (a stop) need someone too: -q says the counts then
        (self.warn if trouble or total > len(results) else self.say)(
            f"{counts_line(results, total)} ({duration_text(time.monotonic() - self.began)} in all)")
        for r in trouble:
            self.warn(f"  {r.status} {r.path.name} (line {r.request.line}): {r.error}")

    def print_table(self, rows: list[tuple]) -> None:
        """Plain aligned text with full names, for a log."""
        self.say("h3gen render summary")
        for line in aligned(SUMMARY_COLUMNS, rows, left=2):
            self.say(line)


def aligned(header: tuple, rows: list, left: int) -> list[str]:
    """A table as plain lines for a log: every cell whole, the first `left` columns flush left, the rest right."""
    rows = [header, *rows]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return ["  ".join(cell.ljust(w) if i < left else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
            .rstrip() for row in rows]


SUMMARY_COLUMNS = ("clip", "status", *STAGE_ORDER, "end to end", "RTF")


def summary_row(r) -> tuple:
    return (r.path.name, r.status, *(f"{r.seconds[k]:.2f}s" if k in r.seconds else "-" for k in STAGE_ORDER),
            f"{r.end_to_end:.2f}s" if r.rendered else "-", f"{r.rtf:.2f}" if r.rendered else "-")


def counts_line(results, total: int) -> str:
    count = {status: sum(r.status == status for r in results) for status in ("ok", "skipped", "busy", "conflict",
                                                                            "failed")}
    written, skipped, busy, conflicts, failed = count.values()
    parts = [f"{written} of {total} clips written"]
    parts += [f"{skipped} already there and valid (skipped)"] if skipped else []
    parts += [f"{busy} left to another run rendering them"] if busy else []
    parts += [f"{conflicts} in conflict with a file there (other settings, or not h3gen's: left alone, each line "
              "below says why and what renders it)"] if conflicts else []
    parts += [f"{failed} failed"] if failed else []
    parts += [f"{total - len(results)} not rendered"] if total > len(results) else []
    return ", ".join(parts)


class LiveReporter(PlainReporter):
    """A live display on a terminal: a line per clip in flight (the one on the device with its denoise steps, the
    ones still muxing in the background), finished clips printed above them."""

    def __init__(self, total: int, json_out: bool = False, preset: str = "", since: float | None = None):
        super().__init__(total, json_out, preset, since)
        self.progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), TimeRemainingColumn(), TextColumn("{task.fields[stages]}"),
                                 console=self.console, redirect_stdout=False, redirect_stderr=False)
        self.tasks = {}  # request index -> progress task
        self.batch, self.done_early = None, 0  # the batch's own line (clips done of the file's, its ETA)

    def say(self, text: str) -> None:
        self.progress.console.print(shown(text), markup=False)

    def start(self):
        self.progress.start()
        if self.batch is None:
            self.batch = self.progress.add_task("batch", total=self.total, completed=self.done_early, stages="")
        return self

    def print_table(self, rows: list[tuple]) -> None:
        table = Table(title="h3gen render summary", title_justify="left")
        for column in SUMMARY_COLUMNS:  # a name wider than its column folds onto more lines, never cut short
            table.add_column(column, justify="left" if column in ("clip", "status") else "right",
                             overflow="fold" if column == "clip" else "ellipsis")
        for row in rows:
            table.add_row(*row)
        self.console.print(table)

    def stop(self):
        """The display goes with the run: no bar of a discarded clip is left frozen on the terminal."""
        for task in [*self.tasks.values(), *([self.batch] if self.batch is not None else [])]:
            self.progress.remove_task(task)
        self.tasks.clear()
        self.batch = None
        self.progress.stop()

    def clip_started(self, clip):
        self.check_stdout()
        r = clip.request
        prompt = shown(r.prompt)
        prompt = prompt if len(prompt) <= 32 else prompt[:31] + "…"
        self.tasks[r.index] = self.progress.add_task(markup_escape(f"[{r.index + 1}/{self.total}] {prompt}"),
                                                     total=None, stages="")

    def stage_done(self, clip, kind, seconds):
        if clip.request.index in self.tasks:
            self.progress.update(self.tasks[clip.request.index], stages=seconds_text(clip.seconds))

    def step(self, clip, step, steps):
        if clip.request.index in self.tasks:
            self.progress.update(self.tasks[clip.request.index], completed=step, total=steps)

    def clip_done(self, result):
        task = self.tasks.pop(result.request.index, None)
        if task is not None:
            self.progress.remove_task(task)
        if self.batch is not None:
            self.progress.advance(self.batch)
        else:
            self.done_early += 1  # skipped before the display starts
        super().clip_done(result)
        if result.ok and not result.skipped:
            self.say(f"    {seconds_text(result.seconds)}")


class QuietReporter(PlainReporter):
    """--quiet: only the lines that need someone (warnings, the counts with a line for each clip failed or in
    conflict, a stop), so a cron job that went well prints nothing. --json's lines are printed as ever."""

    finishing_clip = False

    def say(self, text: str) -> None:
        pass

    def warn(self, text: str) -> None:
        if not self.finishing_clip:
            super().say(text)

    def clip_done(self, result):
        """A clip failed or in conflict is said once, with its reason after the counts."""
        self.finishing_clip = True
        try:
            super().clip_done(result)
        finally:
            self.finishing_clip = False


def live_stderr() -> bool:
    # TERM=dumb: a terminal that cannot move its cursor gets a log's lines, not a live display drawn over itself
    return sys.stderr.isatty() and os.environ.get("TERM") != "dumb"


def reporter_for(total: int, json_out: bool, preset: str, since: float | None = None, quiet: bool = False):
    kind = QuietReporter if quiet else LiveReporter if live_stderr() else PlainReporter
    return kind(total, json_out, preset, since)


def timestamped(text: str) -> str:
    """A line of a log, as `PlainReporter.say` writes it."""
    return f"{time.strftime('%Y-%m-%d %H:%M:%S')} {text}"


def as_logged(text: str) -> str:
    """A line written to stderr outside the reporter (in a signal handler) as the reporter writes it: timestamped in
    a log, as it is on a terminal."""
    return text if live_stderr() else timestamped(text)


COMPARE_COLUMNS = (("psnr_mean", "PSNR dB", "{:.2f}"), ("psnr_worst", "worst frame", "{:.2f}"),
                   ("ssim_mean", "SSIM", "{:.4f}"), ("ssim_worst", "worst frame", "{:.4f}"),
                   ("audio_snr_db", "audio SNR dB", "{:.2f}"), ("log_mel_distance_db", "log-mel dist dB", "{:.3f}"))


def compared_names(record) -> str:
    """A's file name, and B's beside it where the clips were matched by their request."""
    a, b = Path(record["a"]).name, Path(record["b"]).name
    return a if a == b else f"{a} ({b})"


def compare_table(records, console: Console | None = None) -> None:
    """`h3gen compare`'s table, on stderr: on a terminal a row a clip, or where that is wider than the terminal, a
    row a measure, a clip's name never cut (one wider than the terminal folds onto the next line), nor a number; in
    a log, plain aligned lines with the names whole."""
    console, title = console or Console(stderr=True, highlight=False), "h3gen compare (A against B)"
    rows = [(compared_names(record), ["-" if record[key] is None else fmt.format(record[key])
                                      for key, _, fmt in COMPARE_COLUMNS]) for record in records]
    if not console.is_terminal or console.is_dumb_terminal:
        header = ("clip", *(heading for _, heading, _ in COMPARE_COLUMNS))
        lines = [title, *aligned(header, [(shown(name), *cells) for name, cells in rows], left=1)]
        console.file.write("".join(f"{line}\n" for line in lines))
        return
    table = Table(title=title, title_justify="left")
    table.add_column("clip", no_wrap=True)
    for _, heading, _ in COMPARE_COLUMNS:
        table.add_column(heading, justify="right")  # headings wrap at their spaces
    for name, cells in rows:
        table.add_row(name, *cells)
    # Whether rich had to cut a cell: its measure says the row fits at some widths where its layout still cuts one
    # (with "…"), or squeezes the number columns to nothing beside a long name (no mark at all): every cell must
    # be drawn whole.
    with console.capture() as drawn:
        console.print(table)
    text = drawn.get()
    if (text.count("…") > sum(name.count("…") for name, _ in rows)
            or not all(cell in text for name, cells in rows for cell in (name, *cells))):
        table = Table(title=title, title_justify="left")
        table.add_column("clip", overflow="fold")
        table.add_column("measure", no_wrap=True)
        table.add_column("value", justify="right", no_wrap=True)
        for name, cells in rows:
            for i, ((_, heading, _), cell) in enumerate(zip(COMPARE_COLUMNS, cells)):
                table.add_row("" if i else name, heading, cell, end_section=i == len(cells) - 1)
        console.print(table)
    else:
        console.file.write(drawn.get())
