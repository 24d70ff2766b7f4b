"""A full disk: a clip that does not fit fails before it renders, one that fills the disk while it is written leaves no
partial file, and a disk with no room for even one clip is refused before the weights load."""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from conftest import h3gen
from faulty import limit_file_size, records
from h3gen.run.validate import validate_clip


def test_disk_full_while_writing_costs_one_clip_and_leaves_no_partial_file(prompts_file, tmp_path, tiny_model):
    """Two faults in one run: "full" writes into /dev/full (no space left from the first write), "big" grows past
    the file-size limit mid-write; "small" between them is written."""
    out = tmp_path / "out"
    out.mkdir()
    # The muxer writes .NAME.partial.mp4 and renames it when complete; for "full" that file is /dev/full.
    (out / ".full.mp4.partial.mp4").symlink_to("/dev/full")
    prompts = prompts_file('{"id": "full", "prompt": "a fox"}\n{"id": "small", "prompt": "waves"}\n'
                           '{"id": "big", "prompt": "rain", "duration": 15}\n')
    result = h3gen("render", prompts, "-o", out, "--json", preexec_fn=limit_file_size(300_000))
    assert result.returncode == 1, result.stderr[-2000:]
    clips = records(result)
    assert clips["small"]["ok"] and validate_clip(out / "small.mp4", expected_frames=124) == []
    for name, line, reason, hint in (("full", 1, "No space left on device", f"free space in {out}"),
                                     ("big", 3, "File too large", "a file size limit stops it: raise `ulimit -f`")):
        assert not clips[name]["ok"]
        assert clips[name]["error"] == (f"cannot write the clip: {reason} ({hint}; a rerun redoes only the clips "
                                        "that are missing)")
        assert f"failed {name}.mp4 (line {line}): cannot write the clip: {reason}" in result.stderr
        assert f"FAILED {out / name}.mp4: cannot write the clip: {reason}" in result.stderr
    assert "1 of 3 clips written, 2 failed" in result.stderr
    assert sorted(p.name for p in out.glob("*.mp4")) == ["small.mp4"]


def test_a_clip_that_cannot_fit_on_the_disk_fails_before_it_renders(tmp_path, monkeypatch):
    import shutil

    from h3gen.inputs.request import Request
    from h3gen.errors import ClipError
    from h3gen.run.outputs import check_disk

    clip = Request(index=0, prompt="x", seed=0, width=1344, height=768, frames=243)
    check_disk(tmp_path, clip)
    free = 32 * 2**10
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**12, 10**12 - free, free))
    with pytest.raises(ClipError,
                       match=f"only 32 KiB free in {tmp_path}, the clip needs at least 64 KiB \\(free disk space"):
        check_disk(tmp_path, clip)
    free = 2**20  # room for an MP4, but not for one the size per pixel of this run's clips
    check_disk(tmp_path, clip)
    with pytest.raises(ClipError, match=f"only 1 MiB free in {tmp_path}, the clip needs about 12 MiB, as clips of"):
        check_disk(tmp_path, clip, bytes_per_pixel=0.05)
    free = 20 * 2**20  # room for this clip, but not beside the one still muxed in the background
    check_disk(tmp_path, clip, bytes_per_pixel=0.05)
    with pytest.raises(ClipError, match=f"only 20 MiB free in {tmp_path}, the clip needs about 12 MiB, as clips of "
                                        "these settings take, beside about 12 MiB for the clips still being written"):
        check_disk(tmp_path, clip, bytes_per_pixel=0.05, writing=[clip])


FREE_SPACE = '''
import os, shutil

_free = int(os.environ["H3GEN_TEST_FREE_BYTES"])
shutil.disk_usage = lambda path: shutil._ntuple_diskusage(10**12, 10**12 - _free, _free)
'''


