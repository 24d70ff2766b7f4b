"""One record shape: --json lines and manifest lines share their fields, in every layout, with paths as given."""

import json
import os
import subprocess
import sys

import pytest
from conftest import h3gen
from h3gen.run.validate import validate_clip

PROMPTS = 'a fox in the snow\n{"id": "waves", "prompt": "waves on rocks", "seed": 5}\n'
TIMINGS = ("seconds", "end_to_end_s", "rtf")
ENV = {"OMP_NUM_THREADS": "1"}


def without(record: dict, *keys) -> dict:
    return {k: v for k, v in record.items() if k not in keys}


def test_one_process_and_cpu_workers_print_the_same_records_but_for_timings(prompts_file, tmp_path):
    prompts = prompts_file(PROMPTS)
    runs = {}
    for out, layout in (("one", ()), ("workers", ("--cpu-workers", 2))):
        result = h3gen("render", prompts.name, "-o", out, "--json", *layout, cwd=tmp_path, env=ENV, check_code=0)
        runs[out] = sorted(map(json.loads, result.stdout.splitlines()), key=lambda r: r["line"])
    for one, workers in zip(runs["one"], runs["workers"]):
        assert one["path"].startswith("one/") and workers["path"] == one["path"].replace("one/", "workers/", 1)
        assert without(one, "path", *TIMINGS) == without(workers, "path", *TIMINGS)
        assert one["status"] == "ok" and one["peak_gib"] is None and one["end_to_end_s"] > 0  # CPU: not measured
        assert one["memory_plan"] is None  # no device memory to plan on the CPU
    manifest = [json.loads(line) for line in (tmp_path / "one" / "manifest.jsonl").read_text().splitlines()]
    assert [without(line, "time", "pid") for line in manifest] == runs["one"]

    again = h3gen("render", prompts.name, "-o", "one", "--json", cwd=tmp_path, env=ENV, check_code=0)
    for record in map(json.loads, again.stdout.splitlines()):
        assert record["status"] == "skipped" and record["ok"]
        assert [record[k] for k in ("end_to_end_s", "rtf", "forwards", "peak_gib")] == [None] * 4
    assert "smoke-test model" not in again.stderr  # nothing renders: no note about the model that would

    (tmp_path / "more.txt").write_text(PROMPTS + "a third prompt\n")
    dry = h3gen("render", "more.txt", "-o", "one", "--dry-run", "--set", "mux.crf=20", cwd=tmp_path, check_code=1)
    first, second, third = dry.stdout.splitlines()
    assert first.startswith("conflict one/h3-") and "mux.crf: 18 -> 20" in first
    assert second.startswith("conflict one/waves.mp4: exists, rendered with different settings")
    assert third.startswith("render   one/h3-") and "loaded on" not in dry.stderr
    planned = h3gen("render", "more.txt", "-o", "one", "--dry-run", "--json", cwd=tmp_path, check_code=0)
    plans = [json.loads(line) for line in planned.stdout.splitlines()]
    assert [plan["action"] for plan in plans] == ["skip", "skip", "render"]
    assert [(p["task"], p["width"], p["height"], p["frames"]) for p in plans] == [("t2va", 32, 32, 124)] * 3
    assert [(r["task"], r["width"], r["height"]) for r in runs["one"]] == [("t2va", 32, 32)] * 2
    assert len(list((tmp_path / "one").glob("*.mp4"))) == 2


