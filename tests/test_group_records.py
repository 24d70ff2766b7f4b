"""A group of ranks renders each clip together, and its first rank alone reports: one manifest line per clip and
event and one `--json` record per clip, also for the clips the group passes or fails."""

import json

from conftest import h3gen

ENV = {"OMP_NUM_THREADS": "1"}
PROMPTS = ('{"id": "ok", "prompt": "a red fox in the snow"}\n'
           '{"id": "long", "prompt": "' + "waves " * 40 + '"}\n'
           '{"id": "held", "prompt": "a lighthouse at night"}\n')


def test_a_group_reports_each_clip_once_from_its_first_rank(prompts_file, tmp_path, tiny_model):
    from h3gen.run.outputs import ClipClaim

    out = tmp_path / "out"
    out.mkdir()
    claim = ClipClaim(out / "held.mp4")  # another run is rendering it: the group's first rank passes it
    assert claim.acquire()
    try:
        result = h3gen("render", prompts_file(PROMPTS), "-o", out, "--json", "--cpu-workers", 2, "--ulysses", 2,
                       "--set", "sampler.dit=h3gen", "--set", "encode.max_tokens=20", env=ENV)
    finally:
        claim.release()
    assert result.returncode == 1, result.stderr[-3000:]  # the long prompt failed
    assert "layout 1 group(s) x 2 CPU workers: Ulysses 2" in result.stderr
    lines = [json.loads(line) for line in (out / "manifest.jsonl").read_text().splitlines()]
    assert sorted((line["id"], line["status"]) for line in lines) == [("held", "busy"), ("long", "failed"),
                                                                      ("ok", "ok")]
    assert len({line["pid"] for line in lines}) == 1  # written by one rank
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert sorted((r["id"], r["ok"], r["status"]) for r in records) == [("held", True, "busy"),
                                                                        ("long", False, "failed"), ("ok", True, "ok")]
    assert sorted(p.name for p in out.glob("*.mp4")) == ["ok.mp4"]


def test_workers_with_a_sampler_that_cannot_split_render_whole_clips_and_say_why(prompts_file, tmp_path):
    result = h3gen("render", prompts_file("a fox\n"), "-o", tmp_path / "out", "--cpu-workers", 4,
                   "--preset", "diffusers", "--set", "model.needs=any", "--set", "request.width=32", "--set", "request.height=32",
                   "--set", "sampler.steps=3", env=ENV, check_code=0)
    assert ("h3gen: layout 4 group(s) x 1 CPU worker: data parallel, 1 clip(s) at a time, 3 group(s) idle with no "
            "clip to render (no Ulysses: the sampler stage 'diffusers' renders a clip on one rank)") in result.stderr
    assert len(list((tmp_path / "out").glob("*.mp4"))) == 1
    # As many clips as workers: whole clips in parallel all the same, so nothing to say
    result = h3gen("render", prompts_file("a fox\nrain\n"), "-o", tmp_path / "two", "--cpu-workers", 2,
                   "--preset", "diffusers", "--set", "model.needs=any", "--set", "request.width=32", "--set",
                   "request.height=32", "--set", "sampler.steps=3", env=ENV, check_code=0)
    assert "h3gen: layout 2 group(s) x 1 CPU worker: data parallel, 2 clip(s) at a time\n" in result.stderr
    again = h3gen("render", prompts_file("a fox\nrain\n"), "-o", tmp_path / "two", "--cpu-workers", 2,
                  "--preset", "diffusers", "--set", "model.needs=any", "--set", "request.width=32", "--set",
                  "request.height=32", "--set", "sampler.steps=3", env=ENV, check_code=0)
    assert "h3gen: layout" not in again.stderr and "2 already there and valid" in again.stderr  # nothing to lay out


def test_ulysses_with_a_sampler_that_cannot_split_is_refused_before_any_worker(prompts_file, tmp_path):
    result = h3gen("render", prompts_file("a fox\n"), "-o", tmp_path / "out", "--cpu-workers", 2, "--ulysses", 2,
                   "--set", "sampler.dit=diffusers", env=ENV, check_code=2)
    assert 'needs sampler.dit = "h3gen"' in result.stderr and "layout" not in result.stderr


def test_workers_import_the_installed_packages_not_folders_of_the_working_directory(prompts_file, tmp_path):
    """`python -m` puts the working directory first on sys.path: a folder there named as a package (torch/, a
    plugin's source tree) would shadow the installed one in the workers, and not in the command."""
    here = tmp_path / "here"
    (here / "torch").mkdir(parents=True)
    (here / "torch" / "__init__.py").write_text("raise ImportError('the working directory shadows torch')\n")
    result = h3gen("render", prompts_file("a fox\n"), "-o", tmp_path / "out", "--cpu-workers", 2, env=ENV, cwd=here)
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(list((tmp_path / "out").glob("*.mp4"))) == 1
