"""A signal mid-run discards the clip in flight, finishes what is whole and leaves only whole files; a rerun after
any stop, SIGKILL too, resumes."""

import contextlib
import json
import os
import re
import signal
import time
from pathlib import Path

import pytest

from conftest import h3gen
from faulty import TWO_CLIPS, start_render, wait_for
from h3gen.run.validate import validate_clip


@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143), (signal.SIGHUP, 129)])
def test_signal_discards_the_clip_in_flight_and_a_rerun_resumes(faults, prompts_file, tmp_path, signum, code):
    env, preset = faults
    out, marker = tmp_path / "out", tmp_path / "muxing-b"
    out.mkdir()
    (out / "c.mp4").write_bytes(b"\0\0\0\x20ftypisom" + bytes(8))  # an MP4 cut short: rendered again, not skipped
    render = ["render", prompts_file(TWO_CLIPS + '{"id": "c", "prompt": "rain"}\n'), "-o", out, "--preset", preset,
              "--save-latents"]
    # Muxing in line: with background muxing, how far the next clip got before the signal depends on timing.
    process = start_render(render[1:] + ["--set", 'mux.slow_id="b"', "--set", f'mux.marker="{marker}"',
                                         "--set", "mux.workers=0"], env)
    wait_for(marker, process)
    assert (out / ".b.mp4.partial.mp4").exists()  # stopped while b's MP4 was being written
    process.send_signal(signum)
    stdout, stderr = process.communicate(timeout=60)
    assert process.returncode == code, stderr[-2000:]
    assert (f"h3gen: stopped by {signal.Signals(signum).name}: the clip in flight was discarded; "
            "run the same command again") in stderr
    assert "1 of 3 clips written, 2 not rendered" in stderr
    assert sorted(p.name for p in out.glob("*.mp4")) == ["a.mp4", "c.mp4"]
    assert [p.name for p in out.glob("*.latents.safetensors")] == ["a.latents.safetensors"]  # b's went with it
    assert validate_clip(out / "a.mp4", expected_frames=124) == []
    assert not list(out.glob(".*"))  # no partial MP4, no claim left behind
    if signum != signal.SIGTERM:
        return  # resuming is the same after any signal; checked once below
    first = (out / "a.mp4").stat().st_mtime_ns

    rerun = h3gen(*render, "--json", env=env, check_code=0)
    assert f"skipped {out / 'a.mp4'}: already there and valid (--force renders it again)" in rerun.stderr
    assert "2 of 3 clips written, 1 already there and valid (skipped)" in rerun.stderr
    assert [(r["id"], r["status"]) for r in map(json.loads, rerun.stdout.splitlines())] == [
        ("a", "skipped"), ("b", "ok"), ("c", "ok")]
    assert (out / "a.mp4").stat().st_mtime_ns == first
    assert sorted(p.name for p in out.glob("*.mp4")) == ["a.mp4", "b.mp4", "c.mp4"]
    assert all(validate_clip(out / f"{name}.mp4", expected_frames=124) == [] for name in "abc")

    done = h3gen(*render, env=env, check_code=0)
    assert "0 of 3 clips written, 3 already there and valid (skipped)" in done.stderr
    assert "loaded on" not in done.stderr  # nothing to render: no weights are loaded

    only_a = tmp_path / "only-a.txt"
    only_a.write_text(TWO_CLIPS.splitlines()[0] + "\n")
    forced = h3gen("render", only_a, "-o", out, "--preset", preset, "--force", "--json", env=env, check_code=0)
    assert [(r["id"], r["status"]) for r in map(json.loads, forced.stdout.splitlines())] == [("a", "ok")]
    assert (out / "a.mp4").stat().st_mtime_ns != first


def test_partial_files_of_clips_the_prompts_file_does_not_name_are_named_and_left(prompts_file, tmp_path):
    """A killed run of other prompts (or other seeds) left partial files a rerun of its own clips would clear: this
    run names them and leaves them, as another run may be writing them. Its own clips' partial files just go."""
    out = tmp_path / "out"
    out.mkdir()
    others = [out / ".h3-8827002ba9f0.mp4.partial.mp4", out / ".old.latents.safetensors.partial"]
    for path in [*others, out / ".a.mp4.partial.mp4"]:
        path.write_bytes(b"\0" * 64)
    result = h3gen("render", prompts_file('{"id": "a", "prompt": "x"}\n'), "-o", out, check_code=0)
    assert (f"h3gen: note: {out} holds 2 partial file(s) of clips this prompts file does not name "
            "(.h3-8827002ba9f0.mp4.partial.mp4, .old.latents.safetensors.partial): a killed run left them, or another "
            "run is writing them; a run of their prompts removes them, or delete them once no other run writes "
            "there") in result.stderr
    assert sorted(p.name for p in out.glob(".*")) == sorted(p.name for p in others)


