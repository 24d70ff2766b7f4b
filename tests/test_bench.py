"""`h3gen bench` on the CPU with the tiny model: the same code path the GPU benchmark runs."""

import contextlib
import dataclasses
import gc
import json
import re
import weakref

import pytest
import torch

from conftest import h3gen

RECORD_KEYS = {"preset", "baseline", "duration_s", "frames", "size", "stage", "median_s", "p95_s", "repeats",
               "per_forward_s", "forwards", "peak_gib", "rtf", "gpus", "layout", "random_weights", "notes",
               "vs_baseline", "dit_rel_err", "vram_gib", "host_gib"}


def test_bench_tiny_writes_json_table_and_chart(tmp_path):
    result = h3gen("bench", "--preset", "tiny", "--preset", "fasth3", "--durations", "5", "--size", "32x32",
                   "--repeat", "2", "--random-weights", "tiny", "--forwards", "2", "-o", tmp_path, check_code=0)
    paths = result.stdout.split()
    assert [p.rsplit(".", 1)[1] for p in paths] == ["json", "md", "png"]
    data = json.loads(open(paths[0]).read())
    assert {"device", "versions", "commit", "created", "records"} <= set(data)
    assert data["device"]["cuda"] is None and "CUDA" not in open(paths[1]).read().splitlines()[0]  # a CPU run
    assert all(set(r) == RECORD_KEYS for r in data["records"])
    by = {(r["preset"], r["stage"]): r for r in data["records"]}
    assert set(s for p, s in by if p == "tiny") == {"encode", "dit", "vae_video", "vae_audio", "transfer", "mux", "e2e"}
    assert by[("diffusers", "dit")]["baseline"] and by[("diffusers", "dit")]["forwards"] == 49
    assert by[("fasth3", "dit")]["forwards"] == 4 and by[("tiny", "dit")]["forwards"] == 3
    dit = by[("fasth3", "dit")]
    # A forward alone scales to the preset's 4; the sampler's layout, noise and steps are counted once.
    outside = float(re.search(r"([0-9.]+) s of the sampler's work outside them once a clip", dit["notes"])[1])
    assert outside > 0 and abs(dit["median_s"] - (4 * dit["per_forward_s"] + outside)) < 2e-3
    assert "2 forwards timed, scaled to 4" in dit["notes"]
    e2e = by[("tiny", "e2e")]
    # rtf is rounded from the unrounded median: within one unit of its last digit of the rounded median's ratio
    assert abs(e2e["rtf"] - e2e["median_s"] / e2e["duration_s"]) <= 1.5e-4 and e2e["repeats"] == 2
    assert by[("diffusers", "e2e")]["vs_baseline"] == 1.0
    # Each preset's DiT output against the baseline's on the same weights and inputs; nothing to compare elsewhere.
    assert by[("diffusers", "dit")]["dit_rel_err"] is None and by[("tiny", "e2e")]["dit_rel_err"] is None
    assert all(0 <= by[(p, "dit")]["dit_rel_err"] < 1 for p in ("tiny", "fasth3"))
    assert "| tiny | 5.17 | dit |" in open(paths[1]).read()
    # The process's resident host memory once each stage had loaded and had run: the tiny model's torch at least.
    assert all(r["host_gib"] > 0.1 for r in data["records"]) and e2e["host_gib"] == max(
        by[("tiny", s)]["host_gib"] for s in ("encode", "dit", "vae_video", "mux"))
    assert open(paths[2], "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    # On the CPU: no GPU and no device peak to report, rather than 1 GPU at 0.0 GiB.
    assert {(r["gpus"], r["peak_gib"]) for r in data["records"]} == {(0, None)}


def test_bench_stage_subset_uses_random_stand_ins(tmp_path):
    result = h3gen("bench", "--preset", "tiny", "--baseline", "none", "--durations", "5", "--size", "32x32",
                   "--repeat", "1", "--warmup", "0", "--stages", "vae,mux", "-o", tmp_path, check_code=0)
    data = json.loads(open(result.stdout.split()[0]).read())
    assert {r["stage"] for r in data["records"]} == {"vae_video", "vae_audio", "transfer", "mux", "e2e"}
    alone = h3gen("bench", "--preset", "tiny", "--baseline", "none", "--durations", "5", "--size", "32x32",
                  "--repeat", "1", "--warmup", "0", "--stages", "mux", "-o", tmp_path, check_code=0)
    [mux] = [r for r in json.loads(open(alone.stdout.split()[0]).read())["records"] if r["stage"] == "mux"]
    assert mux["median_s"] > 0  # the stand-in audio has a sample rate the encoder takes


def test_bench_rejects_unknown_stage(tmp_path):
    result = h3gen("bench", "--stages", "dit,paint", "-o", tmp_path)
    assert result.returncode == 2 and "unknown stage 'paint'" in result.stderr


def test_bench_refuses_a_duration_or_size_as_render_refuses_it(tmp_path, prompts_file):
    for asked, line in ((["--durations", "5,4"], '{"prompt": "x", "duration": 4}'),
                        (["--size", "33x32"], '{"prompt": "x", "width": 33, "height": 32}'),
                        (["--size", "32x320"], '{"prompt": "x", "width": 32, "height": 320}'),
                        (["--size", "320000x320000"], '{"prompt": "x", "width": 320000, "height": 320000}')):
        bench = h3gen("bench", "--preset", "tiny", "--baseline", "none", "--random-weights", "tiny", "--stages",
                      "encode", "--repeat", "1", "--warmup", "0", "--durations", "5", "--size", "32x32", *asked, "-o",
                      tmp_path / "results", check_code=2)
        render = h3gen("render", prompts_file(line + "\n"), "-o", tmp_path / "out", "--dry-run", check_code=2)
        why = render.stderr.split(":1: ", 1)[1]  # the same problem and fix, named by the option, not a line
        assert bench.stderr == f"h3gen: error: {' '.join(asked)}: {why}", bench.stderr
    assert not (tmp_path / "results").exists()


def test_bench_checks_the_model_each_preset_is_made_for(tmp_path):
    """As `render` does, on a model directory (the embedded tiny one here); random weights stand in for any model."""
    common = ["--durations", "5", "--size", "32x32", "--stages", "vae,mux", "--repeat", "1", "--warmup", "0", "-o",
              tmp_path]
    refused = h3gen("bench", "--preset", "h3-base", "--baseline", "none", *common, check_code=2)
    full = "--random-weights full (its" if torch.cuda.is_available() else "--random-weights full on a GPU (its"
    assert refused.stderr.startswith("h3gen: error: preset h3-base needs a MiniMax-H3 repository, and no --model was "
                                     "given, so the embedded tiny model stands in (pass --model DIR (or H3GEN_MODEL) "
                                     f"with the MiniMax-H3 repository, {full} architecture, random weights), --preset "
                                     "tiny, or --set model.needs=any")
    baseline = h3gen("bench", "--preset", "tiny", *common, check_code=2)  # the baseline, diffusers, is checked too
    assert baseline.stderr.startswith("h3gen: error: preset diffusers needs a MiniMax-H3 repository")
    assert "--baseline none, or --set model.needs=any" in baseline.stderr and "--preset tiny" not in baseline.stderr
    anyway = h3gen("bench", "--preset", "h3-base", *common, "--set", "model.needs=any", check_code=0)
    records = json.loads(open(anyway.stdout.split()[0]).read())["records"]
    assert {r["preset"] for r in records} == {"h3-base", "diffusers"}


@pytest.mark.parametrize("output", ["file", "/proc/h3gen-nope/results"])
def test_bench_refuses_an_output_it_cannot_write_before_it_runs(tmp_path, output):
    (tmp_path / "file").write_text("mine")
    target = tmp_path / output
    result = h3gen("bench", "--preset", "tiny", "--baseline", "none", "--random-weights", "tiny", "--durations", "5",
                   "--size", "32x32", "-o", target, check_code=2)
    assert result.stderr.startswith(f"h3gen: error: output directory {target} ")
    assert "bench:" not in result.stderr  # nothing ran
    assert (tmp_path / "file").read_text() == "mine"


def test_the_report_s_device_line_leaves_out_what_the_machine_has_not():
    from h3gen.bench.report import markdown

    result = {"versions": {"torch": "2", "diffusers": "0.42"}, "commit": "abc", "created": "now", "records": []}
    cpu = markdown({**result, "device": {"name": "CPU x86_64", "driver": None, "cuda": None, "count": 0}})
    gpu = markdown({**result, "device": {"name": "NVIDIA H200", "driver": "580.1", "cuda": "13.0", "count": 1}})
    assert cpu.startswith("Device: CPU x86_64; torch 2") and "None" not in cpu
    assert gpu.startswith("Device: NVIDIA H200 (driver 580.1, CUDA 13.0); torch 2")


def test_the_report_lists_presets_in_the_order_the_command_named_them():
    from h3gen.bench.report import markdown

    def row(preset, baseline=False):
        return {"preset": preset, "baseline": baseline, "duration_s": 5.0, "stage": "dit", "median_s": 1.0,
                "notes": f"{preset}'s note"}

    result = {"versions": {"torch": "2", "diffusers": "0.42"}, "commit": "abc", "created": "now",
              "device": {"name": "CPU"}, "records": [row("diffusers", True), row("zeta"), row("alpha")]}
    lines = markdown(result).splitlines()
    named = [line.split(" | ")[0].lstrip("| ") for line in lines if line.startswith("| ") and " dit " in line]
    assert named == ["diffusers (baseline)", "zeta", "alpha"]
    assert [line.split(":")[0] for line in lines if line.startswith("- ")] == ["- diffusers (baseline)", "- zeta",
                                                                               "- alpha"]


def test_bench_batch_times_clips_through_the_renderer(tmp_path):
    # The baseline renders clip by clip (mux in line), here one clip; the preset's muxes run behind the next clip's DiT.
    # The preset at its own 3 forwards, the baseline at 1 (--baseline-forwards): compared at 3 all the same.
    result = h3gen("bench", "--batch", "2", "--baseline-clips", "1", "--preset", "tiny", "--durations", "5", "--size",
                   "64x32", "--random-weights", "tiny", "--baseline-forwards", "1", "--text-tokens", "8", "-o",
                   tmp_path, check_code=0)
    paths = result.stdout.split()
    assert [p.rsplit(".", 1)[1] for p in paths] == ["json", "md"]
    records = {r["preset"]: r for r in json.loads(open(paths[0]).read())["records"]}
    tiny, base = records["tiny"], records["diffusers"]
    assert base["baseline"] and not tiny["baseline"] and (tiny["clips"], base["clips"]) == (2, 1)
    assert tiny["forwards"] == 3 and base["forwards"] == 1
    assert tiny["full_forwards"] == 3 and base["full_forwards"] == 49
    assert tiny["warmup_clips"] == base["warmup_clips"] == 1  # --warmup's default: one untimed clip first
    said = [line for line in result.stderr.splitlines() if line.startswith("bench: ") and line.endswith(" ok")]
    assert said == ["bench: warm-up clip 1 ok", "bench: clip 1 ok", "bench: warm-up clip 1 ok", "bench: clip 1 ok",
                    "bench: clip 2 ok"]  # the baseline's, then the preset's: the batch's clips counted apart
    assert tiny["extra_per_clip_s"] > 0 and tiny["vae_s_per_clip"] > 0 and tiny["mux_s_per_clip"] > 0
    assert 0 < tiny["last_clip_tail_s"] < tiny["wall_s"] and 0 < base["last_clip_tail_s"] < base["wall_s"]
    # The tail's part until the mux returned: all but the clip's finish (in the background mux, or in line).
    assert all(0 < r["last_clip_mux_left_s"] <= r["last_clip_tail_s"] for r in (tiny, base))
    # The wall ends at the last file written; the unload after it is reported apart.
    assert tiny["unload_s"] > 0 and 0 < tiny["between_clips_s"] < tiny["extra_per_clip_s"]
    assert base["between_clips_s"] is None  # one timed clip: no next clip to wait for
    expected = 3600 / (3 * tiny["per_forward_s"] + tiny["extra_per_clip_s"] + tiny["encode_s"] / 2)
    assert abs(tiny["clips_per_hour_full"] - expected) < 0.05 * expected
    # Run at its own forwards, the projection is the measured rate itself.
    assert abs(tiny["clips_per_hour_full"] - tiny["clips_per_hour"]) < 0.05 * tiny["clips_per_hour"]
    assert tiny["vs_baseline"] == round(tiny["clips_per_hour_full"] / base["clips_per_hour_full"], 3)
    # Against the baseline run on the preset's own 3 forwards, from the baseline's measured costs.
    base_same = 3600 / (3 * base["per_forward_s"] + base["extra_per_clip_s"] + base["encode_s"])
    assert abs(tiny["vs_baseline_same_forwards"] - tiny["clips_per_hour_full"] / base_same) < 1e-3
    assert tiny["vs_baseline_same_forwards"] < tiny["vs_baseline"]
    assert base["vs_baseline"] == base["vs_baseline_same_forwards"] == 1.0
    table = open(paths[1]).read()
    assert "| tiny | 2 |" in table
    # The two ratios side by side, each said in the table's notes.
    assert "vs_baseline is clips_per_hour_full over the baseline's, each at its own forwards a clip" in table
    assert "clips_per_hour is the timed clips over the batch's wall time" in table and "; clips of 64x32" in table
    rejected = h3gen("bench", "--baseline-clips", "1", "-o", tmp_path)
    assert rejected.returncode == 2 and "--baseline-clips" in rejected.stderr and "--batch" in rejected.stderr
    rejected = h3gen("bench", "--baseline-forwards", "1", "-o", tmp_path)
    assert rejected.returncode == 2 and "--baseline-forwards" in rejected.stderr and "--batch" in rejected.stderr


def test_full_size_random_weights_have_no_repository_directory():
    # Stages that read optional files from the repository (the canvas rules of conditions) use the defaults.
    from h3gen.bench.random_weights import FullSizeRandom
    from h3gen.models.conditions import canvas_configs

    assert FullSizeRandom(None).root is None and canvas_configs(FullSizeRandom(None))


def test_bench_batch_warm_cache_never_loads_the_encoder(tmp_path):
    """--warm-cache: the batch twice over one fresh embedding cache; the second run reads every prompt from it."""
    result = h3gen("bench", "--batch", "2", "--preset", "tiny", "--baseline", "none", "--durations", "5", "--size",
                   "64x32", "--random-weights", "tiny", "--forwards", "1", "--text-tokens", "8", "--warm-cache",
                   "--warmup", "0",
                   "-o", tmp_path, check_code=0)
    paths = result.stdout.split()
    cold, warm = json.loads(open(paths[0]).read())["records"]
    assert cold["warmup_clips"] == 0
    assert (cold["embedding_cache"], warm["embedding_cache"]) == ("cold", "warm")
    assert cold["vs_baseline"] is None and warm["vs_baseline_same_forwards"] is None  # no baseline: null, as per stage
    assert cold["encoder_loads"] == 1 and warm["encoder_loads"] == 0
    assert all(s > 0 for s in cold["encode_s_per_clip"]) and len(warm["encode_s_per_clip"]) == 2
    table = open(paths[1]).read()
    assert "| tiny, warm embedding cache | 2 |" in table and "None" not in table  # '-' where nothing was measured
    rejected = h3gen("bench", "--warm-cache", "-o", tmp_path)
    assert rejected.returncode == 2 and "--warm-cache" in rejected.stderr


def test_full_size_random_encoder_has_a_cache_identity(tiny_model):
    """The random encoder is fixed by its architecture, seed and tokenizer: those key its embedding cache."""
    from h3gen.bench.random_weights import FullSizeRandom
    from h3gen.models.repo import ModelRepo

    repo = ModelRepo(tiny_model)
    identity = FullSizeRandom(repo).text_encoder_identity()
    FullSizeRandom(repo).text_encoder_config()  # transformers rewrites rope settings in place: not the constants
    assert identity == FullSizeRandom(repo).text_encoder_identity()
    assert identity != FullSizeRandom(repo, seed=7).text_encoder_identity()
    assert identity != repo.text_encoder_identity()


def test_bench_times_every_forward_of_a_cached_preset(tmp_path):
    # A reused forward costs less than a computed one, so --forwards cannot scale: all 49 run, 24 of them in full.
    result = h3gen("bench", "--preset", "h3-base-fast-fixed", "--baseline", "tiny", "--stages", "dit", "--durations",
                   "5", "--size", "32x32", "--repeat", "1", "--warmup", "0", "--random-weights", "tiny", "--forwards",
                   "1", "--set", "sampler.video_shift=11", "-o", tmp_path, check_code=0)
    data = json.loads(open(result.stdout.split()[0]).read())
    by = {r["stage"]: r for r in data["records"] if not r["baseline"]}
    assert by["dit"]["forwards"] == 49 and "49 forwards timed (24 computed in full, 25 reused)" in by["dit"]["notes"]
    assert set(by) == {"dit", "cache_check"}  # no e2e row: one stage timed alone is its own end to end
    assert by["dit"]["dit_rel_err"] is None  # the baseline's latents after 1 forward are no reference for 49
    assert "no dit_rel_err: 49 forwards against the baseline's 1 (--forwards K runs both alike)" in by["dit"]["notes"]
    assert "--set sampler.video_shift=11" in by["dit"]["notes"]
    assert by["cache_check"]["forwards"] == 49 and 0 < by["cache_check"]["median_s"] < by["dit"]["median_s"]


def test_random_weights_made_on_read_are_the_same_weights_wherever_they_go():
    """The benchmark's DiT: the diffusers module made whole, and h3gen's DiT read from it module by module, hold
    the same random weights (each module seeded by its name), none left on the meta device, none all zeros."""
    from diffusers import MiniMaxH3Transformer3DModel

    from h3gen.bench.random_weights import MadeOnRead, made_empty
    from h3gen.models.dit.transformer import FastH3Transformer
    from test_fast_dit import TINY, layout_inputs, relative_error

    whole = made_empty(lambda: MiniMaxH3Transformer3DModel(**TINY), "cpu", torch.float32)
    MadeOnRead(whole, "cpu", seed=5).make_all()
    params = dict(whole.named_parameters())
    assert not any(p.is_meta for p in params.values())
    assert all(p.abs().sum() > 0 for name, p in params.items() if name.endswith("weight"))
    assert torch.equal(whole.rope.inv_freq, MiniMaxH3Transformer3DModel(**TINY).rope.inv_freq)  # buffers as built
    empty = made_empty(lambda: MiniMaxH3Transformer3DModel(**TINY), "cpu", torch.float32)
    read = MadeOnRead(empty, "cpu", seed=5)
    key = next(name for name in params if name.startswith("transformer_blocks.1.") and name.endswith("weight"))
    assert torch.equal(read(key), params[key])
    fast = FastH3Transformer.from_tensors(dict(whole.config), MadeOnRead(
        made_empty(lambda: MiniMaxH3Transformer3DModel(**TINY), "cpu", torch.float32), "cpu", seed=5), "cpu")
    inputs = layout_inputs()
    with torch.no_grad():
        expected = whole.eval()(**inputs, return_dict=False)
    for actual, wanted in zip(fast(**inputs), expected):
        assert relative_error(actual, wanted) < 1e-5
    other = made_empty(lambda: MiniMaxH3Transformer3DModel(**TINY), "cpu", torch.float32)
    MadeOnRead(other, "cpu", seed=6).make_all()
    assert not torch.equal(other.proj_in.weight, whole.proj_in.weight)


def test_random_weights_made_on_read_keep_a_module_s_buffers_as_built():
    from h3gen.bench.random_weights import MadeOnRead, made_empty

    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(3, 4))
            self.register_buffer("steps", torch.arange(4.0), persistent=False)

    model = made_empty(Scaled, "cpu", torch.float32)
    assert model.weight.is_meta and torch.equal(model.steps, torch.arange(4.0))
    MadeOnRead(model, "cpu", seed=1).make_all()
    assert torch.equal(model.steps, torch.arange(4.0)) and model.weight.abs().sum() > 0
    assert not model.weight.requires_grad


