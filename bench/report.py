"""What `h3gen bench` writes: a JSON file with a stable shape, a markdown table and a per-stage chart."""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

from h3gen import __version__

TABLE_STAGES = ("encode", "dit", "cache_check", "vae_video", "vae_audio", "transfer", "mux", "e2e")
CHART_STAGES = ("encode", "dit", "vae_video", "vae_audio", "transfer", "mux")


def _command(*args) -> str | None:
    try:
        return subprocess.run(args, capture_output=True, text=True, timeout=10, check=True).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def environment() -> dict:
    import diffusers
    import torch
    import transformers

    cuda = torch.cuda.is_available()
    name = torch.cuda.get_device_name(0) if cuda else f"CPU {platform.processor() or platform.machine()}"
    driver = _command("nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader") if cuda else None
    return {
        "device": {"name": name, "driver": driver, "cuda": torch.version.cuda if cuda else None,
                   "count": torch.cuda.device_count() if cuda else 0},
        "versions": {"h3gen": __version__, "torch": torch.__version__, "diffusers": diffusers.__version__,
                     "transformers": transformers.__version__, "python": platform.python_version()},
        "commit": os.environ.get("H3GEN_COMMIT") or _command("git", "-C", str(Path(__file__).resolve().parent),
                                                             "rev-parse", "HEAD"),
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def header(result: dict) -> str:
    """A table's first line: the device, the versions, the commit, when, and the clip size measured."""
    device = result["device"]
    details = ", ".join(f"{label} {device[key]}" for label, key in (("driver", "driver"), ("CUDA", "cuda"))
                        if device.get(key))  # a CPU has no driver
    sizes = ", ".join(dict.fromkeys(str(r["size"]) for r in result["records"] if r.get("size")))
    return (f"Device: {device['name']}{f' ({details})' if details else ''}; "
            f"torch {result['versions']['torch']}, diffusers {result['versions']['diffusers']}; "
            f"commit {str(result['commit'])[:10]}; {result['created']}" + (f"; clips of {sizes}" if sizes else ""))


STAGE_LEGEND = ["", "Columns: media s is the clip's length (its frames at 24 per second); per forward s a DiT "
                "forward alone; vs baseline the baseline's median over this one's, for the stage as each ran it "
                "(the dit and e2e rows at each one's own forwards: compare per forward s for the same work); peak GiB "
                "the GPU's peak (- on the CPU); host GiB the process's resident memory; rel err vs baseline the "
                "DiT's output video latents against the baseline's, over how far the baseline moved them from the "
                "noise."]


def markdown(result: dict) -> str:
    """The records as a table; `rel err vs baseline` is the DiT's output video latents against the baseline's."""
    lines = [header(result), "",
             "| preset | media s | stage | median s | p95 s | per forward s | forwards | peak GiB | host GiB | RTF "
             "| vs baseline | rel err vs baseline |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    order, given = {stage: i for i, stage in enumerate(TABLE_STAGES)}, preset_order(result["records"])
    for r in sorted(result["records"], key=lambda r: (r["duration_s"], not r["baseline"], given[r["preset"]],
                                                      order.get(r["stage"], 99))):
        cells = [r["preset"] + (" (baseline)" if r["baseline"] else ""), f"{r['duration_s']:.2f}", r["stage"]]
        cells += [_fmt(r.get(k)) for k in ("median_s", "p95_s", "per_forward_s", "forwards", "peak_gib", "host_gib",
                                          "rtf")]
        cells.append(f"{r['vs_baseline']:.2f}x" if r.get("vs_baseline") else "-")
        cells.append(f"{r['dit_rel_err']:.3g}" if r.get("dit_rel_err") is not None else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines + [""] + note_lines(result["records"]) + STAGE_LEGEND) + "\n"


def note_lines(records: list[dict]) -> list[str]:
    """One line per preset (and baseline) with notes, per duration where the records have several: each note once,
    though several of its rows carry it."""
    notes: dict[str, list[str]] = {}
    durations = len({r.get("duration_s") for r in records}) > 1
    for r in records:
        name = r["preset"] + (" (baseline)" if r.get("baseline") else "")
        said = notes.setdefault(name + (f" at {r['duration_s']:.2f} s" if durations else ""), [])
        said += [note for note in (r.get("notes") or "").split("; ") if note and note not in said]
    return [f"- {name}: {'; '.join(said)}" for name, said in notes.items() if said]  # in the records' order


def preset_order(records: list[dict]) -> dict[str, int]:
    """Each preset's place among the records: the order the command named them in."""
    return {preset: index for index, preset in enumerate(dict.fromkeys(r["preset"] for r in records))}


def _fmt(value) -> str:
    if value is None:
        return "-"
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def chart(result: dict, path: Path) -> None:
    figure = stacked_bars(result)  # selects the Agg backend before pyplot is imported
    import matplotlib.pyplot as plt

    figure.savefig(path, dpi=110)
    plt.close(figure)


def stacked_bars(result: dict):
    """The chart: a bar per (duration, preset), stacked by the stages timed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    given = preset_order(result["records"])
    groups = sorted({(r["duration_s"], r["preset"], r["baseline"]) for r in result["records"]},
                    key=lambda g: (g[0], not g[2], given[g[1]]))
    medians = {(r["duration_s"], r["preset"], r["stage"]): r["median_s"] or 0.0 for r in result["records"]}
    labels = [f"{preset}\n{duration:.1f} s" for duration, preset, _ in groups]
    figure, axes = plt.subplots(figsize=(max(6, 1.6 * len(groups)), 4.5))
    bottoms = [0.0] * len(groups)
    timed = {r["stage"] for r in result["records"]}
    for stage in (stage for stage in CHART_STAGES if stage in timed):  # a stage not timed has no legend entry
        heights = [medians.get((d, p, stage), 0.0) for d, p, _ in groups]
        axes.bar(labels, heights, bottom=bottoms, label=stage)
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    if max(bottoms, default=0.0) > 0:
        axes.set_ylim(0, 1.1 * max(bottoms))  # room above the tallest bar
    axes.set_ylabel("seconds per clip (median)")
    axes.set_title(f"h3gen bench on {result['device']['name']}")
    axes.legend(fontsize=8)
    figure.tight_layout()
    return figure


def write_results(records: list[dict], out_dir: Path, stem: str | None = None) -> dict[str, Path]:
    result = {**environment(), "records": records}
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = stem or result["created"].replace(":", "").replace("+0000", "Z")
    paths = {ext: out_dir / f"{stem}.{ext}" for ext in ("json", "md", "png")}
    paths["json"].write_text(json.dumps(result, indent=1) + "\n")
    paths["md"].write_text(markdown(result))
    try:
        import matplotlib  # noqa: F401  the chart's one dependency, in the `bench` extra
    except ImportError:
        print("bench: no chart: matplotlib is not installed (pip install 'h3gen[bench]')", file=sys.stderr)
        del paths["png"]
    else:
        chart(result, paths["png"])
    return paths