def with_free_space(tmp_path, free: int) -> dict:
    """An environment whose h3gen sees `free` bytes free on every disk (a sitecustomize on its path)."""
    site = tmp_path / f"free-{free}"
    site.mkdir()
    (site / "sitecustomize.py").write_text(FREE_SPACE)
    return {"PYTHONPATH": str(site), "H3GEN_TEST_FREE_BYTES": str(free), "H3GEN_LOAD_PLUGINS": "none"}


def test_a_rerun_sizes_its_clips_by_the_valid_ones_it_skips(prompts_file, tmp_path):
    """A clip already there tells what the next ones take: on a disk with less free, they fail before rendering
    rather than after, each with its sampler and decode spent."""
    out = tmp_path / "out"
    size = ("--set", "request.width=256", "--set", "request.height=256")
    h3gen("render", prompts_file('{"id": "a", "prompt": "a fox"}\n'), "-o", out, *size, check_code=0)
    written = (out / "a.mp4").stat().st_size
    assert written > 2 * 2**17  # the test needs room under the clip's size above the smallest MP4 (64 KiB)
    prompts = prompts_file('{"id": "a", "prompt": "a fox"}\n{"id": "b", "prompt": "waves"}\n')
    result = h3gen("render", prompts, "-o", out, "--json", *size, env=with_free_space(tmp_path, written // 2),
                   check_code=1)
    clip = records(result)["b"]
    assert re.match(rf"only [\d.]+ MiB free in {re.escape(str(out))}, the clip needs about [\d.]+ MiB, as clips of "
                    r"these settings take \(free disk space", clip["error"]), clip
    assert "sampler" not in clip["seconds"]
    assert records(result)["a"]["status"] == "skipped"


def test_after_a_clip_finds_the_disk_full_the_next_fail_before_rendering_until_space_is_freed(tmp_path, monkeypatch):
    import errno
    from types import SimpleNamespace

    from h3gen.errors import ClipError
    from h3gen.inputs.request import Request
    from h3gen.run.outputs import check_disk
    from h3gen.run.render import Renderer

    clip = SimpleNamespace(request=Request(index=0, prompt="x", seed=0, width=256, height=256, frames=124))
    pixels = 124 * 256 * 256
    renderer = SimpleNamespace(unfit_per_pixel=0.0, out_dir=tmp_path)
    full = RuntimeError("the mux stage raised")  # a stage's failure, raised from the write's
    full.__cause__ = OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**12, 10**12 - free, free))
    for free, learned in ((10**12, 0.0), (2**20, 2**20 / pixels)):  # no lesson where more is free than raw frames
        Renderer.learn_unfit(renderer, clip, RuntimeError("not a full disk"))
        Renderer.learn_unfit(renderer, clip, full)
        assert renderer.unfit_per_pixel == learned
    with pytest.raises(ClipError, match=f"^only 1 MiB free in {tmp_path}, no more than when a clip of this run did "
                                        "not fit \\(free disk space"):
        check_disk(tmp_path, clip.request, unfit_per_pixel=renderer.unfit_per_pixel)
    free = 2**20 + 2**16  # space freed since: the clip is tried
    check_disk(tmp_path, clip.request, unfit_per_pixel=renderer.unfit_per_pixel)


def test_a_run_learns_the_least_its_clips_take_per_pixel(tmp_path):
    from types import SimpleNamespace

    from h3gen.inputs.request import Request
    from h3gen.run.render import Renderer

    renderer = SimpleNamespace(bytes_per_pixel=0.0)
    for size in (3000, 1000, 2000):
        path = tmp_path / f"{size}.mp4"
        path.write_bytes(b"x" * size)
        Renderer.learn_size(renderer, SimpleNamespace(path=path, request=Request(
            index=0, prompt="x", seed=0, width=10, height=10, frames=10)))
    assert renderer.bytes_per_pixel == 1.0


@pytest.fixture
def full_disk(tmp_path):
    """A 1 MiB tmpfs filled to the last block (mounting needs root; elsewhere the patched tests below stand in)."""
    mount = tmp_path / "full"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        with open(mount / "filler", "wb", buffering=0) as filler:
            try:
                while True:
                    filler.write(b"\0" * 4096)
            except OSError:
                pass
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)])


