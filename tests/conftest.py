import atexit
import functools
import gc
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

__import__("h3gen")  # first: importing h3gen takes the checkout's root off sys.path, where `python -m pytest` puts it

# Every test, and every h3gen process a test starts, uses a cache of the test session's own, not the user's: the tiny
# model is written once per session, exactly as a user's first run writes it. The first pytest process makes the
# folder and removes it as it exits; pytest-xdist's workers inherit it.
if "H3GEN_TEST_CACHE" not in os.environ:
    os.environ["H3GEN_TEST_CACHE"] = tempfile.mkdtemp(prefix="h3gen-test-cache-")
    atexit.register(shutil.rmtree, os.environ["H3GEN_TEST_CACHE"], ignore_errors=True)
os.environ["XDG_CACHE_HOME"] = os.environ["H3GEN_TEST_CACHE"]
os.environ.setdefault("MKL_CBWR", "AUTO")  # as the h3gen command sets it, before torch loads MKL
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # likewise, before torch loads c10

ROOT = Path(__file__).resolve().parents[1]


def pytest_collection_modifyitems(config, items):
    """Tests marked `cuda` need a GPU: skipped where torch sees none (CI), run by name with `pytest -m cuda`."""
    import torch

    if torch.cuda.is_available():
        return
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    from h3gen.models.tiny import ensure_tiny_model

    return ensure_tiny_model()


# Read at run time, not as a library is imported: a child forked after the imports (tests/zygote.py) sees them as a
# fresh process would (OMP_NUM_THREADS, which OpenMP reads at load, and PYTHONPATH the fork applies itself).
FORKABLE_ENV = {"OMP_NUM_THREADS", "PYTHONPATH", "XDG_CACHE_HOME", "HOME", "SHELL", "COLUMNS", "NO_COLOR", "TERM", "MANWIDTH",
                "H3GEN_DEBUG", "H3GEN_MODEL", "H3GEN_HEARTBEAT_S", "H3GEN_STRICT_PLUGINS", "H3GEN_LOAD_PLUGINS"}
ZYGOTE = None  # the forking process, started at the first command
# Plugins installed beside h3gen (the example plugin, a user's own) would change what the tests see: lists of
# presets and stages, warnings. The tests load only the plugins they install themselves (`own_plugins`).
os.environ["H3GEN_LOAD_PLUGINS"] = "none"


def installed_plugins(*own: str) -> list[str]:
    """The names of the plugins installed beside h3gen, with the test's `own`, as h3gen lists them."""
    from importlib.metadata import entry_points

    return sorted({ep.name for ep in entry_points(group="h3gen")} | set(own))


def left_out_note(*own: str) -> str:
    """What an "unknown stage" error adds under H3GEN_LOAD_PLUGINS=none: the installed plugins it leaves out, the
    test's `own` among them ('' when none is installed)."""
    names = installed_plugins(*own)
    return (f"; H3GEN_LOAD_PLUGINS=none leaves out the installed plugin(s) {', '.join(map(repr, names))}, which may "
            "register it" if names else "")


def own_plugins(env: dict) -> dict:
    """`env` with H3GEN_LOAD_PLUGINS naming the plugins installed in the folders of its PYTHONPATH, unless it names
    them itself."""
    from importlib.metadata import distributions

    if "H3GEN_LOAD_PLUGINS" in env or not env.get("PYTHONPATH"):
        return env
    names = sorted({ep.name for dist in distributions(path=env["PYTHONPATH"].split(os.pathsep))
                    for ep in dist.entry_points if ep.group == "h3gen"})
    return {**env, "H3GEN_LOAD_PLUGINS": ",".join(names) or "none"}


