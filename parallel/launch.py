"""The launcher side of `--gpus N` / `--cpu-workers N`: check what can be checked here, then start N workers
through torchrun's elastic agent (in this process, so a failure comes back as data rather than a log to parse).

Bad input never starts a worker: the prompts file, preset, model and output directory were checked by the caller;
this module checks the worker counts and the layout. The workers' rank 0 reports the run; this process says one
line only when the run stopped: a signal it was sent, or a worker's failure, named by its root cause.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import importlib
import json
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import uuid
from pathlib import Path
from types import SimpleNamespace

from h3gen.errors import H3genError, UsageError
from h3gen.parallel.layout import check_ulysses
from h3gen.run.settings import Parallel, RunSettings


SCRATCH = "h3gen-run-"  # a launcher's scratch folder in the temporary folder
HELD = "held"  # the file in it its launcher holds locked while it lives


class WorkerFailed(H3genError):
    """A worker died or raised: the run stopped; a rerun renders what is missing."""

    exit_code = 1


def dit_heads(repo) -> int:
    config = json.loads((Path(repo.root) / "transformer" / "config.json").read_text())
    return int(config["num_attention_heads"])


def split_refusal(preset, found) -> str:
    """Why this preset's sampler cannot split a clip across a group ('' when it can), as the stage declares it."""
    name, config = preset.stages["sampler"]
    return found.stage("sampler", name).refuses_split(config)


def layout_check(parallel: Parallel):
    """`prepare`'s check of a run of workers: the devices, the Ulysses split, the machines."""
    return lambda preset, repo, found: check_workers(parallel, preset, dit_heads(repo), split_refusal(preset, found))


def check_workers(parallel: Parallel, preset, heads: int, refusal: str) -> None:
    gpus = parallel.gpus
    if gpus:
        import torch

        if not torch.cuda.is_available():
            raise UsageError(f"{parallel.said('gpus')}: no CUDA device is visible",
                             f"use --cpu-workers {gpus} to run {gpus} worker{'s' if gpus > 1 else ''} on the CPU")
        if gpus > torch.cuda.device_count():
            raise UsageError(f"{parallel.said('gpus')}: this machine shows {torch.cuda.device_count()} GPU(s)",
                             "ask for at most that many (CUDA_VISIBLE_DEVICES limits what is shown)")
        if preset.runtime["device"] == "cpu":
            raise UsageError(f"{parallel.said('gpus')}: preset {preset.name} runs on the CPU "
                             "([runtime] device = \"cpu\")",
                             "use --cpu-workers, or --set runtime.device=auto")
    per_node = parallel.workers
    if parallel.ulysses:
        check_ulysses(parallel.ulysses, per_node, heads, parallel.said("ulysses"),
                      parallel.said("gpus" if gpus else "cpu_workers"))
        if parallel.ulysses > 1 and refusal:
            raise UsageError(f"{parallel.said('ulysses')}: {refusal}",
                             "leave Ulysses out to render whole clips per worker")
    nnodes, node_rank = parallel.nnodes or 1, parallel.node_rank
    stray = next((flag for flag, value in (("--node-rank", node_rank), ("--rdzv-id", parallel.rdzv_id),
                                           ("--rdzv-endpoint", parallel.rdzv_endpoint))
                  if value is not None and parallel.nnodes is None), None)
    if stray:  # without --nnodes the run is one machine, which would ignore it
        raise UsageError(f"{stray} belongs to a multi-node run, and --nnodes is not given",
                         f"add --nnodes M and --rdzv-endpoint HOST:PORT, or drop {stray}")
    if parallel.nnodes is not None and parallel.nnodes < 1:
        raise UsageError(f"--nnodes {parallel.nnodes}: at least one machine", "pass --nnodes 1 or more")
    if nnodes > 1 and not parallel.rdzv_endpoint:
        raise UsageError(f"--nnodes {nnodes} needs --rdzv-endpoint HOST:PORT",
                         "the address of a machine of the job every node can reach")
    if node_rank is not None and not 0 <= node_rank < nnodes:
        raise UsageError(f"--node-rank {node_rank} is not one of 0..{nnodes - 1}", "number the machines from 0")
    if parallel.rdzv_endpoint is not None:
        check_endpoint(parallel.rdzv_endpoint)


