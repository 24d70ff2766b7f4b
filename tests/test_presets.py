"""Presets: versioned TOML naming registered stages, overrides with --set, provenance of every value."""

import re
import shutil

import pytest

from conftest import h3gen
from h3gen.errors import UsageError
from h3gen.plugins.manager import registry
from h3gen.config.preset import resolve
from h3gen.stages.sampler import forwards


def write(tmp_path, text):
    path = tmp_path / "custom.toml"
    path.write_text(text)
    return str(path)


BASE = """version = 1
[encode]
use = "qwen3vl"
[sampler]
use = "euler"
steps = 6
[vae]
use = "reference"
[quant]
use = "none"
[mux]
use = "pyav"
"""


def test_shipped_presets_resolve_with_their_contracts():
    found = registry()
    assert {"tiny", "h3-base", "fasth3", "diffusers"} <= set(found.presets)
    base, fast = resolve("h3-base", found), resolve("fasth3", found)
    assert forwards(base.stages["sampler"][1]) == 49
    assert forwards(fast.stages["sampler"][1]) == 4
    assert fast.stages["sampler"][1].sigma_positions == [0.999, 0.749, 0.5, 0.25, 0.0]
    assert (base.stages["sampler"][1].video_shift, base.stages["sampler"][1].audio_shift) == (12.0, 3.0)


def test_set_overrides_and_records_where_values_came_from(tmp_path):
    path = write(tmp_path, BASE)
    preset = resolve(path, registry(), ["sampler.steps=9", "request.width=1024"])
    assert preset.stages["sampler"][1].steps == 9 and preset.request["width"] == 1024
    assert preset.sources["sampler.steps"] == "--set"
    assert preset.sources["sampler.video_shift"] == "default of sampler 'euler'"
    assert preset.sources["encode.use"] == f"preset {path}" and preset.name == "custom"
    assert preset.sources["cache.use"] == "default"  # an optional stage the preset leaves out


