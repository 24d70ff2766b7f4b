"""The h3gen command in a child forked from a process that has already imported torch, diffusers and transformers.

A fresh interpreter spends about ten seconds importing them before h3gen does anything, and the tests start the
command over a hundred times. This process imports them once, never runs a tensor operation (no thread pool to
inherit), and for each request forks a child that runs the command's `main()` with the request's arguments,
environment and working directory, its stdout and stderr in files, and exits with the command's status: the run
is a process of its own, as a user's is, without the imports. `conftest.h3gen` sends here only what a fork cannot
tell apart from a fresh process (no environment a library reads as it is imported; PYTHONPATH the child applies).

Protocol, one JSON line each way: {"args", "env", "cwd", "stdout", "stderr"} in, {"code"} out.
"""

import atexit
import importlib
import json
import os
import sys
import threading

os.environ.setdefault("MKL_CBWR", "AUTO")  # as the h3gen command sets it, before torch loads MKL
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # likewise, before torch loads c10

import diffusers  # noqa: E402,F401
import torch  # noqa: E402
import transformers  # noqa: E402,F401

import h3gen.cli.main  # noqa: E402

# `python -m` puts the working directory first and PYTHONPATH after it; the rest is this interpreter's own.
BASE_PATH = [entry for entry in sys.path[1:] if entry not in os.environ.get("PYTHONPATH", "").split(os.pathsep)]


def child(request) -> int:
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    entries = [request["cwd"], *filter(None, request["env"].get("PYTHONPATH", "").split(os.pathsep)), *BASE_PATH]
    sys.path[:] = h3gen._without_checkout(entries)  # as importing h3gen leaves it in a fresh `python -m` process
    importlib.invalidate_caches()  # plugins installed under PYTHONPATH since: found by their entry points
    for fd, path in ((0, os.devnull), (1, request["stdout"]), (2, request["stderr"])):
        target = os.open(path, os.O_RDONLY if fd == 0 else os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(target, fd)
        os.close(target)
    if "OMP_NUM_THREADS" in request["env"]:  # read by OpenMP as torch loads: a fresh process would have it
        torch.set_num_threads(int(request["env"]["OMP_NUM_THREADS"]))
    sys.argv = [h3gen.cli.main.__file__, *request["args"]]
    try:
        h3gen.cli.main.main()
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    threading._shutdown()  # what interpreter exit does: join the threads, then the exit functions
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    return code


def serve() -> None:
    requests, replies = os.fdopen(os.dup(0), "r"), os.fdopen(os.dup(1), "w")
    for line in requests:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            requests.close()
            replies.close()
            os._exit(child(request))
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        replies.write(json.dumps({"code": code}) + "\n")
        replies.flush()


if __name__ == "__main__":
    serve()
