"""What the fault tests share: the fault-injecting plugin (faulty_plugin.py) installed as `pip install` would (by
`install`, which every test that installs a plugin uses), and a render started by hand to be signalled."""

import json
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

from conftest import child_env

FAULTS_PLUGIN = (Path(__file__).parent / "faulty_plugin.py").read_text()
TWO_CLIPS = '{"id": "a", "prompt": "a fox"}\n{"id": "b", "prompt": "waves"}\n'


def install(site, name, source):
    """What `pip install` leaves behind for a package with an `h3gen` entry point."""
    site.mkdir(exist_ok=True)
    (site / f"h3gen_{name}.py").write_text(source)
    info = site / f"h3gen_{name}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: h3gen-{name}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[h3gen]\n{name} = h3gen_{name}\n")
    return {"PYTHONPATH": str(site)}


def records(result):
    return {r["id"]: r for r in map(json.loads, result.stdout.splitlines())}


def limit_file_size(limit):
    def apply():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


def start_render(args, env):
    return subprocess.Popen([sys.executable, "-m", "h3gen.cli.main", "render", *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env(env))


def wait_for(path, process, seconds=120):
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert process.poll() is None, process.communicate()[1][-2000:]
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)