def test_a_bench_whose_run_failed_exits_1_with_the_others_numbers_written(tmp_path, monkeypatch):
    from h3gen.bench import sweep
    from h3gen.cli.bench import run_bench_command

    def one_failed(plan, registry, source, random_weights, say):
        return [dict(preset="tiny", baseline=False, duration_s=5.0, frames=124, size="32x32", stage="e2e",
                     median_s=None, p95_s=None, repeats=0, per_forward_s=None, forwards=None, peak_gib=None,
                     host_gib=None, rtf=None, dit_rel_err=None, vram_gib=None, gpus=0, layout="single",
                     random_weights="tiny", notes="failed: ClipError: over the encoder limit")]

    monkeypatch.setattr(sweep, "run_bench", one_failed)
    code = run_bench_command(["tiny"], "none", "5", "32x32", 1, 0, "tiny", None, "encode", None, 8, tmp_path)
    assert code == 1 and len(list(tmp_path.glob("*.json"))) == 1


@pytest.mark.parametrize("args, message", [
    (["--stages", ","], "--stages ',' names no stage (choose from encode,dit,vae,mux)"),
    (["--text-tokens", "5000"], "--text-tokens 5000 is over preset tiny's encoder limit of 1024 (give at most 1024)"),
])
def test_bench_refuses_a_plan_that_cannot_measure_anything(tmp_path, args, message):
    result = h3gen("bench", "--preset", "tiny", "--baseline", "none", "--random-weights", "tiny", "--durations", "5",
                   "--size", "32x32", "-o", tmp_path / "results", *args, check_code=2)
    assert result.stderr == f"h3gen: error: {message}\n" and not (tmp_path / "results").exists()