def check_endpoint(text: str) -> None:
    """HOST:PORT (an IPv6 host in brackets), the port a number torchrun's store can listen on."""
    host, colon, port = text.rpartition(":")
    if not colon or not host.strip("[]") or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise UsageError(f"--rdzv-endpoint {text!r} is not HOST:PORT with a port from 1 to 65535",
                         "e.g. --rdzv-endpoint node0:29500, the same on every machine")
    try:
        socket.getaddrinfo(host.strip("[]"), int(port))
    except socket.gaierror as e:
        raise UsageError(f"--rdzv-endpoint {text}: no address is known for {host} ({e.strerror})",
                         "give the name or address of machine 0 as every machine reaches it") from None


def launch_config(parallel: Parallel, per_node: int, logs: Path):
    """torchrun's settings; the agent's files (the workers' error.json) under `logs`, which the run removes."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.launcher.api import LaunchConfig

    from h3gen.parallel import rendezvous

    nnodes, endpoint = parallel.nnodes or 1, parallel.rdzv_endpoint
    if nnodes == 1 and not endpoint:  # torchrun --standalone: a store of its own on a free local port
        backend, endpoint, configs, run_id = "c10d", "localhost:0", {}, uuid.uuid4().hex
    elif parallel.node_rank is not None:  # torchrun --node-rank: node 0 hosts the store at the endpoint
        backend, configs, run_id = rendezvous.BACKEND, {"rank": parallel.node_rank}, parallel.rdzv_id or "h3gen"
    else:  # torchrun --rdzv-backend c10d: the nodes meet at the endpoint and get their ranks in arrival order
        backend, configs, run_id = "c10d", {"join_timeout": rendezvous.JOIN_TIMEOUT_S}, parallel.rdzv_id or "h3gen"
    # max_restarts 0: a restarted worker would render clips its group already wrote; a rerun resumes instead.
    return LaunchConfig(min_nodes=nnodes, max_nodes=nnodes, nproc_per_node=per_node, run_id=run_id,
                        role="h3gen", rdzv_endpoint=endpoint, rdzv_backend=backend, rdzv_configs=configs,
                        max_restarts=0, monitor_interval=0.5, start_method="spawn",
                        logs_specs=DefaultLogsSpecs(log_dir=str(logs)))


def launch_workers(batch, settings: RunSettings, entry: str, began: float) -> int:
    """Start the workers of a run checked by `prepare` with `layout_check`: `python -m ENTRY JOB` each (a module that
    calls h3gen.parallel.worker's `main` with the reporters to draw with, its `reporter_for`; this process's own
    lines are drawn with them too, so they read as rank 0's do). `began`: the time.time() the command began, which
    rank 0's wall time counts from."""
    reporter = importlib.import_module(entry).reporter_for(0, False, "", quiet=settings.quiet)
    parallel, heads, refusal = settings.parallel, dit_heads(batch.repo), split_refusal(batch.preset, batch.found)
    per_node = parallel.workers
    # On the CPU a clip depends on the intra-op thread count (MKL and ATen split their sums by thread): give each
    # worker its share of the cores, and say so in the README, rather than torchrun's silent one thread each.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // per_node)))
    with scratch_folder() as scratch:
        if not settings.prompts.is_file():  # a pipe, read by the checks: the workers read what it held
            from h3gen.inputs.prompts import prompts_bytes

            held = Path(scratch) / "prompts"
            held.write_bytes(prompts_bytes(settings.prompts))
            settings = dataclasses.replace(settings, prompts=held)
        job = {"settings": settings.to_json(), "device": "gpu" if parallel.gpus else "cpu",
               "status_file": str(Path(scratch) / "status"), "heads": heads, "split_refusal": refusal, "began": began,
               "launcher": os.getpid()}
        if (parallel.nnodes or 1) > 1:
            from h3gen.parallel.rendezvous import JOIN_TIMEOUT_S

            reporter.say(f"h3gen: waiting for the {parallel.nnodes} machines of the run to meet at "
                         f"{parallel.rdzv_endpoint} (at most {JOIN_TIMEOUT_S // 60} minutes)")
        stopped = run(launch_config(parallel, per_node, Path(scratch) / "agent"), job, entry, reporter.warn)
        if stopped:
            return stopped
        status = worker_status(job)
        if status is not None:
            return status[0]
    # Rank 0 ran on another machine of the job and reported there.
    reporter.say("h3gen: this machine's workers finished; the run is reported where rank 0 ran")
    return 0


@contextlib.contextmanager
def scratch_folder():
    """A folder for the run's files (held prompts, rank 0's status, the agent's files), removed at the run's end; the
    next launcher removes one a killed launcher left, which no longer holds its lock."""
    sweep_scratch()
    with tempfile.TemporaryDirectory(prefix=SCRATCH) as scratch:
        held = os.open(Path(scratch) / HELD, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(held, fcntl.LOCK_EX)
            yield scratch
        finally:
            os.close(held)


def sweep_scratch() -> None:
    """Remove this user's scratch folders whose launcher is gone: the kernel dropped its lock when it died."""
    from h3gen.run.outputs import lock_held

    for folder in Path(tempfile.gettempdir()).glob(f"{SCRATCH}*"):
        try:
            mine = folder.stat().st_uid == os.getuid()
        except OSError:
            continue
        # without the file: not a scratch folder, or one whose launcher is still making it
        if mine and (folder / HELD).is_file() and not lock_held(folder / HELD):
            shutil.rmtree(folder, ignore_errors=True)


def run(config, job: dict, entry: str, warn) -> int:
    """Start the workers and wait for them; 128 + the signal number when this process was stopped by one (said with
    `warn`)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.launcher.api import elastic_launch

    from h3gen.parallel import rendezvous

    quiet_agent()
    rendezvous.register()
    try:
        # -P: the working directory stays off the workers' sys.path, as it is off the command's, so a folder there
        # named as a package (kernels/, a plugin's source) does not shadow the installed one.
        with rendezvous.polled_exit(lambda: ended_short(job), hosts_store(config, job),
                                    lambda failures: first_cause(failures, job["device"])):
            elastic_launch(config, sys.executable)("-P", "-m", entry, json.dumps(job))
        return 0
    except ChildFailedError as failed:
        there = stopped_there(job)
        if there:  # rank 0's machine stopped, and told this one's workers to stop
            warn(f"h3gen: stopped: {there}; any clip in flight was discarded; run the same command again on every "
                 "machine to render the rest (clips already written are kept and skipped)")
            return 1
        status = worker_status(job)
        if status is not None and 0 not in failed.failures:  # rank 0 reported the run's end: a worker died after
            what = root_cause(failed, job["device"]).problem.removesuffix(", so the run was stopped")
            warn(f"h3gen: note: {what} after every clip had its result")
            return status[0]
        stop = stopped_itself(failed, job)
        if stop is None:
            raise root_cause(failed, job["device"]) from None
        from h3gen.run.loop import stopped_line

        warn(stopped_line(stop.name, *stop_of_workers(job)))
        return 128 + stop
    except rendezvous.PortTaken as e:
        raise UsageError(str(e), "give --rdzv-endpoint a free port, the same on every machine, or end what holds "
                                 "it") from None
    except rendezvous.RunUnderway as e:
        raise WorkerFailed(str(e), "wait until it ends, or stop it there, then start the same command on every "
                                   "machine") from None
    except RendezvousError as e:
        raise WorkerFailed(f"the machines of the run did not meet: {str(e).splitlines()[0]}",
                           "start the same command on every machine, each able to reach --rdzv-endpoint") from None
    except SignalException as stop:
        # The agent passed the signal on to the workers, whose rank 0 printed the summary. Only this process knows
        # the signal came from outside: rank 0 is also stopped by the agent when another worker dies.
        from h3gen.run.loop import stopped_line

        warn(stopped_line(signal.Signals(int(stop.sigval)).name, *stop_of_workers(job)))
        return 128 + int(stop.sigval)


def stopped_itself(failed, job: dict) -> signal.Signals | None:
    """SIGPIPE when rank 0 stopped the run itself, its stdout's reader gone, and reported it, dying by the signal as
    every stopped worker does; None for a worker that failed. (The other stops come from outside, through this
    process; and the agent ends the other workers with SIGTERM when one fails.)"""
    failure, status = failed.failures.get(0), worker_status(job)
    if failure is None or failure.exitcode != -signal.SIGPIPE or status is None or status[0] != 128 + signal.SIGPIPE:
        return None
    return signal.SIGPIPE


def worker_status(job: dict) -> tuple[int, int, int] | None:
    """(the run's exit status, the clips in flight a stop discarded, the clips without a result) as rank 0 wrote
    them (h3gen.parallel.serve); None when rank 0 did not report on this machine."""
    path = Path(job["status_file"])
    if not path.is_file():
        return None
    code, discarded, unfinished = map(int, path.read_text().split())
    return code, discarded, unfinished


def stopped_there(job: dict) -> str:
    """Why machine 0 stopped ("machine 0 was stopped by SIGINT"), as this machine's workers heard of it ('' if they
    did not)."""
    from h3gen.parallel.events import machine_0_stop_file

    path = machine_0_stop_file(job)
    return path.read_text() if path.is_file() else ""


def hosts_store(config, job: dict) -> bool:
    """Whether this machine's agent holds the store of the run: machine 0 of a static meeting, the machine at the
    endpoint of a c10d one (as torch's c10d rendezvous decides it), the one machine of a run of one."""
    if config.max_nodes == 1:
        return True
    if config.rdzv_backend != "c10d":
        return job["settings"]["parallel"].get("node_rank") == 0
    from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname

    return _matches_machine_hostname(config.rdzv_endpoint.rpartition(":")[0].strip("[]"))


def ended_short(job: dict) -> bool:
    """Rank 0 reported here a run that some clips lack a result of, with no signal of its own: another machine's
    workers were stopped."""
    status = worker_status(job)
    return status is not None and status[2] > 0 and status[0] < 128


def stop_of_workers(job: dict) -> tuple[int | None, int | None]:
    """(the clips in flight the stopped workers dropped, the clips left without a result) for `stopped_line`: 0 and
    None when rank 0 of this machine stopped before it reported (before any clip started), None and None when rank 0
    ran on another machine."""
    status = worker_status(job)
    if status is not None:
        return status[1], status[2]
    parallel = job["settings"]["parallel"]
    rank_0_here = (parallel.get("nnodes") or 1) == 1 or parallel.get("node_rank") == 0  # not known under c10d
    return (0 if rank_0_here else None), None


def first_cause(failures: dict, device: str) -> str:
    """A run result's first failure, as a machine tells the others of it."""
    return root_cause(SimpleNamespace(failures=failures), device).problem.removesuffix(", so the run was stopped")


def first_failure(failed):
    """(rank, failure) that came first: torchrun's pick (the earliest whole second, then its own order), except that
    of h3gen errors recorded within that second the earliest is named (a rank that loses its connection to a failed
    peer records its error after the peer's)."""
    failures = failed.failures
    rank = min(failures, key=lambda r: failures[r].timestamp)
    if recorded_at(failures[rank]) is None:  # killed, or a crash without h3gen's record: as torchrun says
        return rank, failures[rank]
    same_second = [r for r in failures
                   if failures[r].timestamp == failures[rank].timestamp and recorded_at(failures[r]) is not None]
    rank = min(same_second, key=lambda r: recorded_at(failures[r]))
    return rank, failures[rank]


def recorded_at(failure) -> float | None:
    return extra_info(failure).get("h3gen_time")


def extra_info(failure) -> dict:
    """What the worker's error file adds to its message (h3gen's exit code and time); {} where it adds nothing."""
    message = failure.error_file_data.get("message")
    return message.get("extraInfo", {}) if isinstance(message, dict) else {}


def root_cause(failed, device: str) -> H3genError:
    """The first failure, in one line: an h3gen error as the worker raised it, a signal, or an exception."""
    rank, failure = first_failure(failed)
    worker = f"{'GPU' if device == 'gpu' else 'CPU'} worker {rank}"
    data, info = failure.error_file_data.get("message"), extra_info(failure)
    if "h3gen_exit_code" in info:  # an H3genError: as a one-process run would print it
        error = H3genError(data["message"])
        error.exit_code = int(info["h3gen_exit_code"])
        return error
    again = "run the same command again to render the rest; clips already written are kept and skipped"
    if failure.exitcode < 0:
        return WorkerFailed(f"{worker} (pid {failure.pid}) was killed by {failure.signal_name()}, so the run was "
                            f"stopped", again)
    if isinstance(data, dict) and data.get("message"):
        return WorkerFailed(f"{worker} (pid {failure.pid}) failed: {data['message'].splitlines()[0]}", again)
    return WorkerFailed(f"{worker} (pid {failure.pid}) exited with status {failure.exitcode}", again)


def quiet_agent() -> None:
    """The agent logs its life at INFO and WARNING; the user gets the workers' own lines and one line on failure."""
    agent_log = logging.getLogger("torch.distributed")
    agent_log.addHandler(logging.NullHandler())
    agent_log.propagate = False
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed"):
            logging.getLogger(name).setLevel(logging.CRITICAL)