def test_after_one_stop_signal_any_second_one_ends_the_process_at_once():
    """SIGTERM, then SIGINT while the run winds down: the second kills, as a second SIGTERM would."""
    from h3gen.run.loop import STOP_SIGNALS, Interrupted, stop_on_signals

    before = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    with stop_on_signals():
        with pytest.raises(Interrupted):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
        second = {signal.getsignal(signum) for signum in STOP_SIGNALS}
        assert len(second) == 1 and second.pop().__name__ == "end_at_once"
    assert {signum: signal.getsignal(signum) for signum in STOP_SIGNALS} == before


def signalled_twice_mid_mux(faults, prompts, out, slow_id, first=signal.SIGINT, *settings):
    """A render of `prompts` whose mux of clip `slow_id` takes its time, sent `first` and then SIGINT while it
    muxes: its stderr, once it ended with SIGINT's status."""
    env, preset = faults
    marker = Path(prompts).parent / f"muxing-{slow_id}"
    process = start_render([prompts, "-o", out, "--preset", preset, "--set", f'mux.slow_id="{slow_id}"',
                            "--set", f'mux.marker="{marker}"', *settings], env)
    wait_for(marker, process)
    process.send_signal(first)
    time.sleep(0.2)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 130, stderr[-2000:]
    return stderr


@pytest.mark.parametrize("in_place", [False, True])
def test_a_second_signal_mid_mux_ends_at_once_with_one_line_and_leaves_no_hidden_file(faults, prompts_file, tmp_path,
                                                                                       in_place):
    """With `in_place`, the mux (a plugin's) writes the clip's first bytes at its final name: they go too."""
    out, prompts = tmp_path / "out", prompts_file(TWO_CLIPS)
    stderr = signalled_twice_mid_mux(faults, prompts, out, "b", signal.SIGINT,
                                     "--set", f"mux.in_place={str(in_place).lower()}")
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d h3gen: ended at once by a second signal \(SIGINT\); the "
                        r"clips in flight were dropped, and running the same command again renders them",
                        stderr.splitlines()[-1]), stderr[-2000:]
    assert not list(out.glob(".*"))  # neither b's partial MP4 nor a claim
    assert sorted(p.name for p in out.glob("*.mp4")) == ["a.mp4"]
    assert all(validate_clip(path, expected_frames=124) == [] for path in out.glob("*.mp4"))
    h3gen("render", prompts, "-o", out, "--preset", faults[1], env=faults[0], check_code=0)
    assert sorted(p.name for p in out.glob("*.mp4")) == ["a.mp4", "b.mp4"]


def test_a_second_signal_before_any_clip_is_written_leaves_no_directory_the_run_made(faults, prompts_file, tmp_path):
    stderr = signalled_twice_mid_mux(faults, prompts_file(TWO_CLIPS), tmp_path / "new" / "out", "a", signal.SIGTERM)
    assert "ended at once by a second signal" in stderr, stderr[-2000:]
    assert not (tmp_path / "new").exists()


def test_a_signal_as_a_finished_run_puts_its_handlers_back_ends_with_one_line(monkeypatch, capsys):
    """SIGTERM from `timeout` just as the run ends, after the body returned and before the old handlers are back:
    the run's exit status for the signal and its one line, never a traceback."""
    import h3gen.cli.render as run
    from h3gen.run.loop import Interrupted
    from h3gen.run.settings import RunSettings

    @contextlib.contextmanager
    def signal_at_the_end(*args):
        yield
        raise Interrupted(signal.SIGTERM)

    monkeypatch.setattr(run, "stop_on_signals", signal_at_the_end)
    monkeypatch.setattr(run, "_run_render", lambda settings, began: 0)
    assert run.run_render(RunSettings(prompts=Path("p.txt"), output=Path("out")), 0.0) == 143
    assert "h3gen: stopped by SIGTERM; run the same command again to resume" in capsys.readouterr().err


def test_a_signal_before_the_run_s_checks_end_leaves_no_directory_it_made(monkeypatch, tmp_path):
    """Ctrl-C just after the output directory was made, before the checks that would remove it on a refusal."""
    import h3gen.cli.render as run
    from h3gen.run.loop import Interrupted
    from h3gen.run.settings import RunSettings

    out = tmp_path / "new" / "out"

    def stopped_early(settings, began):
        out.mkdir(parents=True)
        raise Interrupted(signal.SIGINT)

    monkeypatch.setattr(run, "_run_render", stopped_early)
    assert run.run_render(RunSettings(prompts=Path("p.txt"), output=out), 0.0) == 130
    assert list(tmp_path.iterdir()) == []