def test_a_closed_stdout_ends_the_run_as_sigpipe_does(prompts_file, tmp_path):
    out = tmp_path / "out"
    run = subprocess.Popen([sys.executable, "-m", "h3gen.cli.main", "render", str(prompts_file(PROMPTS)), "-o",
                            str(out), "--json", "--set", "mux.workers=0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env={**os.environ, **ENV})
    run.stdout.close()  # `| head -0`: the reader is gone before the first record (muxes in line: in order)
    stderr = run.stderr.read()
    assert run.wait(timeout=300) == 141, stderr[-2000:]
    assert "Traceback" not in stderr and "Exception ignored" not in stderr and "BrokenPipe" not in stderr
    assert "1 of 2 clips written" in stderr and "stopped by SIGPIPE" in stderr
    assert len(list(out.glob("*.mp4"))) == 1 and not list(out.glob(".*"))
    assert [json.loads(line)["status"] for line in (out / "manifest.jsonl").read_text().splitlines()] == ["ok"]


def test_with_workers_a_closed_stdout_ends_the_run_as_sigpipe_does_too(prompts_file, tmp_path):
    """Rank 0 writes the records: its reader gone, it stops the run and dies by SIGPIPE as a stopped worker does,
    and the launcher ends with 141 as the one-process run, not as if a worker had crashed."""
    out = tmp_path / "out"
    prompts = prompts_file("".join(f"prompt {i}\n" for i in range(8)))  # rank 0 starts a clip after a record
    run = subprocess.Popen([sys.executable, "-m", "h3gen.cli.main", "render", str(prompts), "-o", str(out), "--json",
                            "--cpu-workers", "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True, env={**os.environ, **ENV, "OMP_NUM_THREADS": "1"})
    run.stdout.close()
    stderr = run.stderr.read()
    assert run.wait(timeout=600) == 141, stderr[-2000:]
    assert "stopped by SIGPIPE" in stderr and "killed by" not in stderr and "Traceback" not in stderr
    assert all(validate_clip(path) == [] for path in out.glob("*.mp4")) and not list(out.glob(".*"))


@pytest.mark.parametrize("command", [["presets", "list"], ["presets"], ["validate", "--json", "PROMPTS"],
                                     ["render", "PROMPTS", "-o", "OUT", "--dry-run", "--json"]])
def test_every_command_ends_quietly_with_141_when_its_reader_is_gone(prompts_file, tmp_path, command):
    """`h3gen ... | head -0`: 141 as SIGPIPE would end it, not Click's exit 1, and no "Broken pipe" on stderr."""
    prompts = str(prompts_file(PROMPTS))
    args = [{"PROMPTS": prompts, "OUT": str(tmp_path / "out")}.get(arg, arg) for arg in command]
    read, write = os.pipe()
    os.close(read)
    with os.fdopen(write, "w") as stdout:
        run = subprocess.run([sys.executable, "-m", "h3gen.cli.main", *args], stdout=stdout, stderr=subprocess.PIPE,
                             text=True, env={**os.environ, **ENV}, timeout=300)
    assert run.returncode == 141, run.stderr[-2000:]
    assert "Broken pipe" not in run.stderr and "Exception ignored" not in run.stderr and "Traceback" not in run.stderr
    assert not (tmp_path / "out").exists()


def test_a_reader_gone_stays_gone_and_ends_the_run_with_141(monkeypatch, tmp_path, capsys):
    """A record that finds stdout's reader gone stops the run at the next clip, however many lines (to /dev/null)
    follow first; and when no clip is left to start, the run ends with 141 all the same."""
    from types import SimpleNamespace

    import pytest

    from h3gen.cli import ui
    from h3gen.inputs.request import Request
    from h3gen.run import loop
    from h3gen.run.records import ClipResult

    printed = iter([False, True, True])  # the first line finds the pipe closed; the rest go to /dev/null
    monkeypatch.setattr(ui, "print_result", lambda line: next(printed))
    requests = [Request(i, "x", i, 32, 32, 124, line=i + 1) for i in range(3)]
    results = [ClipResult(r, tmp_path / f"{r.index}.mp4", True, {}, 1.0) for r in requests]
    reporter = ui.PlainReporter(3, json_out=True)
    for result in results[:2]:
        reporter.clip_done(result)
    with pytest.raises(loop.Interrupted) as stop:
        reporter.clip_started(SimpleNamespace(request=requests[2], path=tmp_path / "2.mp4"))
    assert stop.value.exit_code == 141
    reporter.clip_done(results[2])
    capsys.readouterr()
    assert loop.report_end(reporter, results, 3) == 141
    assert "h3gen: stdout's reader went away once no clip was left to start" in capsys.readouterr().err
    assert loop.report_end(ui.PlainReporter(3, json_out=True), results, 3) == 0