@pytest.mark.parametrize("text, overrides, message", [
    (BASE.replace("steps = 6", "stepz = 6"), [],
     "unknown key 'stepz'.*allowed keys: adaln_table, attention, audio_shift"),
    (BASE.replace('use = "euler"', 'use = "os:system"'), [], "unknown sampler stage 'os:system'"),
    (BASE.replace("steps = 6", 'steps = "six"'), [], "steps must be int"),
    (BASE.replace("version = 1", "version = 99"), [], "version 99"),
    (BASE.replace("version = 1\n", ""), [], r"has no version \(add version = 1 at its top\)"),
    (BASE + "[cluster]\nx = 1\n", [], "unknown section 'cluster'"),
    (BASE.replace("version = 1\n", "version = 1\nfoo = 1\n"), [],
     r"unknown top-level key 'foo' \(allowed: description, extends, version and the sections adapter, cache, "),
    (BASE.replace("version = 1\n", "version = 1\ndescription = 5\n"), [], r"description is int, not text \(write it "),
    (BASE + "[parallel]\nx = 1\n", [], r"unknown key 'x' in .*\[parallel\].*allowed keys: gpus, cpu_workers, ulysses"),
    (BASE.replace("[mux]\nuse = \"pyav\"\n", ""), [], r"\[mux\] needs use"),
    (BASE, ["sampler.steps"], "is not section.key=value"),
    (BASE, ["video.x=1"], "unknown section 'video'"),
    (BASE.replace("version = 1\n", 'version = 1\nextends = "nosuch"\n'), [],
     r"custom.toml: extends = 'nosuch': unknown preset 'nosuch' \(available: "),
    # A word TOML reads as a number or a bool, given for a string: said how to quote it.
    (BASE, ["runtime.dtype=1"], r"^--set runtime.dtype must be str, got 1 \(1 is read as a number; quote it: \"1\" "
                                r"in a preset, '\"1\"' on the command line\)"),
    (BASE, ["mux.x264_preset=nan"], r"^--set mux.x264_preset must be str, got nan \(nan is read as a number; quote "),
    (BASE, ["mux.x264_preset=true"], r"^--set mux.x264_preset must be str, got true \(true is read as a boolean; "),
    # A value a --set gave is blamed on the --set, not on the preset that never held it.
    (BASE, ["sampler.steps=abc"], r"^--set sampler.steps must be int, got 'abc' \(fix the value after the =\)"),
    (BASE, ["sampler.stepz=4"], r"^--set sampler.stepz: unknown key 'stepz' for sampler stage 'euler' \(allowed "),
    (BASE, ["runtime.devise=cpu"], r"^--set runtime.devise: unknown key 'devise' in preset custom \[runtime\]"),
    (BASE, ["vae.wraps.use=fast"], r"^--set vae.wraps.use: unknown key 'wraps' for vae stage 'reference'"),
    # The stage a --set picked, not the one the preset names, is the one without the key.
    (BASE, ["vae.use=fast", "vae.crf=3"], r"^--set vae.crf: unknown key 'crf' for vae stage 'fast' "),
    (BASE, ["vae.use=fast", "vae.tile_height=big"], r"^--set vae.tile_height must be int, got 'big'"),
    # A key given on the command line for the stage a later --set replaces would vanish without a word.
    (BASE, ["vae.tile_batch=4", "vae.use=fast"], r"^--set vae.tile_batch=4 is for the vae stage 'reference', which the "
                                                 r"later --set vae.use=fast replaces \(give --set vae.use=fast before "
                                                 r"it\)"),
    (BASE, ["sampler.steps=3", "sampler.use=bogus"], r"unknown sampler stage 'bogus'"),
    (BASE, ["sampler.dit=h3gen", "sampler.use=diffusers"], r"^--set sampler.dit=\"h3gen\" is for the sampler stage "
                                                           r"'euler', which the later --set sampler.use=diffusers "
                                                           r"replaces \(drop it: 'diffusers' takes no key 'dit'\)"),
    # A bool is said as TOML writes one: yes, 1 and "true" are not.
    (BASE, ["sampler.compile=yes"], r"^--set sampler.compile must be bool, got 'yes' \(write true or "
                                    r"false, lowercase and unquoted; fix the value after the =\)"),
    (BASE, ["vae.use=fast", "vae.exact=1"], r"^--set vae.exact must be bool, got 1 \(write true or false, lowercase "
                                            r"and unquoted; fix the value after the =\)"),
    # nan passes every comparison a check makes; a bool is no number, in a stage's section or the request's.
    (BASE, ["sampler.video_shift=nan"], r"^--set sampler.video_shift is nan, which is no number \(fix the value "),
    (BASE, ["adapter.scale=nan"], r"^--set adapter.scale is nan, which is no number"),
    (BASE + "[request]\nduration = nan\n", [], r"^preset custom \[request\] duration is nan, which is no number"),
    (BASE, ["request.width=true"], r"^--set request.width must be int, got true \(fix the value after the =\)"),
    (BASE + "[request]\nduration = true\n", [], r"^preset custom \[request\] duration must be float, got true"),
    (BASE, ['sampler.sigma_positions=[1.0, "a", 0.0]'], r"^--set sampler.sigma_positions must be a list of float, "
                                                       r"got the item 'a' \(fix the value after the =\)"),
    # The adapters' contract and multiplier: what no adapter was distilled for.
    (BASE, ["adapter.scale=inf"], r"^--set adapter.scale: scale inf is not a finite number \(give the adapters' "),
    (BASE, ["adapter.forwards=-3"], r"^--set adapter.forwards: forwards -3 is below 0"),
    (BASE, ["adapter.audio_shift=-1"], r"^--set adapter.audio_shift: audio_shift -1.0 is not a sigma shift"),
    (BASE.replace("steps = 6", "steps = 6 6"), [], "not valid TOML.*line 6"),
    # The defaults a prompt takes are checked as its own values are, and blamed on where they were set.
    (BASE, ["request.duration=4"], r"^--set request.duration=4: duration 4 s is outside H3's 5-15 s"),
    (BASE + "[request]\nwidth = 33\n", [], r"^preset custom \[request\] width, default \[request\] height: size "
                                           "33x768 is not made of multiples of 32"),
    (BASE, ["request.width=320000", "request.height=320000"], "^--set request.width=320000, --set "
                                                              "request.height=320000: size 320000x320000 at 124 "
                                                              "frames needs about"),
])
def test_bad_presets(tmp_path, text, overrides, message):
    path = write(tmp_path, text)  # errors name a preset file by its path
    with pytest.raises(UsageError, match=message.replace("preset custom", f"preset {re.escape(path)}")):
        resolve(path, registry(), overrides)


