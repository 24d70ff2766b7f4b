"""Every write of the run but the clip's own fails soft: the embedding cache, a manifest line, a clip's latents, its
lock, a tensor file; each says what it could not write, and a rerun takes up what was lost."""

import json
import os
import re
import shutil
from pathlib import Path

import pytest

from conftest import h3gen
from faulty import TWO_CLIPS, limit_file_size
from h3gen.run.validate import validate_clip


def test_an_embedding_cache_folder_that_cannot_be_written_is_said_once(prompts_file, tmp_path):
    """encode.cache_dir where nothing can be written: the clips render, and the run says once why the next one will
    encode the prompts again."""
    result = h3gen("render", prompts_file("a fox\nwaves\n"), "-o", tmp_path / "out", "--set",
                   'encode.cache_dir="/proc/h3gen-nope"', check_code=0)
    note = ("h3gen: note: the embedding cache in /proc/h3gen-nope cannot be written (No such file or directory): these "
            "prompts are encoded again on the next run (set encode.cache_dir or XDG_CACHE_HOME to a folder you can "
            "write to)")
    assert result.stderr.count(note) == 1, result.stderr[-2000:]
    assert len(list((tmp_path / "out").glob("*.mp4"))) == 2


def manifest_line_error(out_dir: Path) -> str:
    """The line a clip's manifest record that cannot be written costs it (with os.write patched to fail)."""
    from h3gen.inputs.request import Request
    from h3gen.run import outputs
    from h3gen.run.records import ClipResult

    result = ClipResult(Request(index=0, prompt="x", seed=0, width=32, height=32, frames=124), out_dir / "a.mp4",
                        True, {}, 0.0)
    error = outputs.record(out_dir, result, "tiny", "ok")
    return outputs.write_error(Path(error.filename), error)


