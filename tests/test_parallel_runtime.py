"""Several workers through torchrun on the CPU (gloo), on the tiny model: the files a one-process run writes.

Every multi-worker run costs tens of seconds on a small machine, so each runs once per module and several tests
read it. All runs here use one intra-op thread per process: on the CPU a clip depends on the thread count (MKL
and ATen split their sums by thread), and that is the only setting that makes a one-process run comparable with
workers sharing two cores. `sampler.dit=h3gen` because Ulysses splits h3gen's own DiT.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from conftest import h3gen
from h3gen.run.validate import validate_clip

ENV = {"OMP_NUM_THREADS": "1"}
PRESET = ["--set", "sampler.dit=h3gen"]
PROMPTS = ('a red fox in the snow\n{"id": "waves", "prompt": "waves on rocks", "seed": 5}\n'
           'a lighthouse at night\n{"id": "rain", "prompt": "rain on a window", "seed": 9}\n')
# fp32 on one CPU: Ulysses moves rows and heads between ranks, it does not reorder a sum over them, so the
# latents agree to rounding; this bound still allows an all-to-all that changes the order of a reduction.
LATENT_TOLERANCE = dict(rtol=1e-4, atol=1e-5)


def render(prompts, out, *args):
    return h3gen("render", prompts, "-o", out, "--json", "--save-latents", *PRESET, *args, env=ENV)


def outputs(out) -> dict:
    return {p.name: p.read_bytes() for p in sorted(out.glob("*.mp4"))}


def latents(out) -> dict:
    from safetensors.torch import load_file

    return {p.name: load_file(str(p)) for p in sorted(out.glob("*.latents.safetensors"))}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model):
    """The same four prompts in one process, in 2 and 4 data-parallel workers, and Ulysses 2 in one group."""
    root = tmp_path_factory.mktemp("parallel")
    prompts = root / "prompts.txt"
    prompts.write_text(PROMPTS)
    found = {}
    for name, args in (("one", ()), ("dp2", ("--cpu-workers", 2)), ("dp4", ("--cpu-workers", 4)),
                       ("ulysses2", ("--cpu-workers", 2, "--ulysses", 2))):
        began = time.monotonic()
        found[name] = (render(prompts, root / name, *args), root / name, time.monotonic() - began)
    return found


def test_runs_finish(runs):
    for name, (result, out, seconds) in runs.items():
        assert result.returncode == 0, (name, result.stderr[-3000:])
        assert len(list(out.glob("*.mp4"))) == 4, name


def test_the_wall_time_counts_from_the_command_s_start_in_workers_too(runs):
    """Rank 0 reports the run; its "in all" includes the launcher's checks, torchrun and the workers' start (about
    half of a small run's time on a CPU), as a one-process run includes its own start. (Not counted, either way:
    the interpreter's start and the teardown after the summary.)"""
    for name in ("dp2", "dp4", "ulysses2"):
        result, out, seconds = runs[name]
        found = re.search(r"\((?:(\d+)m)?(\d+)s in all\)", result.stderr)
        assert found, (name, result.stderr[-2000:])
        in_all = int(found.group(1) or 0) * 60 + int(found.group(2))
        assert 0.6 * seconds <= in_all <= seconds + 1, (name, in_all, seconds)


def test_data_parallel_groups_write_the_files_of_one_process(runs):
    one = outputs(runs["one"][1])
    for name, layout in (("dp2", "2 group(s) x 1 CPU worker"), ("dp4", "4 group(s) x 1 CPU worker")):
        result, out, _ = runs[name]
        assert f"h3gen: layout {layout}" in result.stderr
        assert outputs(out) == one, name  # byte for byte


def test_ulysses_group_writes_the_files_of_one_process(runs):
    result, out, _ = runs["ulysses2"]
    assert "h3gen: layout 1 group(s) x 2 CPU workers: Ulysses 2" in result.stderr
    import torch

    expected = latents(runs["one"][1])
    for name, tensors in latents(out).items():
        for key in ("video", "audio"):
            torch.testing.assert_close(tensors[key], expected[name][key], **LATENT_TOLERANCE)
    assert outputs(out) == outputs(runs["one"][1])


def test_json_records_from_workers_match_one_process(runs):
    def records(name):
        return sorted((json.loads(line) for line in runs[name][0].stdout.splitlines()), key=lambda r: r["line"])

    one = records("one")
    for name in ("dp2", "dp4", "ulysses2"):
        found = records(name)
        assert [sorted(r) for r in found] == [sorted(r) for r in one]
        assert [(r["id"], r["seed"], r["ok"], r["forwards"]) for r in found] == \
               [(r["id"], r["seed"], r["ok"], r["forwards"]) for r in one]
        assert all(set(r["seconds"]) == set(one[0]["seconds"]) for r in found)
        # Every clip is reported once, by rank 0, in the plain lines too.
        assert sum(" wrote " in line for line in runs[name][0].stderr.splitlines()) == 4
    assert [r["path"].rsplit("/", 1)[1] for r in records("dp2")] == [r["path"].rsplit("/", 1)[1] for r in one]


def test_one_prompt_on_four_workers_finishes(runs, tmp_path):
    """Fewer clips than groups: the layout gives the spare ranks to Ulysses, and the idle group exits cleanly."""
    prompts = tmp_path / "one.txt"
    prompts.write_text(PROMPTS.splitlines()[0] + "\n")
    result = render(prompts, tmp_path / "out", "--cpu-workers", 4)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "h3gen: layout 2 group(s) x 2 CPU workers" in result.stderr
    (name,) = outputs(tmp_path / "out")
    assert outputs(tmp_path / "out")[name] == outputs(runs["one"][1])[name]


def workers_of(pid: int) -> dict:
    """The torchrun workers the h3gen process started, by global rank."""
    found = {}
    for child in subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split():
        try:
            environ = open(f"/proc/{child}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        ranks = [v.split(b"=", 1)[1] for v in environ if v.startswith(b"RANK=")]
        if ranks:
            found[int(ranks[0])] = int(child)
    return found


def written(out) -> dict:
    """Each MP4 with its inode and mtime: a rewrite, even in place, changes one of them. (A worker killed while
    muxing leaves its hidden partial file, which the rerun's mux of that clip replaces.)"""
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in out.glob("*.mp4") if not p.name.startswith(".")}


def test_killed_worker_fails_the_run_and_a_rerun_finishes_the_rest(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("".join(f"prompt number {i}\n" for i in range(8)))
    out = tmp_path / "out"
    command = [sys.executable, "-m", "h3gen.cli.main", "render", str(prompts), "-o", str(out), "--cpu-workers", "2"]
    run = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env={**os.environ, **ENV})
    manifest = out / "manifest.jsonl"
    deadline = time.monotonic() + 120
    while not (manifest.is_file() and '"status": "ok"' in manifest.read_text()):  # one clip written: mid-run
        assert run.poll() is None and time.monotonic() < deadline, "the run ended before a clip was written"
        time.sleep(0.05)
    os.kill(workers_of(run.pid)[1], signal.SIGKILL)
    stderr = run.communicate(timeout=120)[1]
    assert run.returncode == 1, stderr[-3000:]
    assert "h3gen: error: CPU worker 1" in stderr and "was killed by SIGKILL" in stderr
    assert "run the same command again" in stderr.splitlines()[-1]
    assert "stopped by SIGTERM" not in stderr  # the agent stopped rank 0 because worker 1 died: not the user

    finished = written(out)
    assert 0 < len(finished) < 8
    again = h3gen("render", prompts, "-o", out, "--cpu-workers", "2", env=ENV, check_code=0)
    assert f"{len(finished)} already there and valid (skipped)" in again.stderr
    said = again.stderr.index  # the layout and header first, then the lines of the clips already there
    assert said("h3gen: layout ") < said(f"h3gen: {8 - len(finished)} clip(s) to render") < said("] skipped ")
    after = written(out)
    assert len(after) == 8 and all(after[name] == finished[name] for name in finished)
    assert all(validate_clip(out / name, expected_frames=124) == [] for name in after)
    assert not list(out.glob(".*")), list(out.glob(".*"))  # the killed worker's partial MP4 and lock went too


def test_sigterm_with_workers_counts_every_clip_written(tmp_path):
    """The summary, the --json lines and the manifest agree on the clips written before the signal, and nothing
    partial or locked is left."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("".join(f"prompt number {i}\n" for i in range(12)))
    out = tmp_path / "out"
    command = [sys.executable, "-m", "h3gen.cli.main", "render", str(prompts), "-o", str(out), "--cpu-workers", "2",
               "--json"]
    run = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env={**os.environ, **ENV})
    manifest = out / "manifest.jsonl"
    deadline = time.monotonic() + 180
    while not (manifest.is_file() and manifest.read_text().count('"status": "ok"') >= 2):
        assert run.poll() is None and time.monotonic() < deadline, "the run ended before two clips were written"
        time.sleep(0.05)
    run.send_signal(signal.SIGTERM)
    stdout, stderr = run.communicate(timeout=120)
    assert run.returncode == 143, stderr[-3000:]
    in_manifest = [r["path"].rsplit("/", 1)[-1] for r in map(json.loads, manifest.read_text().splitlines())
                   if r["status"] == "ok"]
    in_json = [r["path"].rsplit("/", 1)[-1] for r in map(json.loads, stdout.splitlines()) if r["ok"]]
    on_disk = sorted(p.name for p in out.glob("*.mp4"))
    assert sorted(in_manifest) == sorted(in_json) == on_disk, (in_manifest, in_json, on_disk)
    assert f"{len(on_disk)} of 12 clips written" in stderr, stderr[-3000:]
    assert stderr.count("h3gen: stopped by SIGTERM") == 1, stderr[-3000:]
    # Said by the launcher, timestamped as rank 0's lines are when stderr is not a terminal
    assert re.search(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d h3gen: stopped by SIGTERM", stderr, re.M), stderr[-3000:]
    assert not list(out.glob(".*")), list(out.glob(".*"))


def test_a_stop_while_the_workers_start_says_no_clip_was_in_flight(tmp_path, tiny_model):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red fox in the snow\n")
    command = [sys.executable, "-m", "h3gen.cli.main", "render", str(prompts), "-o", str(tmp_path / "out"),
               "--cpu-workers", "2"]
    run = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env={**os.environ, **ENV})
    deadline = time.monotonic() + 120
    while not subprocess.run(["pgrep", "-P", str(run.pid), "-f", "h3gen.cli.worker"],
                                capture_output=True).stdout.strip():
        assert run.poll() is None and time.monotonic() < deadline, "no worker started"
        time.sleep(0.02)
    run.send_signal(signal.SIGINT)  # a worker is importing torch: no clip has started
    stdout, stderr = run.communicate(timeout=120)
    assert run.returncode == 130, stderr[-3000:]
    assert ("h3gen: stopped by SIGINT: no clip was in flight; run the same command again to render the rest "
            "(clips already written are kept and skipped)") in stderr, stderr[-3000:]
    assert "discarded" not in stderr


def test_the_stop_line_counts_the_clips_in_flight():
    from h3gen.run.loop import stopped_line

    assert [stopped_line("SIGTERM", n).split(": ", 2)[2].split(";")[0] for n in (0, 1, 3, None)] == [
        "no clip was in flight", "the clip in flight was discarded", "the 3 clips in flight were discarded",
        "any clip in flight was discarded"]


@pytest.mark.parametrize("args, message", [
    (("--cpu-workers", 4, "--ulysses", 3), "--ulysses 3 does not divide --cpu-workers 4"),
    (("--cpu-workers", 4, "--ulysses", 4), "--ulysses 4 does not divide the DiT's 2 attention heads"),
    (("--ulysses", 2), "this run has one process"),
    (("--gpus", 2, "--cpu-workers", 2), "--gpus and --cpu-workers both given"),
    (("--cpu-workers", 0), "--cpu-workers 0: at least one worker (ask for 1 or more)"),
    (("--set", "parallel.cpu_workers=2", "--gpus", 0), "--gpus 0: at least one worker (ask for 1 or more; --set "
                                                      "parallel.cpu_workers=0 runs the preset's clips in one process)"),
    (("--cpu-workers", 2, "--nnodes", 2), "needs --rdzv-endpoint"),
    (("--cpu-workers", 2, "--nnodes", 2, "--rdzv-endpoint", "localhost:99999"),
     "--rdzv-endpoint 'localhost:99999' is not HOST:PORT with a port from 1 to 65535"),
    (("--cpu-workers", 2, "--nnodes", 2, "--rdzv-endpoint", "localhost"), "'localhost' is not HOST:PORT"),
    (("--cpu-workers", 2, "--node-rank", 1), "--node-rank belongs to a multi-node run, and --nnodes is not given"),
    (("--cpu-workers", 2, "--rdzv-id", "job"), "--rdzv-id belongs to a multi-node run, and --nnodes is not given"),
    (("--cpu-workers", 2, "--rdzv-endpoint", "localhost:29400"),
     "--rdzv-endpoint belongs to a multi-node run, and --nnodes is not given"),
    (("--cpu-workers", 2, "--nnodes", 0), "--nnodes 0: at least one machine"),
    (("--cpu-workers", 2, "--nnodes", 2, "--rdzv-endpoint", "nowhere.invalid:29400"),
     "--rdzv-endpoint nowhere.invalid:29400: no address is known for nowhere.invalid"),
    (("--cpu-workers", 2, "--set", "parallel.ulysses=3"), "--set parallel.ulysses=3 does not divide --cpu-workers 2"),
    (("--set", "parallel.cpu_workers=4", "--set", "parallel.ulysses=3"),
     "--set parallel.ulysses=3 does not divide --set parallel.cpu_workers=4"),
    (("--set", "parallel.ulysses=2"), "--set parallel.ulysses=2 splits a clip across workers, and this run has one "
                                      "process (add --gpus N or --cpu-workers N, or set parallel.ulysses to 0)"),
])
@pytest.mark.parametrize("dry", [[], ["--dry-run"]])
def test_impossible_layouts_fail_before_any_worker_starts(args, message, prompts_file, tmp_path, dry):
    """A dry run refuses them as the run does."""
    result = h3gen("render", prompts_file("a fox\n"), "-o", tmp_path / "out", *args, *dry, check_code=2)
    assert result.stderr.startswith("h3gen: error: ") and message in result.stderr
    assert "layout" not in result.stderr and not (tmp_path / "out").exists() and not result.stdout


def test_quiet_workers_print_nothing_when_the_run_goes_well(prompts_file, tmp_path):
    result = h3gen("render", prompts_file(PROMPTS), "-o", tmp_path / "out", "--cpu-workers", "2", "-q", env=ENV,
                   check_code=0)
    assert result.stderr == "" and len(list((tmp_path / "out").glob("*.mp4"))) == 4


def test_workers_render_prompts_piped_in_and_leave_no_scratch_behind(tmp_path):
    """/dev/stdin read by the launcher's checks: the workers render what the pipe held (kept in the launcher's
    scratch folder), as one process does. The scratch folder and the agent's files go with the run, and so does the
    scratch folder of a launcher that was killed; that of a launcher still running stays."""
    import fcntl

    out, scratch = tmp_path / "out", tmp_path / "tmp"
    for name in ("h3gen-run-killed", "h3gen-run-running"):
        (scratch / name).mkdir(parents=True)
        (scratch / name / "held").write_text("")
        (scratch / name / "status").write_text("0 0 0")
    running = os.open(scratch / "h3gen-run-running" / "held", os.O_RDONLY)  # as a live launcher holds it
    fcntl.flock(running, fcntl.LOCK_EX)
    result = h3gen("render", "/dev/stdin", "-o", out, "--json", "--cpu-workers", "2", *PRESET,
                   env={**ENV, "TMPDIR": str(scratch)}, input="a red fox in the snow\nwaves on rocks\n",
                   check_code=0)
    assert [json.loads(line)["ok"] for line in result.stdout.splitlines()] == [True, True]
    assert len(list(out.glob("*.mp4"))) == 2
    left = [p.name for p in scratch.iterdir() if p.name.startswith(("h3gen-run-", "torchelastic_"))]
    assert left == ["h3gen-run-running"]  # (torch's compile cache, torchinductor_USER, is a cache kept on purpose)
    os.close(running)


def test_a_preset_s_parallel_values_are_named_as_the_preset_gave_them(prompts_file, tmp_path):
    preset = tmp_path / "split.toml"
    preset.write_text('extends = "tiny"\n[parallel]\ncpu_workers = 4\nulysses = 3\n')
    result = h3gen("render", prompts_file("a fox\n"), "-o", tmp_path / "out", "--preset", preset, "--dry-run",
                   check_code=2)
    assert result.stderr.startswith("h3gen: error: preset split's [parallel] ulysses = 3 does not divide preset "
                                    "split's [parallel] cpu_workers = 4 (pick one of 1, 2, 4)")


@pytest.mark.parametrize("dry", [[], ["--dry-run"]])
def test_gpus_without_cuda_points_to_cpu_workers(prompts_file, tmp_path, dry):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    result = h3gen("render", prompts_file("a fox\n"), "-o", tmp_path / "out", "--gpus", 2, *dry, check_code=2)
    assert "no CUDA device is visible" in result.stderr and "--cpu-workers 2" in result.stderr
    assert not (tmp_path / "out").exists()


def test_layout_rule():
    from h3gen.parallel.layout import Layout, choose_layout

    assert choose_layout(8, 8, 100, 56) == Layout(8, 1)  # enough clips: every GPU its own
    assert choose_layout(8, 8, 3, 56) == Layout(2, 4)  # three clips: two groups of four
    assert choose_layout(8, 8, 1, 56) == Layout(1, 8)
    assert choose_layout(8, 8, 0, 56) == Layout(1, 8)
    assert choose_layout(6, 6, 1, 56) == Layout(3, 2)  # 3 and 6 do not divide 56 heads
    assert choose_layout(4, 4, 1, 1) == Layout(4, 1)  # a sampler that cannot split: data parallel only
    assert choose_layout(16, 8, 2, 56) == Layout(2, 8)  # two machines: a group stays on one
    assert choose_layout(8, 8, 100, 56, ulysses=2) == Layout(4, 2)
    assert Layout(4, 2).describe("GPU", 4) == "4 group(s) x 2 GPUs: Ulysses 2 within a group, 4 clip(s) at a time"
    assert Layout(4, 1).describe("CPU worker", 3) == \
        "4 group(s) x 1 CPU worker: data parallel, 3 clip(s) at a time, 1 group(s) idle with no clip to render"
    assert Layout(4, 1).describe("CPU worker", 0).endswith("4 clip(s) at a time")  # nothing left to render: the layout as it is


def test_the_first_failure_is_the_rank_that_failed_first_within_the_second():
    """Rank 1 fails, then rank 0 loses its connection to it within the same second: rank 1 is named."""
    from types import SimpleNamespace

    from h3gen.parallel.launch import first_failure

    def failure(seconds, recorded=None):
        info = {"h3gen_time": recorded} if recorded is not None else {}
        data = {"message": {"message": "m", "extraInfo": info}} if recorded is not None else {}
        return SimpleNamespace(timestamp=seconds, error_file_data=data)

    failed = SimpleNamespace(failures={0: failure(7, 7.9), 1: failure(7, 7.2), 2: failure(8, 8.0)})
    assert first_failure(failed)[0] == 1
    failed.failures = {3: failure(7), 0: failure(7, 7.1)}  # torchrun's pick killed without a record: kept
    assert first_failure(failed)[0] == 3
    failed.failures = {0: failure(6, 6.9), 1: failure(7, 7.0)}  # torchrun's whole seconds still come first
    assert first_failure(failed)[0] == 0


def test_parallel_section_of_a_preset(tmp_path):
    from h3gen.errors import UsageError
    from h3gen.plugins.manager import registry
    from h3gen.config.preset import resolve

    preset = resolve("tiny", registry(), ["parallel.cpu_workers=2", "parallel.ulysses=2"])
    assert preset.parallel == {"gpus": 0, "cpu_workers": 2, "ulysses": 2}
    for bad in (["parallel.gpus=-1"], ["parallel.gpus=2", "parallel.cpu_workers=2"], ["parallel.nodes=2"]):
        with pytest.raises(UsageError):
            resolve("tiny", registry(), bad)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def test_two_machines_meet_at_a_rendezvous_endpoint(runs, tmp_path):
    """--nnodes 2 as two launchers on one host (c10d rendezvous): one run of two workers, reported once."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(PROMPTS)
    command = [sys.executable, "-m", "h3gen.cli.main", "render", str(prompts), "-o", str(tmp_path / "out"),
               *PRESET, "--cpu-workers", "1", "--nnodes", "2", "--rdzv-endpoint", f"localhost:{free_port()}",
               "--rdzv-id", "test"]
    machines = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                 env={**os.environ, **ENV}) for _ in range(2)]
    finished = [machine.communicate(timeout=180) for machine in machines]
    assert [machine.returncode for machine in machines] == [0, 0], [err[-2000:] for _, err in finished]
    reports = [err for _, err in finished if "h3gen: layout 2 group(s) x 1 CPU worker" in err]
    assert len(reports) == 1 and "4 of 4 clips written" in reports[0]
    assert any("reported where rank 0 ran" in err for _, err in finished)
    assert all("h3gen: waiting for the 2 machines of the run to meet at localhost:" in err for _, err in finished)
    assert outputs(tmp_path / "out") == outputs(runs["one"][1])


