"""The environment variables a run reads before torch does: refused in one line when they would stop it later."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from h3gen.errors import UsageError

# torch reads these as it is imported, and a text its tokenizer cannot split into key:value entries stops the process
# there (SIGABRT, no Python error). Values are read later, when the device's allocator starts.
ALLOCATOR_VARIABLES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF")
_ALLOCATOR_ENTRY = re.compile(r"\s*[A-Za-z_]\w*\s*:\s*(\[[^\[\]]+\]|[^\s,:\[\]][^,:\[\]]*)\s*")


def check_threads() -> None:
    """OMP_NUM_THREADS as OpenMP takes it: whole numbers from 1 (a comma list for nested levels). OpenMP only warns
    about anything else and picks its own count, and on the CPU a clip's bytes depend on the count."""
    text = os.environ.get("OMP_NUM_THREADS")
    if text is not None and not re.fullmatch(r" *[1-9][0-9]* *(, *[1-9][0-9]* *)*", text):
        raise UsageError(f"OMP_NUM_THREADS is {text!r}, not a number of threads",
                         "set it to a whole number from 1 up, or unset it")


def allocator_entries(text: str) -> list[str] | None:
    """`text`'s comma-separated entries when each is `key:value` or `key:[list]`, else None."""
    entries, depth, start = [], 0, 0
    for index, char in enumerate(text):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if depth not in (0, 1):
            return None
        if char == "," and depth == 0:
            entries.append(text[start:index])
            start = index + 1
    entries.append(text[start:])
    return entries if depth == 0 and all(_ALLOCATOR_ENTRY.fullmatch(entry) for entry in entries) else None


def torch_imports() -> bool:
    """Whether torch imports in a process with this environment."""
    return subprocess.run([sys.executable, "-c", "import torch"], capture_output=True).returncode == 0


def check_allocator_config() -> None:
    """Each allocator variable set is one torch can read; one in another form is tried on torch in a child process
    first, so only a text that stops torch is refused."""
    for name in ALLOCATOR_VARIABLES:
        text = os.environ.get(name)
        if text and allocator_entries(text) is None and not torch_imports():
            raise UsageError(f"{name} is {text!r}, which torch cannot read (it stops as it starts)",
                             "give comma-separated key:value entries, as expandable_segments:True, or unset it")