def test_a_manifest_line_that_cannot_be_written_fails_its_clip(tmp_path, monkeypatch):
    import errno

    from h3gen.run import outputs

    def no_space(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(outputs.os, "write", no_space)
    assert manifest_line_error(tmp_path) == (
        f"cannot write {tmp_path / 'manifest.jsonl'}: No space left on device (free space in {tmp_path}; a rerun "
        "redoes only the clips that are missing)")


def test_a_manifest_line_cut_short_by_a_file_size_limit_is_named_as_that_and_taken_back(tmp_path, monkeypatch):
    """The write that stops short does not say why; the next one does (`ulimit -f`), and the half line goes."""
    import errno

    from h3gen.run import outputs

    (tmp_path / "manifest.jsonl").write_text('{"earlier": 1}\n')
    real_write, calls = os.write, []

    def size_limit(fd, data):
        calls.append(len(data))
        if len(calls) > 1:
            raise OSError(errno.EFBIG, "File too large")
        return real_write(fd, data[:10])

    monkeypatch.setattr(outputs.os, "write", size_limit)
    assert manifest_line_error(tmp_path) == (
        f"cannot write {tmp_path / 'manifest.jsonl'}: File too large (a file size limit stops it: raise `ulimit -f`; "
        "a rerun redoes only the clips that are missing)")
    assert (tmp_path / "manifest.jsonl").read_text() == '{"earlier": 1}\n'


def test_a_failed_clip_whose_manifest_line_is_lost_says_so(tmp_path, monkeypatch):
    """The summary, --json and the manifest agree, or the failure says where they do not."""
    import errno

    from h3gen.inputs.request import Request
    from h3gen.run import outputs
    from h3gen.run.records import ClipResult

    def no_space(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(outputs.os, "write", no_space)
    failed = ClipResult(Request(index=0, prompt="x", seed=0, width=32, height=32, frames=124), tmp_path / "a.mp4",
                        False, {}, 0.0, error="only 0 KiB free", status="failed")
    result = outputs.recorded(tmp_path, failed, "tiny")
    assert result.error == "only 0 KiB free; its manifest line was not written either (No space left on device)"


def test_a_rerun_with_save_latents_renders_again_a_clip_whose_latents_were_cut_short(prompts_file, tmp_path):
    out, prompts = tmp_path / "out", prompts_file('{"id": "a", "prompt": "a fox"}\n')
    h3gen("render", prompts, "-o", out, "--save-latents", check_code=0)
    latents = out / "a.latents.safetensors"
    whole = latents.read_bytes()
    latents.write_bytes(whole[:100])
    planned = h3gen("render", prompts, "-o", out, "--save-latents", "--dry-run", check_code=0)
    assert planned.stdout.strip().endswith("a.mp4: there, but its latents a.latents.safetensors are cut "
                                           "short or not safetensors; rendered again"), planned.stdout
    h3gen("render", prompts, "-o", out, "--save-latents", check_code=0)
    assert latents.read_bytes() == whole


def test_a_rerun_with_save_latents_says_why_it_renders_a_clip_whose_latents_are_gone(prompts_file, tmp_path):
    out, prompts = tmp_path / "out", prompts_file('{"id": "a", "prompt": "a fox"}\n')
    h3gen("render", prompts, "-o", out, "--save-latents", check_code=0)
    (out / "a.latents.safetensors").unlink()
    planned = h3gen("render", prompts, "-o", out, "--save-latents", "--dry-run", check_code=0)
    assert planned.stdout.strip().endswith("a.mp4: there, but its latents a.latents.safetensors are missing "
                                           "(--save-latents writes them beside the clip); rendered again"), \
        planned.stdout
    assert "skip" in h3gen("render", prompts, "-o", out, "--dry-run", check_code=0).stdout  # without: nothing lacks


def test_latents_of_other_settings_are_rendered_again_and_a_clip_rendered_without_them_takes_its_old_ones(
        prompts_file, tmp_path):
    """Latents carry the clip's stamp: another render's latents beside the clip, or latents without a stamp, are not
    taken as its own, and a clip rendered again without --save-latents leaves no latents of its earlier settings
    beside it."""
    out, other, prompts = tmp_path / "out", tmp_path / "other", prompts_file('{"id": "a", "prompt": "a fox"}\n')
    h3gen("render", prompts, "-o", out, "--save-latents", check_code=0)
    h3gen("render", prompts, "-o", other, "--seed", "1", "--save-latents", check_code=0)
    shutil.copy(other / "a.latents.safetensors", out / "a.latents.safetensors")
    planned = h3gen("render", prompts, "-o", out, "--save-latents", "--dry-run", check_code=0)
    assert re.search(r"a\.mp4: there, but its latents a\.latents\.safetensors are of other settings \(request\.seed: 1 -> 0"
                     r"\); rendered again$", planned.stdout.strip()), planned.stdout
    h3gen("render", prompts, "-o", other, "--redo-conflicts", check_code=0)  # seed 0 now, no latents asked for
    assert sorted(p.name for p in other.iterdir()) == ["a.mp4", "manifest.jsonl"]

    from safetensors.torch import load_file, save_file

    save_file(load_file(out / "a.latents.safetensors"), out / "a.latents.safetensors")  # no metadata: no stamp
    planned = h3gen("render", prompts, "-o", out, "--save-latents", "--dry-run", check_code=0)
    assert planned.stdout.strip().endswith("a.mp4: there, but its latents a.latents.safetensors carry no h3gen stamp, "
                                           "so their settings are not known; rendered again"), planned.stdout


def test_a_manifest_cut_short_mid_line_takes_the_next_record_on_a_line_of_its_own(prompts_file, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "manifest.jsonl").write_text('{"partial": tru')  # what a crash or a full disk can leave
    h3gen("render", prompts_file("a fox\n"), "-o", out, check_code=0)
    cut, record = (out / "manifest.jsonl").read_text().splitlines()
    assert cut == '{"partial": tru' and json.loads(record)["status"] == "ok"


def test_once_the_manifest_cannot_be_written_the_run_renders_no_more_clips(prompts_file, tmp_path, monkeypatch):
    """Every later clip would be written and then counted failed: they are failed unrendered, each saying why."""
    import errno

    from typer.testing import CliRunner

    from h3gen.cli.main import app
    from h3gen.run import outputs

    real, calls = outputs.record, []

    def full_after_one(out_dir, result, preset, status):
        calls.append(status)
        if len(calls) == 1:
            return real(out_dir, result, preset, status)
        return OSError(errno.EPERM, "Operation not permitted", str(out_dir / outputs.MANIFEST))

    monkeypatch.setattr(outputs, "record", full_after_one)
    out = tmp_path / "out"
    # The mux in line: a clip's line is written before the next clip is taken (a background mux can let one more in).
    result = CliRunner().invoke(app, ["render", str(prompts_file("a fox\nwaves\na lighthouse\n")), "-o", str(out),
                                      "--set", "mux.workers=0"])
    assert result.exit_code == 1, result.output[-2000:]
    why = (f"cannot write {out / 'manifest.jsonl'}: Operation not permitted (make it writable; a rerun redoes only "
           "the clips that are missing)")
    failed = [line for line in result.output.splitlines() if "FAILED" in line]
    assert len(failed) == 1 and failed[0].endswith(f"not rendered: {why}"), failed
    # the second was written whole before its line failed, and counted written, with a line that says what it lacks
    assert f"[2/3] {out / 'h3-'}" in result.output and f" has no manifest line: {why}" in result.output
    assert "2 of 3 clips written, 1 failed" in result.output, result.output[-2000:]
    assert len(list(out.glob("*.mp4"))) == 2 and all(validate_clip(p, expected_frames=124) == [] for p in
                                                     out.glob("*.mp4"))


@pytest.mark.parametrize("dry", [False, True])
def test_a_manifest_that_cannot_be_written_refuses_the_run_before_any_clip(prompts_file, tmp_path, dry):
    """A directory where the manifest goes: said before a clip renders (a dry run too), not after it."""
    out = tmp_path / "out"
    (out / "manifest.jsonl").mkdir(parents=True)
    result = h3gen("render", prompts_file("a fox\n"), "-o", out, *(["--dry-run"] if dry else []))
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().splitlines()[-1] == (
        f"h3gen: error: the run's manifest {out / 'manifest.jsonl'} cannot be written (Is a directory) (move what "
        "is in its place away, or pass -o with another directory)")
    assert sorted(p.name for p in out.iterdir()) == ["manifest.jsonl"]


def test_skipped_clips_the_manifest_cannot_record_are_skipped_all_the_same(prompts_file, tmp_path):
    """A rerun finds the clips written, but their manifest lines cannot be appended (past the file-size limit, as on
    a full disk): the clips are done, their files say so; one note says the manifest was not written, and the run
    exits 0 (a cron job over a finished prompts file failed on every rerun)."""
    out = tmp_path / "out"
    prompts = prompts_file("a fox\na heron\n")
    assert h3gen("render", prompts, "-o", out).returncode == 0
    manifest = out / "manifest.jsonl"
    lines = manifest.read_text()
    result = h3gen("render", prompts, "-o", out, preexec_fn=limit_file_size(manifest.stat().st_size))
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stderr.count(f"note: cannot write {manifest}: File too large; the clips already written are "
                               "skipped all the same, without their line") == 1
    assert "0 of 2 clips written, 2 already there and valid (skipped)" in result.stderr
    assert manifest.read_text() == lines


def test_a_claim_that_cannot_be_created_fails_its_clip(tiny_model, tmp_path, monkeypatch):
    """The lock file of one clip cannot be created: that clip fails with one line, the next renders."""
    import errno

    from h3gen.cli.ui import PlainReporter
    from h3gen.config.preset import resolve
    from h3gen.inputs.prompts import read_prompts
    from h3gen.models.repo import ModelRepo
    from h3gen.plugins.manager import registry
    from h3gen.run import outputs
    from h3gen.run.render import Renderer

    real_open = os.open

    def open_except_a(path, *args):
        if str(path).endswith(".a.mp4.lock"):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real_open(path, *args)

    monkeypatch.setattr(outputs.os, "open", open_except_a)
    preset = resolve("tiny", registry())
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(TWO_CLIPS)
    out = tmp_path / "out"
    renderer = Renderer(preset, registry(), ModelRepo(tiny_model), PlainReporter(2))
    results = list(renderer.render(read_prompts(prompts, 0, preset.request), out, save_latents=True))
    renderer.close()
    assert [r.ok for r in results] == [False, True]
    assert results[0].error.startswith(f"cannot write {out / '.a.mp4.lock'}: No space left on device (free space")
    assert sorted(p.name for p in out.iterdir()) == ["b.latents.safetensors", "b.mp4", "manifest.jsonl"]


def test_tensors_that_cannot_be_written_raise_the_os_error(tmp_path, monkeypatch):
    """safetensors reports a full disk as its own error; the latents and the embedding cache see an OSError."""
    import errno

    import torch

    from h3gen.run.outputs import save_tensors

    target = tmp_path / "x.safetensors"
    with pytest.raises(OSError) as raised:
        save_tensors({"a": torch.zeros(4)}, tmp_path / "missing-folder" / "x.safetensors")
    assert raised.value.errno == errno.ENOENT
    save_tensors({"a": torch.zeros(4)}, target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.safetensors"]


def test_tensors_are_written_with_the_mode_the_umask_gives(tmp_path):
    """Latents and cache entries get the mode every other output gets (safetensors' own writer makes them 0600)."""
    import stat

    import torch

    from h3gen.run.outputs import save_tensors

    before = os.umask(0o027)
    try:
        save_tensors({"a": torch.zeros(4)}, tmp_path / "x.latents.safetensors")
        (tmp_path / "x.mp4").write_bytes(b"")
    finally:
        os.umask(before)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in tmp_path.iterdir()}
    assert modes == {"x.latents.safetensors": 0o640, "x.mp4": 0o640}


def test_the_tiny_model_is_written_with_the_modes_the_umask_gives(tmp_path):
    """`h3gen tiny DIR` (and the user cache's copy) can be shared as the user's other files are: not 0700 and 0600
    as tempfile and safetensors' writer make them."""
    import stat

    h3gen("tiny", tmp_path / "tiny", check_code=0, fresh=True, preexec_fn=lambda: os.umask(0o027))
    written = [tmp_path / "tiny", *(tmp_path / "tiny").rglob("*")]
    assert {stat.S_IMODE(p.stat().st_mode) for p in written if p.is_dir()} == {0o750}
    assert {stat.S_IMODE(p.stat().st_mode) for p in written if p.is_file()} == {0o640}
    assert any(p.suffix == ".safetensors" for p in written)


def test_a_written_clip_whose_manifest_line_is_lost_stays_written_and_the_run_exits_1(tmp_path, monkeypatch):
    import errno

    from h3gen.inputs.request import Request
    from h3gen.run import outputs
    from h3gen.run.loop import report_end
    from h3gen.run.records import ClipResult, clip_record
    from h3gen.run.report import SilentReporter

    def no_space(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(outputs.os, "write", no_space)
    written = ClipResult(Request(index=0, prompt="x", seed=0, width=32, height=32, frames=124), tmp_path / "a.mp4",
                         True, {}, 0.0)
    result = outputs.recorded(tmp_path, written, "tiny")
    assert result.ok and result.status == "ok"
    assert result.unrecorded.startswith(f"cannot write {tmp_path / 'manifest.jsonl'}: No space left on device")
    assert clip_record(result, "tiny")["error"] == result.unrecorded
    assert report_end(SilentReporter(), [result], 1) == 1 and report_end(SilentReporter(), [written], 1) == 0