def test_machines_started_with_different_settings_are_refused_on_each(tmp_path):
    """A multi-node run whose second machine was given another --set: each machine would render its share of rank
    0's clips its own way. Both stop before any weight loads, saying what differs; no folder is left."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a fox\n")
    port = free_port()

    def machine(rank: int, *extra: str):
        return subprocess.Popen([sys.executable, "-m", "h3gen.cli.main", "render", str(prompts), "-o",
                                 str(tmp_path / "out"), *PRESET, "--cpu-workers", "1", "--nnodes", "2", "--node-rank",
                                 str(rank), "--rdzv-endpoint", f"localhost:{port}", *extra], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env={**os.environ, **ENV})

    machines = [machine(0), machine(1, "--set", "mux.crf=40")]
    finished = [m.communicate(timeout=180) for m in machines]
    said = ("h3gen: error: the machines of workers 0 and 1 were started with different settings (--set sampler.dit=h3gen "
            "against sampler.dit=h3gen mux.crf=40) (run the same command on every machine: only --node-rank differs)")
    assert [m.returncode for m in machines] == [2, 2] and all(said in err for _, err in finished), finished
    assert not (tmp_path / "out").exists()


def test_a_machine_waiting_for_the_others_stops_on_a_signal(prompts_file, tmp_path):
    """Machine 1 of two, machine 0 never started: SIGTERM ends its wait at once (torch's static rendezvous waited
    inside its store, deaf to signals, for 15 minutes), and the folder it made goes."""
    command = [sys.executable, "-m", "h3gen.cli.main", "render", str(prompts_file("a fox\n")), "-o",
               str(tmp_path / "out"), *PRESET, "--cpu-workers", "1", "--nnodes", "2", "--node-rank", "1",
               "--rdzv-endpoint", f"localhost:{free_port()}"]
    machine = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, **ENV})
    time.sleep(8)  # past the checks, into the wait
    machine.send_signal(signal.SIGTERM)
    _, stderr = machine.communicate(timeout=20)
    assert machine.returncode == 143 and "h3gen: stopped by SIGTERM" in stderr and "frame #" not in stderr, stderr
    assert not (tmp_path / "out").exists()


def test_a_machine_whose_peers_never_come_gives_up_at_the_join_timeout():
    from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError

    from h3gen.parallel.rendezvous import NodeRendezvous

    port = free_port()
    with pytest.raises(RendezvousTimeoutError, match=f"^machine 0 did not listen at localhost:{port} in time$"):
        NodeRendezvous("localhost", port, 1, 2, "test", timeout_s=1).next_rendezvous()
    host = NodeRendezvous("localhost", port, 0, 2, "test", timeout_s=1)
    with pytest.raises(RendezvousTimeoutError, match=f"^1 of the 2 machines did not come to localhost:{port} in time$"):
        host.next_rendezvous()


STALLING = '''
import os
import time
from pathlib import Path

from h3gen.parallel import events
from h3gen.plugins.hookspecs import hookimpl
from h3gen.stages.sampler import EulerSampler

events.SILENT_S = 8  # rank 0 gives up on a machine not heard from sooner than a run would


class Stalling(EulerSampler):
    """On the machines H3GEN_TEST_STALL names: says so in a file named after its machine, holding its pid, and
    stalls on its first clip until stopped, or for H3GEN_TEST_STALL_S."""
    kind, name = "sampler", "stalling"

    def run(self, clip):
        machine = os.environ["GROUP_RANK"]
        if machine in os.environ["H3GEN_TEST_STALL"].split(","):
            Path(os.environ["H3GEN_TEST_MARKS"], machine).write_text(str(os.getpid()))
            time.sleep(float(os.environ.get("H3GEN_TEST_STALL_S", 120)))
        return super().run(clip)


@hookimpl
def h3gen_register_stages(register):
    register(Stalling)
'''


def two_machines(tmp_path, stall: str, workers: int = 1, **env):
    """Machines 0 and 1 of a static meeting on this host, each rendering 6 prompts' share in `workers` groups with a
    sampler that stalls on the machines `stall` names; returns them once a stalling worker of each has begun its first
    clip, with that worker's pid."""
    from faulty import install

    marks = tmp_path / "marks"
    marks.mkdir()
    site = install(tmp_path / "site", "stalling", STALLING)["PYTHONPATH"]
    env = {**os.environ, **ENV, "PYTHONPATH": os.pathsep.join(filter(None, (site, os.environ.get("PYTHONPATH")))),
           "H3GEN_LOAD_PLUGINS": "stalling", "H3GEN_TEST_STALL": stall, "H3GEN_TEST_MARKS": str(marks), **env}
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("".join(f"a fox number {i}\n" for i in range(6)))
    port = free_port()

    def start(rank: int):
        return subprocess.Popen([sys.executable, "-m", "h3gen.cli.main", "render", str(prompts), "-o",
                                 str(tmp_path / "out"), "--set", "sampler.use=stalling", *PRESET, "--cpu-workers",
                                 str(workers), "--nnodes", "2", "--node-rank", str(rank), "--rdzv-endpoint",
                                 f"localhost:{port}"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)

    machines = [start(0), start(1)]
    machines[0].start = start  # a machine started again
    deadline = time.monotonic() + 180
    while {p.name for p in marks.iterdir()} != set(stall.split(",")):
        assert time.monotonic() < deadline and all(m.poll() is None for m in machines), \
            [m.communicate()[1][-2000:] for m in machines]
        time.sleep(0.2)
    return machines, {int(p.name): int(p.read_text()) for p in marks.iterdir()}


def ended(machines, within: float) -> list[str]:
    began = time.monotonic()
    said = [m.communicate(timeout=within)[1] for m in machines]
    assert time.monotonic() - began < within
    assert not any("frame #" in err for err in said), said  # no C++ trace of a store gone
    return said


def test_a_machine_stopped_mid_run_leaves_the_report_to_rank_0_which_says_so_and_does_not_wait(tmp_path):
    """Ctrl-C on machine 1 reaches only its workers: rank 0 renders its own share, then names the clips machine 1
    did not render and exits 1 at once (torchrun's agent waited 5 minutes for machine 1's, deaf to signals, and
    the run exited 0)."""
    machines, _ = two_machines(tmp_path, "1")
    machines[1].send_signal(signal.SIGINT)
    first, second = ended(machines, 60)
    assert [m.returncode for m in machines] == [1, 130], (first[-2000:], second[-2000:])
    assert "3 of 6 clips written, 3 not rendered" in first
    assert ("h3gen: 3 clips not rendered: group 1 on machine 1 was stopped by SIGINT; run the same command again on "
            "every machine to render them") in first
    assert "h3gen: stopped by SIGINT" in second


def test_rank_0_stopped_stops_the_other_machines_workers(tmp_path):
    """Ctrl-C on machine 0 stops the run: machine 1's workers stop as if they had the signal, and machine 1 says
    where it came from (it went on rendering its share into a run that was over, and said it finished)."""
    machines, _ = two_machines(tmp_path, "0,1")
    machines[0].send_signal(signal.SIGINT)
    first, second = ended(machines, 60)
    assert [m.returncode for m in machines] == [130, 1], (first[-2000:], second[-2000:])
    assert "0 of 6 clips written, 6 not rendered" in first and "the 2 clips in flight were discarded" in first
    assert ("h3gen: stopped: machine 0 was stopped by SIGINT; any clip in flight was discarded; run the same command "
            "again on every machine to render the rest") in second
    assert not list((tmp_path / "out").glob("*.mp4"))


def test_a_machine_that_lost_a_worker_tells_rank_0_at_once(tmp_path):
    """One of machine 1's two workers killed: its launcher tells rank 0, which reports the clips not rendered without
    waiting for the silence (it waited for that worker's events forever), and names why both of machine 1's groups
    stopped (the one the agent stopped said only that it was stopped by SIGTERM)."""
    machines, pids = two_machines(tmp_path, "1", workers=2)
    os.kill(pids[1], signal.SIGKILL)
    first, second = ended(machines, 30)
    assert [m.returncode for m in machines] == [1, 1], (first[-2000:], second[-2000:])
    assert re.search(r"h3gen: 2 clips not rendered: groups 2 and 3 on machine 1 lost a worker: CPU worker [23] "
                     rf"\(pid {pids[1]}\) was killed by SIGKILL; run the same command again on every machine", first), \
        first[-2000:]
    assert "SIGTERM" not in first
    assert "was killed by SIGKILL" in second


def test_a_machine_started_again_while_machine_0_runs_is_refused(tmp_path):
    """Machine 1 stopped and started again while machine 0 still renders: it joined the old run, rendered clips rank
    0 never counted and wrote a second manifest line for one. Now it is refused, and the run goes on."""
    machines, _ = two_machines(tmp_path, "0")
    machines[1].send_signal(signal.SIGINT)
    assert machines[1].wait(timeout=60) == 130
    again = machines[0].start(1)
    _, said = again.communicate(timeout=60)
    assert again.returncode == 1, said[-2000:]
    port = said.split("localhost:")[1].split()[0]
    assert said.strip().splitlines()[-1] == (
        f"h3gen: error: machine 0 at localhost:{port} is still running this run, whose 2 machines have met (wait until "
        "it ends, or stop it there, then start the same command on every machine)")
    machines[0].send_signal(signal.SIGINT)
    assert machines[0].wait(timeout=60) == 130


def test_rank_0_gives_up_on_a_machine_it_no_longer_hears_from(tmp_path):
    """Machine 1 killed whole (as when it dies): rank 0 reports the clips not rendered once machine 1 is silent for
    SILENT_S."""
    machines, pids = two_machines(tmp_path, "1")
    os.kill(machines[1].pid, signal.SIGKILL)
    os.kill(pids[1], signal.SIGKILL)
    first = ended(machines[:1], 60)[0]
    assert machines[0].returncode == 1, first[-2000:]
    assert "h3gen: 3 clips not rendered: group 1 on machine 1 was not heard from for 8 s" in first


def test_a_machine_whose_store_went_away_says_so_in_one_line(tmp_path):
    """Machine 0 killed whole: machine 1's workers find the store gone at their next word to rank 0; one line, no
    stack, and no clip recorded as failed (an interrupted clip was recorded as a failure asking for a bug report)."""
    machines, pids = two_machines(tmp_path, "0,1", H3GEN_TEST_STALL_S="4")  # machine 1 goes on after 4 s
    os.kill(machines[0].pid, signal.SIGKILL)
    os.kill(pids[0], signal.SIGKILL)
    second = ended(machines[1:], 60)[0]
    assert machines[1].returncode == 1, second[-2000:]
    assert second.strip().splitlines()[-1].startswith("h3gen: error: the run's store at localhost:")
    assert "answers no more: the machine that holds it (machine 0) stopped or died" in second
    manifest = tmp_path / "out" / "manifest.jsonl"
    assert not manifest.exists() or '"failed"' not in manifest.read_text()


ONE_RANK_OOM = '''
import torch.distributed as dist

from h3gen.plugins.hookspecs import hookimpl
from h3gen.stages.sampler import EulerSampler


class OneRankOOM(EulerSampler):
    """Runs out of memory on global rank 1 only, as one GPU of a group can."""
    kind, name = "sampler", "one-rank-oom"

    def run(self, clip):
        if dist.is_initialized() and dist.get_rank() == 1:
            raise RuntimeError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return super().run(clip)


@hookimpl
def h3gen_register_stages(register):
    register(OneRankOOM)
'''


def test_an_error_on_one_rank_of_a_group_ends_the_run_instead_of_hanging(tmp_path):
    # The other rank waits in the DiT's all-to-all for rank 1, which never comes: the run must end, naming rank 1.
    from faulty import install

    env = {**ENV, **install(tmp_path / "site", "oneoom", ONE_RANK_OOM)}
    (tmp_path / "p.txt").write_text("a fox\na heron\n")
    result = h3gen("render", tmp_path / "p.txt", "-o", tmp_path / "out", "--set", "sampler.use=one-rank-oom", *PRESET,
                   "--cpu-workers", 2, "--ulysses", 2, env=env, timeout=300)
    assert result.returncode == 1, result.stderr[-2000:]
    assert "rank 1 failed on" in result.stderr and "out of GPU memory" in result.stderr, result.stderr[-2000:]
    assert not list((tmp_path / "out").glob("*.mp4"))


def test_a_taken_port_at_machine_0_s_endpoint_is_one_line_and_exit_2(tmp_path):
    import socket

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a fox\n")
    with socket.socket() as held:  # another program listening on the port
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        result = h3gen("render", prompts, "-o", tmp_path / "out", "--cpu-workers", "1", "--nnodes", "2",
                       "--rdzv-endpoint", f"127.0.0.1:{port}", "--node-rank", "0", env=ENV, check_code=2)
    assert result.stderr.splitlines()[-1] == (
        f"h3gen: error: --rdzv-endpoint 127.0.0.1:{port}: the port is taken on this machine (another run, or another "
        "program) (give --rdzv-endpoint a free port, the same on every machine, or end what holds it)")
    assert not (tmp_path / "out").exists()