def test_a_signal_finishes_the_background_mux_of_a_decoded_clip_and_leaves_only_whole_files(faults, prompts_file,
                                                                                             tmp_path):
    """b's frames are all decoded, its device time spent, when the signal lands mid-mux: its MP4 is finished, said
    so, and counted written; what was on the device is discarded."""
    env, preset = faults
    out, marker = tmp_path / "out", tmp_path / "muxing-b"
    render = ["render", prompts_file(TWO_CLIPS + '{"id": "c", "prompt": "rain"}\n'), "-o", out, "--preset", preset]
    process = start_render(render[1:] + ["--set", 'mux.slow_id="b"', "--set", f'mux.marker="{marker}"',
                                         "--set", "mux.workers=2"], env)
    wait_for(marker, process)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 143, stderr[-2000:]
    assert not list(out.glob(".*"))  # no partial MP4, no claim left behind
    assert all(validate_clip(path, expected_frames=124) == [] for path in out.glob("*.mp4"))
    assert "b.mp4" in [p.name for p in out.glob("*.mp4")]
    assert re.search(r"\[2/3\] mux \d+\.\d\ds", stderr), stderr[-2000:]  # its mux line, as any written clip's
    assert re.search(r"h3gen: finishing the MP4 of [12] clip\(s\) already decoded; another signal ends at once",
                     stderr), stderr[-2000:]
    written = len(list(out.glob("*.mp4")))
    assert f"{written} of 3 clips written" in stderr, stderr[-2000:]
    rerun = h3gen(*render, env=env, check_code=0)
    assert "3 of 3 clips written" in rerun.stderr or "already there and valid (skipped)" in rerun.stderr
    assert sorted(p.name for p in out.glob("*.mp4")) == ["a.mp4", "b.mp4", "c.mp4"]


def test_signal_while_the_mux_reads_a_decode_in_flight_leaves_only_whole_files(faults, prompts_file, tmp_path):
    """The mux started with b's decode and has its first frames when the signal lands: b is discarded, no partial
    MP4 is left, the run ends at once."""
    env, preset = faults
    out, marker = tmp_path / "out", tmp_path / "decoding-b"
    render = ["render", prompts_file(TWO_CLIPS + '{"id": "c", "prompt": "rain"}\n'), "-o", out, "--preset", preset]
    process = start_render(render[1:] + ["--set", "vae.use=slow-decode", "--set", 'vae.slow_id="b"',
                                         "--set", f'vae.marker="{marker}"', "--set", "mux.workers=2",
                                         "--save-latents"], env)
    wait_for(marker, process)
    signalled = time.monotonic()
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 143, stderr[-2000:]
    assert time.monotonic() - signalled < 30  # not after the decode's minute
    assert not list(out.glob(".*"))  # no partial MP4, no claim left behind
    # a's background mux may or may not have finished when the signal came; b's never does
    assert {p.name for p in out.glob("*.mp4")} <= {"a.mp4"}
    assert all(validate_clip(path, expected_frames=124) == [] for path in out.glob("*.mp4"))
    # a discarded clip's latents go with it
    assert {p.name.split(".")[0] for p in out.glob("*.latents.safetensors")} == {p.stem for p in out.glob("*.mp4")}


def test_a_rerun_after_sigkill_removes_the_partial_mp4_and_the_locks_it_owns(faults, prompts_file, tmp_path):
    """SIGKILL mid-write leaves b's 48-byte partial MP4 and b's lock; a lock of a clip already written is left too
    when the kill lands between the MP4's rename and the claim's release (made by hand here). The rerun removes
    them all, also the lock of the clip it skips."""
    env, preset = faults
    out, marker = tmp_path / "out", tmp_path / "muxing-b"
    render = ["render", prompts_file(TWO_CLIPS), "-o", out, "--preset", preset, "--set", "mux.workers=0"]
    process = start_render(render[1:] + ["--set", 'mux.slow_id="b"', "--set", f'mux.marker="{marker}"'], env)
    wait_for(marker, process)
    process.kill()
    process.communicate(timeout=60)
    assert (out / ".b.mp4.partial.mp4").stat().st_size == 48 and (out / ".b.mp4.lock").exists()
    (out / ".a.mp4.lock").touch()
    rerun = h3gen(*render, "--json", env=env, check_code=0)
    records = [(r["id"], r["status"]) for r in map(json.loads, rerun.stdout.splitlines())]
    assert records == [("a", "skipped"), ("b", "ok")]
    assert not list(out.glob(".*")), list(out.glob(".*"))
    assert all(validate_clip(out / f"{name}.mp4", expected_frames=124) == [] for name in "ab")


def test_a_rerun_leaves_the_claims_of_a_run_still_rendering(tmp_path):
    from h3gen.run.outputs import ClipClaim, clear_leftovers

    clip = tmp_path / "a.mp4"
    other_run = ClipClaim(clip)
    assert other_run.acquire()
    partial = tmp_path / ".a.mp4.partial.mp4"
    partial.write_bytes(b"being written")
    clear_leftovers(clip)
    assert partial.exists() and other_run.lock_path.exists()
    other_run.release()
    clear_leftovers(clip)
    assert not list(tmp_path.iterdir())