def test_the_chart_shows_only_the_stages_timed_with_room_above_the_tallest_bar():
    import matplotlib.pyplot as plt

    from h3gen.bench.report import stacked_bars

    records = [dict(duration_s=5.17, preset=preset, baseline=preset == "diffusers", stage=stage, median_s=median)
               for preset, stage, median in (("diffusers", "dit", 4.0), ("tiny", "dit", 1.0), ("tiny", "mux", 0.5))]
    figure = stacked_bars({"records": records, "device": {"name": "cpu"}})
    axes = figure.axes[0]
    assert axes.get_legend_handles_labels()[1] == ["dit", "mux"]
    assert axes.get_ylim()[1] > 4.0 * 1.05
    plt.close(figure)


def test_bench_without_matplotlib_writes_its_records_and_says_why_there_is_no_chart(tmp_path):
    hidden = tmp_path / "hidden" / "matplotlib"
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text("raise ImportError('matplotlib is hidden here')\n")
    result = h3gen("bench", "--preset", "tiny", "--baseline", "none", "--durations", "5", "--size", "32x32",
                   "--repeat", "1", "--random-weights", "tiny", "--forwards", "1", "-o", tmp_path / "out",
                   env={"PYTHONPATH": str(hidden.parent)}, check_code=0)
    assert [p.rsplit(".", 1)[1] for p in result.stdout.split()] == ["json", "md"]
    assert "bench: no chart: matplotlib is not installed (pip install 'h3gen[bench]')" in result.stderr
    assert not list((tmp_path / "out").glob("*.png"))


