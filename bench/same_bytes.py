"""Render the example prompts with `tiny`, `h3-base` in fp32 and `diffusers` on the tiny model and print each MP4's
sha256: run it before and after a change that must not change what h3gen writes, and compare the two listings.

    python bench/same_bytes.py OUT_DIR
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

TINY_SIZE = ["--set", "model.needs=any", "--set", "request.width=32", "--set", "request.height=32", "--set", "sampler.steps=4",
             "--set", "runtime.dtype=float32", "--set", "runtime.device=cpu"]
NO_CACHE = ["--set", "encode.cache=false"]
RUNS = {"tiny": ["--preset", "tiny", *NO_CACHE],
        "h3-base-fp32": ["--preset", "h3-base", *TINY_SIZE, *NO_CACHE],
        "diffusers": ["--preset", "diffusers", *TINY_SIZE]}
PROMPTS = Path(__file__).resolve().parent.parent / "examples" / "prompts.txt"


def main(out: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    for name, args in RUNS.items():
        folder = out / name
        subprocess.run([sys.executable, "-m", "h3gen.cli.main", "render", str(PROMPTS), "-o", str(folder), "--force",
                        *args], check=True, env=env, stderr=subprocess.DEVNULL)
        for path in sorted(folder.glob("*.mp4")):
            print(f"{hashlib.sha256(path.read_bytes()).hexdigest()}  {name}/{path.name}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