def test_a_full_output_disk_is_refused_before_any_weight_loads(full_disk, prompts_file, tiny_model):
    """No space for even the smallest MP4: one line and exit 1 before the weights load, nothing written. (A disk
    that fills once clips render fails each clip that no longer fits: the patched tests below.)"""
    for dry in ([], ["--dry-run"]):  # the dry run says what the run would
        result = h3gen("render", prompts_file("a fox\nwaves\n"), "-o", full_disk, "--json", "--save-latents",
                       "--model", tiny_model, "--preset", "tiny", *dry)
        assert result.returncode == 1, result.stderr[-3000:]
        assert re.fullmatch(rf"h3gen: error: only \d+ KiB free in {re.escape(str(full_disk))}, and a clip takes at "
                            r"least 64 KiB \(free disk space there, or pass -o on another disk\)",
                            result.stderr.splitlines()[-1])
        assert "loaded" not in result.stderr and result.stdout == ""
        assert sorted(p.name for p in full_disk.iterdir()) == ["filler"]


def test_a_full_cache_disk_costs_only_the_cache(full_disk, prompts_file, tiny_model, tmp_path):
    """The embedding cache lives on another disk; when that one is full, clips render as without a cache."""
    out = tmp_path / "out"
    result = h3gen("render", prompts_file("a fox\n"), "-o", out, "--json", "--model", tiny_model, "--preset", "tiny",
                   env={"XDG_CACHE_HOME": str(full_disk)})
    assert result.returncode == 0, result.stderr[-3000:]
    assert [json.loads(line)["ok"] for line in result.stdout.splitlines()] == [True]


def test_a_file_system_out_of_inodes_is_named_as_such_not_as_out_of_space(tmp_path, monkeypatch):
    """`df -h` shows room: the hint to free space would mislead."""
    import errno
    from types import SimpleNamespace

    from h3gen.run import outputs

    full = OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(outputs.os, "statvfs", lambda path: SimpleNamespace(f_files=5, f_favail=0))
    assert outputs.write_error(tmp_path / "a.mp4", full) == (
        f"cannot write {tmp_path / 'a.mp4'}: No space left on device (its file system has no free inodes, however much "
        "space it has: delete files there or pass -o on another disk; a rerun redoes only the clips that are missing)")
    monkeypatch.setattr(outputs.os, "statvfs", lambda path: SimpleNamespace(f_files=5, f_favail=1))
    assert "(free space in" in outputs.write_error(tmp_path / "a.mp4", full)