def test_bench_batch_of_a_preset_against_itself_keeps_the_two_batches_apart(tmp_path):
    """The baseline and a measured preset of one name: each batch renders into a folder of its own."""
    result = h3gen("bench", "--batch", "1", "--baseline", "tiny", "--preset", "tiny", "--durations", "5", "--size",
                   "64x32", "--random-weights", "tiny", "--forwards", "1", "--text-tokens", "8", "--warmup", "0",
                   "-o", tmp_path, check_code=0)
    base, measured = json.loads(open(result.stdout.split()[0]).read())["records"]
    assert base["baseline"] and not measured["baseline"]
    assert base["clips_per_hour"] > 0 and measured["clips_per_hour"] > 0 and measured["vs_baseline"] > 0


@pytest.mark.parametrize("args, message", [
    (["--batch", "2", "--stages", "dit"], "--stages dit belongs to the per-stage benchmark: a batch times whole "
                                          "clips, every stage (drop --stages, or --batch to time the stages apart)"),
    (["--forwards", "10"], "--forwards 10 is over preset tiny's 3 DiT forwards a clip (give at most 3)"),
    (["--batch", "1", "--baseline", "tiny", "--baseline-forwards", "4"],
     "--baseline-forwards 4 is over preset tiny's 3 DiT forwards a clip (give at most 3)"),
    (["--set", "runtime.device=cpu"], "H3GEN_COMMIT is 'latest', not a commit hash (set it to the hash of the commit "
                                      "the source was checked out at (git rev-parse HEAD), or unset it)"),
    (["--model", "models/H3"], "--model and --random-weights tiny both given: the random weights stand in for the "
                               "model, and nothing is read from its directory (leave out one of them)"),
])
def test_bench_refuses_options_it_would_not_honour(tmp_path, args, message):
    env = {"H3GEN_COMMIT": "latest"} if "H3GEN_COMMIT" in message else None
    result = h3gen("bench", "--preset", "tiny", "--random-weights", "tiny", "--durations", "5", "--size", "32x32",
                   "-o", tmp_path / "results", *args, env=env, check_code=2)
    assert result.stderr == f"h3gen: error: {message}\n" and not (tmp_path / "results").exists()


