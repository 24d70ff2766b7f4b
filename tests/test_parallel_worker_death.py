"""A worker that dies mid-run (SIGKILL, as the kernel's OOM killer does): the run stops at once, names it, and counts
every clip written before it died, the one that worker wrote and had not yet reported too."""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest

from test_parallel_runtime import ENV, workers_of
from faulty import install
from conftest import child_env

STALLS = '''
import os
import time

import torch.distributed as dist

from h3gen.plugins.hookspecs import hookimpl
from h3gen.stages.sampler import EulerSampler


class StallsOnRank1(EulerSampler):
    """Global rank 1 stalls in its second clip (STALL_AT), while its first is muxed: written, not yet recorded."""
    kind, name = "sampler", "stalls-on-rank-1"
    clips = 0

    def run(self, clip):
        self.clips += 1
        if dist.is_initialized() and dist.get_rank() == 1 and self.clips >= int(os.environ.get("STALL_AT", "2")):
            time.sleep(300)
        return super().run(clip)


@hookimpl
def h3gen_register_stages(register):
    register(StallsOnRank1)
'''


def in_manifest(manifest) -> list:
    """The clips the manifest says were written, once a line each."""
    lines = manifest.read_text().splitlines() if manifest.is_file() else []
    return sorted(r["path"].rsplit("/", 1)[-1] for r in map(json.loads, lines) if r["status"] == "ok")


