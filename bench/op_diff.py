"""What the op-by-op numerics checks share: how far one op's output is from diffusers', and their results file."""
import json
import os
from pathlib import Path


def differ(actual, expected):
    """Relative L2 error and the fraction of values that differ at all."""
    a, e = actual.float(), expected.float()
    return dict(rel_err=float((a - e).norm() / e.norm()), differing=round(float((a != e).float().mean()), 6))


def results_log(name):
    """A `log(key, value)` that prints each result and rewrites $OUT/`name` with all of them so far."""
    out, results = Path(os.environ.get("OUT", ".")), {}

    def log(key, value):
        results[key] = value
        print(f"{key}: {json.dumps(value)}", flush=True)
        out.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(json.dumps(results, indent=1))

    return log