def test_a_failed_preset_s_traceback_is_printed_with_traceback(monkeypatch, capsys):
    from h3gen.bench.sweep import said_failed

    said = []
    try:
        raise KeyError("batch-0")
    except KeyError as e:
        said_failed(said.append, "batch with tiny", e)
        assert "Traceback" not in capsys.readouterr().err  # without --traceback: the one line alone
        monkeypatch.setenv("H3GEN_DEBUG", "1")  # what --traceback sets
        said_failed(said.append, "batch with tiny", e)
    assert said == ["bench: batch with tiny failed: KeyError: 'batch-0'"] * 2
    assert "Traceback" in capsys.readouterr().err


@pytest.mark.parametrize("seconds, frames", [(5, 124), (6, 158), (10, 243), (15, 345)])
def test_the_bench_renders_the_frames_render_gives_a_duration(seconds, frames):
    """The smallest 17n+5 lasting the duration, as a prompt's duration gives (6 s: 158 frames, not the nearest 141)."""
    from h3gen.bench.batch import batch_requests
    from h3gen.bench.sweep import BenchPlan

    assert [r.frames for r in batch_requests(BenchPlan(presets=["tiny"]), seconds, 2)] == [frames] * 2


def test_bench_with_random_weights_says_it_does_not_read_h3gen_model(tmp_path):
    result = h3gen("bench", "--preset", "tiny", "--baseline", "none", "--random-weights", "tiny", "--durations", "5",
                   "--size", "32x32", "--repeat", "1", "--warmup", "0", "--stages", "dit", "-o", tmp_path,
                   env={"H3GEN_MODEL": str(tmp_path / "no-such-model")}, check_code=0)
    assert result.stderr.startswith("h3gen: note: H3GEN_MODEL is not read with --random-weights tiny\n")