def test_a_killed_worker_stops_the_run_at_once_and_its_written_clips_count(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("".join(json.dumps({"id": f"clip{i}", "prompt": f"prompt number {i}"}) + "\n"
                               for i in range(8)))
    out, manifest = tmp_path / "out", tmp_path / "out" / "manifest.jsonl"
    command = [sys.executable, "-m", "h3gen.cli.main", "render", str(prompts), "-o", str(out), "--cpu-workers", "2",
               "--json", "--set", "sampler.use=stalls-on-rank-1"]
    env = child_env({**ENV, **install(tmp_path / "site", "stalls", STALLS)})
    run = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    # Group 1 (rank 1) renders clips 1, 3, 5 and 7, and records a clip once the next has rendered (its mux runs
    # meanwhile): it is killed with clip1 written and not yet in the manifest.
    deadline = time.monotonic() + 120
    while not (out / "clip1.mp4").is_file():
        assert run.poll() is None and time.monotonic() < deadline, "the run ended before worker 1 wrote a clip"
        time.sleep(0.05)
    assert "clip1.mp4" not in in_manifest(manifest)
    os.kill(workers_of(run.pid)[1], signal.SIGKILL)
    killed, guard = time.monotonic(), threading.Timer(120, run.kill)  # a run that hangs fails, not the tests
    guard.start()
    lines = [(time.monotonic() - killed, line) for line in run.stderr]  # each with the seconds since the kill
    guard.cancel()
    stdout, stderr = run.stdout.read(), "".join(line for _, line in lines)
    assert lines[-1][0] < 5, stderr[-3000:]  # the last line, why the run stopped; the interpreter's teardown follows
    assert run.wait() == 1, stderr[-3000:]
    last = stderr.splitlines()[-1]
    assert re.fullmatch(r"h3gen: error: CPU worker 1 \(pid \d+\) was killed by SIGKILL, so the run was stopped.*",
                        last), stderr[-3000:]
    assert "stopped by SIGTERM" not in stderr
    assert re.search(r"\[2/8\] wrote \S*clip1.mp4", stderr), stderr[-3000:]

    on_disk = sorted(p.name for p in out.glob("*.mp4"))
    records = {r["path"].rsplit("/", 1)[-1]: r for r in map(json.loads, stdout.splitlines()) if r["ok"]}
    in_json = sorted(records)
    assert in_manifest(manifest) == in_json == on_disk, (in_json, on_disk)
    # clip1, recorded by rank 0 from the disk, carries what its sampler reported as the others do
    sampled = {name: records["clip1.mp4"][name] for name in ("forwards", "forwards_reused", "attention")}
    assert sampled == {name: records["clip0.mp4"][name] for name in sampled} and sampled["forwards"] > 0, records
    assert f"{len(on_disk)} of 8 clips written" in stderr, stderr[-3000:]
    assert not list(out.glob(".*")), list(out.glob(".*"))  # the killed worker's lock and partial file went too


def test_a_clip_a_killed_worker_was_redoing_with_force_is_not_counted(tmp_path):
    """With --force the old file stays in place until the new one replaces it: a worker killed before that did not
    write it, and the run must not count it."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("".join(json.dumps({"id": f"clip{i}", "prompt": f"prompt number {i}"}) + "\n"
                               for i in range(2)))
    out = tmp_path / "out"
    command = [sys.executable, "-m", "h3gen.cli.main", "render", str(prompts), "-o", str(out), "--json",
               "--set", "sampler.use=stalls-on-rank-1"]
    env = child_env({**ENV, **install(tmp_path / "site", "stalls", STALLS), "STALL_AT": "1"})
    subprocess.run(command, env=env, capture_output=True, check=True)  # one process: nothing stalls
    old = (out / "clip0.mp4").stat().st_mtime_ns
    run = subprocess.Popen([*command, "--force", "--cpu-workers", "2"], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 120
    # Rank 0 wrote clip0 again, and rank 1 claimed clip1 and stalls in its sampler.
    while (out / "clip0.mp4").stat().st_mtime_ns == old or not (out / ".clip1.mp4.lock").exists():
        assert run.poll() is None and time.monotonic() < deadline, "the run ended before both clips started"
        time.sleep(0.05)
    time.sleep(1)
    os.kill(workers_of(run.pid)[1], signal.SIGKILL)
    stdout, stderr = run.communicate(timeout=120)
    assert run.returncode == 1, stderr[-3000:]
    written = sorted(r["path"].rsplit("/", 1)[-1] for r in map(json.loads, stdout.splitlines()) if r["ok"])
    assert written == ["clip0.mp4"] and "1 of 2 clips written" in stderr, stderr[-3000:]
    assert not re.search(r"wrote \S*clip1.mp4", stderr), stderr[-3000:]


TIED_WORKER = """
import os, sys, time
from h3gen.parallel.worker import die_with_launcher
die_with_launcher(int(sys.argv[1]) if len(sys.argv) > 1 else os.getppid())
print(os.getpid(), flush=True)
time.sleep(120)
"""


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] == "Z"  # a zombie is gone but for its exit status
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the kernel's parent-death signal is Linux's")
def test_a_worker_ends_with_the_launcher_that_started_it(tmp_path):
    """torchrun's agent loses the workers it is starting when the run is stopped just then: the kernel ends them
    with the launcher, instead of leaving them to wait on its rendezvous with the command's output held open."""
    launcher = subprocess.Popen([sys.executable, "-c", "import subprocess, sys; "
                                 f"subprocess.run([sys.executable, '-c', {TIED_WORKER!r}])"],
                                stdout=subprocess.PIPE, text=True, env=child_env({}))
    worker = int(launcher.stdout.readline())
    assert not gone(worker)
    launcher.kill()
    launcher.wait()
    deadline = time.monotonic() + 30
    while not gone(worker):
        assert time.monotonic() < deadline, "the worker outlived its launcher"
        time.sleep(0.05)
    launcher.stdout.close()


def test_a_worker_whose_launcher_has_ended_already_ends_at_once():
    late = subprocess.run([sys.executable, "-c", TIED_WORKER, "1"], capture_output=True, text=True, timeout=60,
                          env=child_env({}))
    assert late.returncode == 1 and late.stdout == ""


def test_a_worker_killed_after_rank_0_reported_the_run_s_end_is_a_note(tmp_path, monkeypatch):
    """Every clip had its result and rank 0 had printed the summary: the run keeps rank 0's exit status, and the
    worker's death is a note, not an error asking for a rerun."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
    from torch.distributed.launcher import api

    from h3gen.parallel import launch

    status = tmp_path / "status"
    status.write_text("0 0 0")  # rank 0's report of the run's end

    def launched(config, entry):
        def start(*args):
            raise ChildFailedError("h3gen", {1: ProcessFailure(1, 4321, -9, str(tmp_path / "none"))})
        return start

    monkeypatch.setattr(api, "elastic_launch", launched)
    said, one_machine = [], SimpleNamespace(max_nodes=1)
    job = {"status_file": str(status), "device": "cpu", "settings": {"parallel": {}}}
    assert launch.run(one_machine, job, "h3gen.cli.worker", said.append) == 0
    assert said == ["h3gen: note: CPU worker 1 (pid 4321) was killed by SIGKILL after every clip had its result"]
    status.unlink()  # rank 0 did not report: the run was stopped by the death
    with pytest.raises(launch.WorkerFailed, match=r"^CPU worker 1 \(pid 4321\) was killed by SIGKILL, so the run"):
        launch.run(one_machine, job, "h3gen.cli.worker", said.append)


def test_workers_stopped_once_every_clip_has_its_result_do_not_ask_for_a_rerun(tmp_path):
    from h3gen.parallel.launch import stop_of_workers
    from h3gen.run.loop import stopped_line

    status = tmp_path / "status"
    job = {"status_file": str(status), "settings": {"parallel": {}}}
    status.write_text("143 0 0")
    assert stopped_line("SIGTERM", *stop_of_workers(job)) == ("h3gen: stopped by SIGTERM as the run ended: every "
                                                               "clip has its result")
    status.write_text("143 1 3")
    assert "the clip in flight was discarded; run the same command again" in stopped_line("SIGTERM",
                                                                                         *stop_of_workers(job))