def test_unknown_preset_name_lists_the_available_ones():
    with pytest.raises(UsageError, match="available: diffusers, fasth3, fasth3-fp8, h3-base, h3-base-fast, "
                                         "h3-base-fast-fixed, h3-base-fp8, h3-exact, h3-reference, tiny, turbo-8"):
        resolve("nope", registry())


def test_an_unknown_name_with_a_preset_file_of_that_name_beside_it_says_to_pass_the_file(tmp_path, monkeypatch):
    (tmp_path / "mine.toml").write_text('version = 1\nextends = "tiny"\n')
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UsageError, match=r"^unknown preset 'mine' \(for the file, pass mine.toml\)$"):
        resolve("mine", registry())
    assert resolve("mine.toml", registry()).name == "mine"


def test_presets_cli_list_and_show():
    listed = h3gen("presets", "list", check_code=0).stdout
    assert "fasth3" in listed and "h3-base" in listed and "tiny" in listed
    assert h3gen("presets", check_code=0).stdout == listed  # alone, it lists them
    shown = h3gen("presets", "show", "fasth3", "--set", "mux.crf=20", check_code=0).stdout
    assert "sampler.sigma_positions" in shown and "# preset fasth3" in shown
    assert "mux.crf" in shown and "20" in shown and "# --set" in shown
    assert shown.splitlines()[0].endswith(" (with --set mux.crf=20)")  # the description was the preset's
    grid = "[0.99, 0.97, 0.95, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.0]"  # a long list stays on its line
    shown = h3gen("presets", "show", "tiny", "--set", f"sampler.sigma_positions={grid}", check_code=0).stdout
    [line] = [line for line in shown.splitlines() if line.startswith("sampler.sigma_positions")]
    assert line.split(" = ", 1)[1].startswith(f"{grid} ") and line.endswith("# --set")


def test_presets_show_credits_what_a_child_inherits_to_its_parent(tmp_path):
    child = tmp_path / "child.toml"
    child.write_text('extends = "tiny"\n[mux]\ncrf = 20\n')
    first, version = h3gen("presets", "show", child, check_code=0).stdout.splitlines()[:2]
    assert first.startswith("# child: Smoke test") and first.endswith(" (preset tiny's description)")
    assert version.split() == ["version", "=", "1", "#", "preset", "tiny"]


def test_a_preset_file_s_own_description_round_trips_through_toml(tmp_path):
    """Its own description is not credited to anyone: saved with --toml and shown again, it reads the same."""
    mine = tmp_path / "mine.toml"
    mine.write_text('version = 1\nextends = "tiny"\ndescription = "my tiny"\n')
    saved = h3gen("presets", "show", mine, "--toml", check_code=0).stdout
    assert 'description = "my tiny"\n' in saved
    (tmp_path / "round.toml").write_text(saved)
    assert h3gen("presets", "show", tmp_path / "round.toml", "--toml", check_code=0).stdout == saved