def h3gen(*args, env=None, check_code=None, fresh=False, **kwargs) -> subprocess.CompletedProcess:
    """Run the installed command as a user would, in a child process: forked from one that has already imported
    torch, diffusers and transformers (tests/zygote.py), or with `fresh` (or an environment a library reads at
    import, or other subprocess arguments) a new interpreter."""
    args = [str(a) for a in args]
    env = env or {}
    if (fresh or cuda_machine() or set(env or {}) - FORKABLE_ENV or set(kwargs) - {"cwd"}
            or os.environ.get("H3GEN_TESTS_FRESH")):
        result = subprocess.run([sys.executable, "-m", "h3gen.cli.main", *args], capture_output=True,
                                text=True, env=child_env(env), **kwargs)
    else:
        result = forked(args, child_env(env), kwargs.get("cwd"))
    if check_code is not None:
        assert result.returncode == check_code, result.stderr[-3000:]
    return result


def child_env(env: dict) -> dict:
    """This process's environment with `env` over it, for an h3gen command started by hand (`subprocess.Popen`):
    with the plugins in its PYTHONPATH named (`own_plugins`), a value of None taken out."""
    return {key: value for key, value in {**os.environ, **own_plugins(env)}.items() if value is not None}


@functools.cache
def cuda_machine() -> bool:
    """On a machine with a GPU, a child forked from a process that imported torch cannot initialize CUDA (torch marks
    it a bad fork), so every command there runs in a fresh interpreter."""
    import torch

    return torch.cuda.is_available()


def forked(args, env, cwd) -> subprocess.CompletedProcess:
    import json

    global ZYGOTE
    if ZYGOTE is None or ZYGOTE.poll() is not None:
        ZYGOTE = subprocess.Popen([sys.executable, str(ROOT / "tests" / "zygote.py")], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
    with tempfile.TemporaryDirectory(prefix="h3gen-test-out-") as folder:
        out, err = Path(folder) / "stdout", Path(folder) / "stderr"
        request = dict(args=args, env=env, cwd=str(cwd or os.getcwd()), stdout=str(out), stderr=str(err))
        ZYGOTE.stdin.write(json.dumps(request) + "\n")
        ZYGOTE.stdin.flush()
        code = json.loads(ZYGOTE.stdout.readline())["code"]
        return subprocess.CompletedProcess(["h3gen", *args], code, out.read_text(), err.read_text())


def media(path: Path) -> list[bytes]:
    """An MP4's encoded video and audio, without its metadata (the render fingerprint, which names the preset)."""
    import av

    with av.open(str(path)) as container:
        return [bytes(packet) for packet in container.demux() if packet.size]


def norm_relative_error(actual, expected) -> float:
    """How far `actual` is from `expected`, relative to `expected`'s size: the ratio of norms, in float32."""
    actual, expected = actual.detach().float(), expected.detach().float()
    return float((actual - expected).norm() / expected.norm())


@pytest.fixture
def prompts_file(tmp_path):
    def write(text: str) -> Path:
        path = tmp_path / "prompts.txt"
        path.write_text(text)
        return path

    return write


@pytest.fixture
def faults(tmp_path):
    """(env, preset path): the tiny preset with the fault-injecting sampler and muxer (faulty_plugin.py) installed."""
    from faulty import FAULTS_PLUGIN, install

    env = install(tmp_path / "site", "faults", FAULTS_PLUGIN)
    preset = tmp_path / "faulty.toml"
    preset.write_text((ROOT / "presets" / "tiny.toml").read_text()
                      .replace('use = "euler"', 'use = "oom"').replace('use = "pyav"', 'use = "slow"'))
    return env, preset


def run_parity_under_triton_interpreter(test_file: str) -> None:
    """Triton decides at import whether `@triton.jit` compiles or interprets, so a file's `parity` tests run in a
    child pytest started with TRITON_INTERPRET=1; this passes only if they all ran and passed there."""
    child = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file, "-k", "parity"],
                           env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=600)
    assert child.returncode == 0, child.stdout[-4000:] + child.stderr[-2000:]
    assert " passed" in child.stdout and "skipped" not in child.stdout, child.stdout[-2000:]


def leave_group():
    """End a spawned gloo rank's process group. Call it with nothing left that holds the group: a gloo group freed
    only at interpreter exit aborts the process ("terminate called without an active exception"), so whatever still
    holds one in a reference cycle is collected while the group is alive. A gloo collective can return on one rank
    before its messages are through, so the ranks meet before the group goes."""
    import torch.distributed as dist

    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    gc.collect()
