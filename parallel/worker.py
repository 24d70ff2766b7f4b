"""One torchrun worker, `main(argv, make_reporter)`: argv[0] is the launcher's JSON job; `make_reporter` draws for
rank 0, which reports the run (h3gen.cli.worker passes the command's own).

Global rank 0 reads the prompts file, skips what is already written, picks the layout and publishes the plan; then
every group renders its share of the pending clips (round-robin in file order) and rank 0 reports them all.

The handout is static: a group encodes exactly the prompts it will render, frees the text encoder, and only then
gives the DiT the memory. A dynamic handout would have to keep the encoder resident or move embeddings between
groups; the clips of one batch mostly share one size, so round-robin keeps the groups about equally busy.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import sys
import time

from h3gen.errors import H3genError


def main(argv: list[str], make_reporter) -> int:
    from h3gen.parallel.events import StoreGone
    from h3gen.run.loop import Interrupted, stop_on_signals

    job = json.loads(argv[0])
    die_with_launcher(job.get("launcher"))
    os.chdir(job["settings"]["cwd"])  # the launcher's: the paths of the run are relative to it, as the user gave them
    try:
        with stop_on_signals():
            return run_in_process_group(job, make_reporter)
    except H3genError as error:
        record_error(error)
        return error.exit_code
    except StoreGone as gone:
        record_error(gone.error())
        return 1
    except Interrupted as stop:
        # Die by the signal itself, so the launcher reports a stopped worker as stopped rather than as a crash;
        # at once, without the interpreter's teardown of the store and process-group threads.
        signum = getattr(signal, stop.signal_name)
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return stop.exit_code


PR_SET_PDEATHSIG = 1  # prctl(2)


def die_with_launcher(launcher: int | None) -> None:
    """End this worker with the launcher that started it: the kernel kills it once the launcher's process ends
    (Linux), and it ends at once where the launcher has ended already. torchrun's agent loses the workers it is
    starting when the run is stopped just then (it knows them only once all have started), and such a worker would
    wait on the launcher's rendezvous long after the run ended, holding the command's output open."""
    if launcher is None:
        return
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the agent's own shutdown is all there is
        return
    if os.getppid() != launcher:  # ended before the kernel could be told
        os._exit(1)


def record_error(error: H3genError) -> None:
    """Into torchrun's error file, marked as h3gen's, so the launcher prints it as the one line it is."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        print(f"h3gen: error: {error}", file=sys.stderr)
        return
    with open(path, "w") as f:  # torchrun reads whole seconds; h3gen_time orders ranks failing within one
        json.dump({"message": {"message": str(error), "extraInfo": {
            "timestamp": str(int(time.time())), "h3gen_time": time.time(), "h3gen_exit_code": error.exit_code}}}, f)


def run_in_process_group(job: dict, make_reporter) -> int:
    """Join torch.distributed's process group (NCCL and gloo on GPUs, gloo on CPUs), run this rank's
    `h3gen.parallel.serve.Worker`, and leave the group however it ends."""
    import torch
    import torch.distributed as dist

    local_rank = int(os.environ["LOCAL_RANK"])
    if job["device"] == "gpu":
        device = f"cuda:{local_rank}"
        torch.cuda.set_device(local_rank)
        # gloo beside nccl: the runtime's small CPU messages never wait on a CUDA stream
        dist.init_process_group("cpu:gloo,cuda:nccl", device_id=torch.device(device))
    else:
        device = "cpu"
        dist.init_process_group("gloo")
    try:
        from h3gen.parallel.serve import Worker

        return Worker(job, device, make_reporter).run()
    except H3genError as error:
        # On record before the group goes: the other ranks fail on the lost connection only after this one's error.
        record_error(error)
        return error.exit_code
    finally:
        from h3gen.parallel.events import end_threads

        end_threads()
        # What the stages built may hold a group in a reference cycle; a gloo group freed only at interpreter exit
        # aborts the process, so it goes now, while the groups are alive.
        gc.collect()
        dist.destroy_process_group()