def test_no_free_inodes_fails_a_clip_before_it_renders_and_refuses_a_run_before_it_loads(tmp_path, monkeypatch):
    """Out of inodes mid-run, the next clips fail before their GPU time, as on a full disk; a run that starts so, or
    whose output folder cannot be probed for that reason, stops with the inode line (exit 1), not "not writable"."""
    import errno
    import tempfile
    from types import SimpleNamespace

    from h3gen.errors import ClipError, WriteError
    from h3gen.inputs.request import Request
    from h3gen.run import outputs
    from h3gen.run.loop import check_writable

    def inodes(free):  # a terabyte free
        return lambda path: SimpleNamespace(f_files=6, f_favail=free, f_frsize=4096, f_blocks=2**28, f_bfree=2**28,
                                            f_bavail=2**28)

    monkeypatch.setattr(outputs.os, "statvfs", inodes(0))
    with pytest.raises(ClipError, match=f"^the file system of {tmp_path} has no free inodes, however much space it "
                                        "has") as failed:
        outputs.check_disk(tmp_path, Request(index=0, prompt="x", seed=0, width=32, height=32, frames=9))
    assert failed.value.fix == "delete files there or pass -o on another disk; a rerun redoes only the clips that " \
                               "are missing"
    with pytest.raises(WriteError, match="has no free inodes") as refused:
        outputs.check_room(tmp_path)
    assert refused.value.exit_code == 1 and refused.value.fix == "delete files there or pass -o on another disk"

    def no_inode(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(tempfile, "NamedTemporaryFile", no_inode)
    with pytest.raises(WriteError, match=f"^the file system of {tmp_path / 'out'} has no free inodes"):
        check_writable(tmp_path / "out")
    monkeypatch.setattr(outputs.os, "statvfs", inodes(1))
    outputs.check_disk(tmp_path, Request(index=0, prompt="x", seed=0, width=32, height=32, frames=9))  # one inode is enough


def test_a_run_whose_output_disk_cannot_take_a_clip_is_refused_before_any_weight_loads(tmp_path, monkeypatch,
                                                                                       prompts_file):
    import dataclasses

    from h3gen.config.preset import resolve
    from h3gen.errors import WriteError
    from h3gen.plugins.manager import registry
    from h3gen.run.loop import prepare
    from h3gen.run.settings import RunSettings

    found = registry()
    preset = resolve("tiny", found)
    settings = RunSettings(prompts=prompts_file('{"prompt": "x"}\n'), output=tmp_path / "out")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**12, 10**12 - 2**10, 2**10))
    for run in (settings, dataclasses.replace(settings, dry_run=True)):  # a dry run says what the run would do
        with pytest.raises(WriteError,
                           match=f"^only 1 KiB free in {tmp_path / 'out'}, and a clip takes at least 64 KiB"):
            prepare(run, preset, found)
        assert not (tmp_path / "out").exists()  # the folder the run made goes with it


def test_a_run_whose_clips_are_all_there_is_not_refused_for_a_full_disk(tmp_path, monkeypatch, prompts_file):
    """A nightly rerun over a finished prompts file renders nothing, so it needs no room; --force would."""
    import dataclasses

    from h3gen.config.preset import resolve
    from h3gen.errors import WriteError
    from h3gen.plugins.manager import registry
    from h3gen.run.loop import prepare
    from h3gen.run.settings import RunSettings

    settings = RunSettings(prompts=prompts_file('{"id": "a", "prompt": "x"}\n'), output=tmp_path / "out")
    h3gen("render", settings.prompts, "-o", settings.output, check_code=0)
    found = registry()
    preset = resolve("tiny", found)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**12, 10**12 - 2**10, 2**10))
    for run in (settings, dataclasses.replace(settings, dry_run=True)):
        assert prepare(run, preset, found).requests
    with pytest.raises(WriteError, match="^only 1 KiB free in"):
        prepare(dataclasses.replace(settings, force=True), preset, found)


def test_a_log_on_a_full_disk_loses_its_lines_but_not_the_clips(prompts_file, tmp_path, tiny_model):
    """`2>>log` on a full disk (cron): the clips and the manifest are written all the same, exit 0."""
    out = tmp_path / "out"
    with open("/dev/full", "w") as full:
        result = subprocess.run([sys.executable, "-m", "h3gen.cli.main", "render", str(prompts_file("a\nb\n")), "-o",
                                 str(out)], stderr=full, stdout=subprocess.PIPE, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0
    assert len(list(out.glob("*.mp4"))) == 2 and len((out / "manifest.jsonl").read_text().splitlines()) == 2


def test_json_lines_on_a_full_disk_are_named_as_standard_output(prompts_file, tmp_path, tiny_model):
    out = tmp_path / "out"
    with open("/dev/full", "w") as full:
        result = subprocess.run([sys.executable, "-m", "h3gen.cli.main", "render", str(prompts_file("a\n")), "-o",
                                 str(out), "--json"], stdout=full, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 1
    assert result.stderr.splitlines()[-1] == (
        "h3gen: error: cannot write the --json lines to standard output (No space left on device) (give standard "
        "output somewhere with room; a rerun resumes, keeping the clips written)")
    assert [p.name for p in out.glob("*.mp4")] and not list(out.glob(".*"))  # the clip itself is whole
