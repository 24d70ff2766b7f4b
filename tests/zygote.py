"""The h3gen command in a child forked from a process that has already imported torch, diffusers and transformers.

A fresh interpreter spends about ten seconds importing them before h3gen does anything, and the tests start the
command over a hundred times. This process imports them once, never runs a tensor operation (no thread pool to
inherit), and for each request forks a child that runs the command's `main()` with the request's arguments,
environment and working directory, its stdout and stderr in files, and exits with the command's status: the run
is a process of its own, as a user's is, without the imports. `conftest.h3gen` sends here only what a fork cannot
tell apart from a fresh process (no environment a library reads as it is imported; PYTHONPATH the child applies).

Protocol, one JSON line each way: {"args", "env", "cwd", "stdout", "stderr"} in, {"code"} out.

A command imports many more modules as it runs (the model classes, the stages, the muxer: two seconds of a
two-core machine); each child names those of the installed libraries and of h3gen, and this process imports them
before the next fork, so a test's commands after the first few start with them loaded.
"""

import atexit
import importlib
import json
import os
import sys
import sysconfig
import threading

os.environ.setdefault("MKL_CBWR", "AUTO")  # as the h3gen command sets it, before torch loads MKL
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # likewise, before torch loads c10

import diffusers  # noqa: E402,F401
import torch  # noqa: E402
import transformers  # noqa: E402,F401

import h3gen.cli.main  # noqa: E402

# `python -m` puts the working directory first and PYTHONPATH after it; the rest is this interpreter's own.
BASE_PATH = [entry for entry in sys.path[1:] if entry not in os.environ.get("PYTHONPATH", "").split(os.pathsep)]
AT_START = set(sys.modules)  # what every child starts with; the modules imported ahead of need come on top
# Where the modules a child names may come from: not a test's own folder (a plugin it installed, a shadowing package).
LIBRARIES = tuple({sysconfig.get_path(name) for name in ("purelib", "platlib", "stdlib", "platstdlib")}
                  | {os.path.dirname(h3gen.__file__)})


def libraries_imported(before: set) -> list[str]:
    """The modules imported since `before` that an installed library or h3gen holds."""
    return [name for name, module in list(sys.modules.items())
            if name not in before and (getattr(module, "__file__", None) or "").startswith(LIBRARIES)]


def forget_shadowed(folders: list[str]) -> None:
    """Drop the modules imported ahead of need whose top-level name one of `folders` (the child's working directory
    and PYTHONPATH) also holds: the child imports them from there, as a fresh process would (a test hides a library
    behind one)."""
    names = set()
    for folder in folders:
        try:
            names |= {entry.name.split(".")[0] for entry in os.scandir(folder)}
        except OSError:
            continue
    for name in [name for name in sys.modules if name.split(".")[0] in names and name not in AT_START]:
        del sys.modules[name]


def import_quietly(names: list[str]) -> None:
    for name in names:
        try:
            importlib.import_module(name)
        except BaseException:  # noqa: BLE001 - a module that only imports in the child's setting: left to it
            sys.modules.pop(name, None)


def child(request) -> int:
    before = set(sys.modules)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    entries = [request["cwd"], *filter(None, request["env"].get("PYTHONPATH", "").split(os.pathsep)), *BASE_PATH]
    sys.path[:] = h3gen._without_checkout(entries)  # as importing h3gen leaves it in a fresh `python -m` process
    forget_shadowed([entry for entry in sys.path if entry not in BASE_PATH])
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
    with open(request["stdout"] + ".modules", "w") as listing:
        json.dump(libraries_imported(before), listing)
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
        try:
            with open(request["stdout"] + ".modules") as listing:
                imported = json.load(listing)
        except (OSError, ValueError):  # a child that ended without its exit functions
            imported = []
        replies.write(json.dumps({"code": code}) + "\n")
        replies.flush()
        import_quietly(imported)


if __name__ == "__main__":
    serve()
