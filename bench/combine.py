"""Join the results of a sweep run in pieces (`--stages`, one call each) into one JSON, table and chart.

    python bench/combine.py bench/results/A.json bench/results/B.json -o bench/results/combined
"""

import argparse
import json
from pathlib import Path

from h3gen.bench.sweep import add_ratios
from h3gen.bench.report import chart, markdown


def combine(paths: list[Path]) -> dict:
    results = [json.loads(p.read_text()) for p in paths]
    records = {}
    for result in results:  # a later piece replaces an earlier one's figure for the same preset and stage
        for r in result["records"]:
            records[(r["preset"], r["duration_s"], r["stage"])] = dict(r, commit=result["commit"])
    stages = {}
    for (preset, duration, stage), r in records.items():
        stages.setdefault((preset, duration), {})[stage] = r
    for (preset, duration), parts in stages.items():  # end to end over the pieces, where every stage ran
        if not {"encode", "dit", "vae_video", "mux"} <= set(parts):
            records.pop((preset, duration, "e2e"), None)
            continue
        pieces = [parts[s]["median_s"] for s in ("encode", "dit", "vae_video", "vae_audio", "transfer", "mux")
                  if s in parts and parts[s]["median_s"] is not None]
        e2e = dict(parts.get("e2e") or next(iter(parts.values())), stage="e2e", median_s=round(sum(pieces), 4),
                   p95_s=None, rtf=round(sum(pieces) / duration, 4), per_forward_s=None, forwards=None,
                   notes="sum of the stage medians across the combined runs")
        e2e["peak_gib"] = max((p["peak_gib"] or 0) for p in parts.values())
        records[(preset, duration, "e2e")] = e2e
    combined = dict(results[-1], records=list(records.values()),
                    commit=" + ".join(sorted({r["commit"] for r in results if r["commit"]})))
    add_ratios(combined["records"])
    return combined


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", type=Path)
    parser.add_argument("-o", "--output", type=Path, required=True, help="path stem for .json, .md, .png")
    args = parser.parse_args()
    result = combine(args.results)
    args.output.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    args.output.with_suffix(".md").write_text(markdown(result))
    chart(result, args.output.with_suffix(".png"))