def test_the_table_says_each_note_of_a_preset_once():
    from h3gen.bench.report import note_lines

    records = [dict(preset="tiny", baseline=False, notes="3 forwards timed; --set sampler.steps=4"),
               dict(preset="tiny", baseline=False, notes="--set sampler.steps=4"),
               dict(preset="tiny", baseline=True, notes=""), dict(preset="fasth3", baseline=False, notes=None)]
    assert note_lines(records) == ["- tiny: 3 forwards timed; --set sampler.steps=4"]
    two = [dict(preset="tiny", baseline=False, duration_s=d, notes=f"{d} s outside") for d in (5.1667, 10.125)]
    assert note_lines(two) == ["- tiny at 5.17 s: 5.1667 s outside", "- tiny at 10.12 s: 10.125 s outside"]


def test_durations_and_size_are_read_each_on_its_own():
    from h3gen.cli.bench import parse_plan
    from h3gen.errors import UsageError

    for durations, size, message in (("5,,10", "32x32", "cannot read --durations '5,,10'"),
                                     ("10", "32*32", "cannot read --size '32*32' (WIDTHxHEIGHT: e.g.")):
        with pytest.raises(UsageError) as refused:
            parse_plan(["tiny"], "none", durations, size, 1, 0, "dit", None, None)
        assert str(refused.value).startswith(message) and ("size" in message) == ("--size" in str(refused.value))
    plan = parse_plan(["tiny", "fasth3", "tiny"], "none", "5,10,5", "32x32", 1, 0, "dit,vae,dit", None, None)
    assert (plan.presets, plan.durations, plan.stages) == (["tiny", "fasth3"], [5.0, 10.0], ("dit", "vae"))  # once each