def test_a_bad_request_default_from_set_is_blamed_on_the_set_not_a_prompts_line(prompts_file, tmp_path):
    result = h3gen("render", prompts_file("a fox\n"), "-o", tmp_path / "out", "--set", "request.duration=4",
                   "--dry-run", check_code=2)
    assert result.stderr == ("h3gen: error: --set request.duration=4: duration 4 s is outside H3's 5-15 s (ask for 5 "
                             "to 15 seconds)\n")


def test_size_and_duration_set_the_request_defaults_a_line_of_its_own_overrides(prompts_file, tmp_path):
    import json

    prompts = prompts_file('a fox\n{"prompt": "b", "width": 64, "height": 32, "duration": 5}\n')

    def planned(*args):
        result = h3gen("render", prompts, "-o", tmp_path / "out", "--dry-run", "--json", *args, check_code=0)
        return [(r["width"], r["height"], r["frames"]) for r in map(json.loads, result.stdout.splitlines())]

    assert planned() == [(32, 32, 124), (64, 32, 124)]
    assert planned("--size", "96x64", "--duration", "6") == [(96, 64, 158), (64, 32, 124)]
    assert planned("--size", "96X64", "--set", "request.width=128") == [(128, 64, 124), (64, 32, 124)]  # --set last
    for args, line in [(["--size", "33x64"], "--size 33x64: size 33x64 is not made of multiples of 32 (use 32x64"),
                       (["--size", "64"], "cannot read --size '64' (WIDTHxHEIGHT: e.g. --size 1344x768)"),
                       (["--duration", "16.5"], "--duration 16.5: duration 16.5 s is outside H3's 5-15 s")]:
        result = h3gen("render", prompts, "-o", tmp_path / "out", *args, check_code=2)
        assert result.stderr.startswith(f"h3gen: error: {line}"), result.stderr
    assert not (tmp_path / "out").exists()


def test_presets_show_bad_value_exits_2():
    result = h3gen("presets", "show", "tiny", "--set", "sampler.nope=1")
    assert result.returncode == 2 and "unknown key 'nope'" in result.stderr
    for shown in (["--set", "sampler.steps=0"], ["--set", "mux.crf=99", "--toml"]):  # what render refuses, so does show
        result = h3gen("presets", "show", "tiny", *shown, check_code=2)
        assert result.stdout == "" and result.stderr.startswith("h3gen: error: ") and result.stderr.count("\n") == 1


def test_a_preset_runs_only_on_the_model_it_is_made_for(prompts_file, tiny_model, tmp_path):
    prompts, out = prompts_file("a fox\n"), tmp_path / "out"
    real = h3gen("render", prompts, "-o", out, "--preset", "h3-base", check_code=2)
    assert ("preset h3-base needs a MiniMax-H3 repository, and no --model was given, so the embedded tiny model "
            "stands in") in real.stderr
    assert "--set model.needs=any" in real.stderr and "loaded on" not in real.stderr
    # --model without --preset is h3-base: refused on the tiny model for the same reason
    picked = h3gen("render", prompts, "-o", out, "--model", tiny_model, check_code=2)
    assert f"preset h3-base needs a MiniMax-H3 repository, and {tiny_model} holds a tiny model" in picked.stderr
    looks_real = tmp_path / "model"
    shutil.copytree(tiny_model, looks_real)
    config = looks_real / "transformer" / "config.json"
    config.write_text(config.read_text().replace('"hidden_size": 64', '"hidden_size": 5120'))
    tiny = h3gen("render", prompts, "-o", out, "--model", looks_real, "--preset", "tiny", check_code=2)
    assert f"preset tiny is made for the tiny smoke-test model, and {looks_real} is a MiniMax-H3" in tiny.stderr
    assert "loaded on" not in tiny.stderr and not out.exists() or not list(out.glob("*.mp4"))
    assert "h3-base with --model" in " ".join(h3gen("render", "--help", check_code=0).stdout.split())
