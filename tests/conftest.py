import gc
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

# Every test, and every h3gen process a test starts, uses a cache of its own: the tiny model is written once per
# test session, exactly as a user's first run writes it.
os.environ.setdefault("XDG_CACHE_HOME", tempfile.mkdtemp(prefix="h3gen-test-cache-"))
os.environ.setdefault("MKL_CBWR", "AUTO")  # as the h3gen command sets it, before torch loads MKL

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


def h3gen(*args, env=None, check_code=None, **kwargs) -> subprocess.CompletedProcess:
    """Run the installed command as a user would, in a child process."""
    result = subprocess.run([sys.executable, "-m", "h3gen.cli.main", *map(str, args)], capture_output=True,
                            text=True, env={**os.environ, **(env or {})}, **kwargs)
    if check_code is not None:
        assert result.returncode == check_code, result.stderr[-3000:]
    return result


def media(path: Path) -> list[bytes]:
    """An MP4's encoded video and audio, without its metadata (the render fingerprint, which names the preset)."""
    import av

    with av.open(str(path)) as container:
        return [bytes(packet) for packet in container.demux() if packet.size]


@pytest.fixture
def prompts_file(tmp_path):
    def write(text: str) -> Path:
        path = tmp_path / "prompts.txt"
        path.write_text(text)
        return path

    return write


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