@pytest.mark.parametrize("size, noted", [("1344x768", True), ("32x32", False)])
def test_a_cpu_bench_of_a_large_clip_says_it_takes_minutes_before_it_starts(tmp_path, monkeypatch, capsys, size,
                                                                             noted):
    from h3gen.bench import sweep
    from h3gen.cli.bench import run_bench_command

    def nothing_timed(plan, registry, source, random_weights, say):
        say("bench: timing")
        return []

    monkeypatch.setattr(sweep, "run_bench", nothing_timed)
    run_bench_command(["tiny"], "none", "10", size, 1, 0, "tiny", None, "encode", None, 8, tmp_path)
    said = capsys.readouterr().err
    note = ("bench: note: on the CPU a 1344x768 clip of 10 s takes minutes a stage, even on the tiny model; "
            "--size 32x32 --durations 5 times the CPU path in seconds\n")
    assert said.startswith(note + "bench: timing") if noted else note not in said and said.startswith("bench: timing")


@pytest.mark.parametrize("random_weights, shape", [("tiny", ("32x32", (5.0,))), ("full", ("1344x768", (10.0,)))])
def test_without_size_or_durations_the_tiny_model_is_timed_at_its_own_shape(tmp_path, monkeypatch, random_weights,
                                                                          shape):
    """The tiny model at its preset's 32x32 and 5 s, a smoke run in seconds; full-size weights at the shape every
    benchmark of H3 times."""
    from h3gen.bench import sweep
    from h3gen.cli.bench import run_bench_command

    planned = []
    monkeypatch.setattr(sweep, "run_bench", lambda plan, *rest: planned.append(plan) or [])
    monkeypatch.setattr("h3gen.run.budget.check_host_fits", lambda *args: None)  # full size: no host holds it here
    run_bench_command(["tiny"], "none", None, None, 1, 0, random_weights, None, "encode", None, 8, tmp_path)
    [plan] = planned
    assert (f"{plan.width}x{plan.height}", tuple(plan.durations)) == shape


@pytest.mark.parametrize("batch", [None, 2])
def test_a_bench_stopped_by_a_signal_says_so_and_leaves_no_folder_it_made(tmp_path, monkeypatch, capsys, batch):
    import os
    import signal
    import time

    from h3gen.bench import batch as batches, sweep
    from h3gen.cli.bench import run_bench_command

    def stopped(*args, **kwargs):  # the signal while a stage is timed
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)

    monkeypatch.setattr(sweep, "run_bench", stopped)
    monkeypatch.setattr(batches, "time_batch", stopped)
    out, handler = tmp_path / "results" / "today", signal.getsignal(signal.SIGTERM)
    code = run_bench_command(["tiny"], "none", "5", "32x32", 1, 0, "tiny", None, "encode,dit,vae,mux", None, 8, out,
                             batch=batch)
    assert code == 143 and not (tmp_path / "results").exists()
    assert capsys.readouterr().err.splitlines()[-1] == \
        "h3gen: bench stopped by SIGTERM: no results written; run the same command again"
    assert signal.getsignal(signal.SIGTERM) == handler  # the bench's own handler is gone with it


class HeldWeights:
    """Stands for what a failed run loaded: in a reference cycle, as a failure's frames and tracebacks hold it, and
    kept from the collector (`gc.freeze`) as the renderer's settle keeps what its stages loaded."""

    def __init__(self, held: list):
        self.cycle = self
        held.append(weakref.ref(self))
        gc.freeze()


def test_a_failed_batch_s_leftovers_are_freed_before_the_next_preset_loads(monkeypatch):
    """A baseline out of memory on a smaller GPU left its weights held by the failure's reference cycles, and the
    measured preset after it then failed for want of memory too: they are collected before the next batch runs."""
    from h3gen.bench import batch
    from h3gen.bench.sweep import BenchPlan
    from h3gen.plugins.manager import registry

    held, seen = [], []

    def time_batch(preset, registry, source, requests, out_dir, full_forwards, baseline, say):
        if baseline:
            HeldWeights(held)
            raise RuntimeError("CUDA out of memory")
        seen.append(held[0]() is None)
        return dict(preset=preset.name, baseline=False, stage="batch", clips=1)

    monkeypatch.setattr(batch, "time_batch", time_batch)
    plan = BenchPlan(presets=["tiny"], baseline="tiny", durations=[5.0], warmup=0)
    with collector_off():
        records = batch.run_batch(plan, registry(), None, "tiny", 1, say=lambda line: None)
    assert seen == [True]
    assert records[0]["notes"] == "failed: RuntimeError: CUDA out of memory" and records[1]["clips"] == 1


def test_a_failed_stage_bench_s_leftovers_are_freed_before_the_next_preset_loads(monkeypatch):
    from h3gen.bench import sweep
    from h3gen.plugins.manager import registry

    held, seen = [], []

    class StageBench:
        def __init__(self, *args):
            seen.append(all(ref() is None for ref in held))
            HeldWeights(held)

        def run(self):
            raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr(sweep, "StageBench", StageBench)
    plan = sweep.BenchPlan(presets=["tiny"], baseline="tiny", durations=[5.0])
    with collector_off():
        records = sweep.run_bench(plan, registry(), None, "tiny", say=lambda line: None)
    assert seen == [True, True] and all(r["notes"] == "failed: RuntimeError: CUDA out of memory" for r in records)
    # the failed run's rows are shaped as a measured one's: no GPU on the CPU, the duration rounded, its stage
    assert [(r["gpus"], r["duration_s"], r["stage"]) for r in records] == [(0, 5.1667, "e2e")] * 2
    one_stage = dataclasses.replace(plan, stages=("dit",))
    with collector_off():
        records = sweep.run_bench(one_stage, registry(), None, "tiny", say=lambda line: None)
    assert {r["stage"] for r in records} == {"dit"}


@contextlib.contextmanager
def collector_off():
    """Only an explicit collection frees a reference cycle meanwhile."""
    gc.disable()
    try:
        yield
    finally:
        gc.unfreeze()
        gc.enable()
