"""Broken plugins: one that fails to import or raises while registering is reported and skipped whole, or stops
the run under --strict-plugins (H3GEN_STRICT_PLUGINS=1); H3GEN_LOAD_PLUGINS keeps the others from being imported."""

import re

import pytest

from conftest import ROOT, h3gen
from faulty import install

SKIPPED = "(skipped; fix or uninstall it (pip uninstall h3gen-{}), leave it out with H3GEN_LOAD_PLUGINS)"

RAISES = '''
from h3gen.plugins.hookspecs import hookimpl
from h3gen.stages.sampler import EulerSampler


class Half(EulerSampler):
    kind, name = "sampler", "half"


@hookimpl
def h3gen_register_stages(register):
    register(Half)
    raise RuntimeError("boom while registering")
'''

NOT_A_STAGE = '''
from h3gen.plugins.hookspecs import hookimpl


@hookimpl
def h3gen_register_stages(register):
    register(print)
'''

SHADOWS_A_BUILTIN = '''
from h3gen.plugins.hookspecs import hookimpl
from h3gen.stages.sampler import EulerSampler


class Impostor(EulerSampler):
    name = "euler"


@hookimpl
def h3gen_register_stages(register):
    register(Impostor)
'''

IMPORT_FAILS = "raise ImportError('no module named cuda_magic')\n"


@pytest.fixture
def site(tmp_path):
    env = {}
    for name, source in (("raises", RAISES), ("notastage", NOT_A_STAGE), ("shadow", SHADOWS_A_BUILTIN),
                         ("importfails", IMPORT_FAILS)):
        env = install(tmp_path / "site", name, source)
    return env


def test_failing_plugins_are_reported_and_skipped_whole(site):
    result = h3gen("plugins", env=site, check_code=0)
    for line in ("h3gen: plugin 'raises' failed during registration: RuntimeError: boom while registering "
                 f"{SKIPPED.format('raises')}",
                 "h3gen: plugin 'notastage' failed during registration: register() takes a Stage subclass, not "
                 f"<built-in function print> {SKIPPED.format('notastage')}",
                 "h3gen: plugin 'shadow' failed during registration: sampler stage 'euler' is already registered by "
                 f"h3gen (built-in) {SKIPPED.format('shadow')}",
                 "h3gen: plugin 'importfails' failed to load: ImportError: no module named cuda_magic "
                 f"{SKIPPED.format('importfails')}"):
        assert line in result.stderr.splitlines(), result.stderr
    stages = [line.split()[:3] for line in result.stdout.splitlines()]
    assert ["sampler", "euler", "h3gen"] in stages
    assert not [s for s in stages if s[1] == "half"]  # registered before the plugin raised: dropped with it
    assert [s for s in stages if s[1] == "euler"] == [["sampler", "euler", "h3gen"]]


def test_render_goes_on_without_the_broken_plugins(site, prompts_file, tmp_path):
    result = h3gen("render", prompts_file("x\n"), "-o", tmp_path / "out", env=site, check_code=0)
    assert ("h3gen: plugin 'raises' failed during registration: RuntimeError: boom while registering "
            f"{SKIPPED.format('raises')}") in result.stderr
    assert "1 of 1 clips written" in result.stderr


@pytest.mark.parametrize("command", [["presets", "show", "tiny"],
                                     ["bench", "--preset", "tiny", "--baseline", "none", "--random-weights", "tiny",
                                      "--durations", "5", "--size", "32x32", "--repeat", "1", "--stages", "encode"]])
def test_presets_show_and_bench_report_failed_plugins_as_the_others_do(site, command, tmp_path):
    where = ["-o", tmp_path] if command[0] == "bench" else ["--toml"]
    result = h3gen(*command, *where, env=site, check_code=0)
    assert ("h3gen: plugin 'importfails' failed to load: ImportError: no module named cuda_magic "
            f"{SKIPPED.format('importfails')}") in result.stderr
    strict = h3gen(*command, env={**site, "H3GEN_STRICT_PLUGINS": "1"}, check_code=2)
    assert strict.stdout == "" and strict.stderr.count("\n") == 1 and "failed" in strict.stderr
    # The one line names every plugin that failed, the first with its reason.
    assert "failed too (h3gen plugins says why)" in strict.stderr and "'notastage'" in strict.stderr


def test_a_preset_not_found_names_the_plugins_that_failed(site, prompts_file, tmp_path):
    """The preset may be the broken plugin's: the one line says so, as an unknown stage's does."""
    result = h3gen("render", prompts_file("x\n"), "-o", tmp_path / "out", "--preset", "invert", env=site,
                   check_code=2)
    (line,) = result.stderr.splitlines()
    assert line.startswith("h3gen: error: unknown preset 'invert' (available: ")
    assert "; plugin 'importfails' failed to load: ImportError: no module named cuda_magic" in line


def test_strict_plugins_names_the_broken_plugin_before_a_preset_it_may_have_registered(site, prompts_file, tmp_path):
    result = h3gen("render", prompts_file("x\n"), "-o", tmp_path / "out", "--preset", "invert", "--strict-plugins",
                   env={**site, "H3GEN_LOAD_PLUGINS": "importfails"}, check_code=2)
    assert result.stderr.startswith("h3gen: error: plugin 'importfails' failed to load: ImportError: no module named cuda_magic ("),\
        result.stderr
    assert "unknown preset" not in result.stderr and not (tmp_path / "out").exists()


@pytest.mark.parametrize("strict", [["--strict-plugins"], []])
def test_strict_plugins_stops_the_run(site, prompts_file, tmp_path, strict):
    env = {**site, "H3GEN_LOAD_PLUGINS": "importfails"} if strict else {**site, "H3GEN_STRICT_PLUGINS": "1",
                                                                        "H3GEN_LOAD_PLUGINS": "raises"}
    result = h3gen("render", prompts_file("x\n"), "-o", tmp_path / "out", *strict, env=env)
    assert result.returncode == 2 and result.stderr.strip().count("\n") == 0, result.stderr
    broken, package = (("plugin 'importfails' failed to load: ImportError: no module named cuda_magic", "h3gen-importfails")
                       if strict else ("plugin 'raises' failed during registration: RuntimeError: boom while "
                                       "registering", "h3gen-raises"))
    # The package pip knows it by, which is not the plugin's entry-point name.
    assert result.stderr.startswith(f"h3gen: error: {broken} (fix or uninstall it (pip uninstall {package}), leave "
                                    "it out with "
                                    "H3GEN_LOAD_PLUGINS, or run without --strict-plugins and H3GEN_STRICT_PLUGINS)")
    assert not list((tmp_path / "out").glob("*.mp4"))


def test_load_plugins_variable_keeps_the_others_from_being_imported(site):
    result = h3gen("plugins", env={**site, "H3GEN_LOAD_PLUGINS": "notastage"}, check_code=0)
    assert "'notastage' failed during registration" in result.stderr
    assert "importfails" not in result.stderr and "raises" not in result.stderr  # never imported


def test_load_plugins_none_imports_no_plugin_and_says_what_it_left_out(site, prompts_file, tmp_path):
    listed = h3gen("plugins", env={**site, "H3GEN_LOAD_PLUGINS": "none"}, check_code=0)
    assert "failed" not in listed.stderr and {line.split()[2] for line in listed.stdout.splitlines()} == {"h3gen"}
    result = h3gen("render", prompts_file("x\n"), "-o", tmp_path / "out", "--set", "vae.use=raises",
                   env={**site, "H3GEN_LOAD_PLUGINS": "none"}, check_code=2)
    left_out = re.search(r"H3GEN_LOAD_PLUGINS=none leaves out the installed plugin\(s\) ((?:'[\w-]+'(?:, )?)+)",
                         result.stderr)
    # plugins installed in the environment beside the test's own are left out too, and named in the same list
    assert left_out and {"importfails", "notastage", "raises", "shadow"} <= set(re.findall(r"'([\w-]+)'",
                                                                                          left_out.group(1)))


def test_an_empty_load_plugins_variable_loads_every_plugin_as_unset_does(site):
    unset = h3gen("plugins", env={**site, "H3GEN_LOAD_PLUGINS": None}, check_code=0)
    empty = h3gen("plugins", env={**site, "H3GEN_LOAD_PLUGINS": ""}, check_code=0)
    assert "'importfails' failed to load" in empty.stderr and (empty.stdout, empty.stderr) == (unset.stdout,
                                                                                                unset.stderr)


@pytest.mark.parametrize("command", [["plugins"], ["presets", "list"]])
@pytest.mark.parametrize("strict", [{"H3GEN_STRICT_PLUGINS": "1"}, {}])
def test_strict_plugins_stops_the_listings_too(site, command, strict):
    result = h3gen(*command, *([] if strict else ["--strict-plugins"]),
                   env={**site, **strict, "H3GEN_LOAD_PLUGINS": "raises"}, check_code=2)
    assert result.stderr == ("h3gen: error: plugin 'raises' failed during registration: RuntimeError: boom while "
                             "registering (fix or uninstall it (pip uninstall h3gen-raises), leave it out with "
                             "H3GEN_LOAD_PLUGINS, or "
                             "run without --strict-plugins and H3GEN_STRICT_PLUGINS)\n")
    assert result.stdout == ""


@pytest.mark.parametrize("command", [["plugins"], ["render", "PROMPTS", "--dry-run"]])
def test_a_strict_plugins_variable_it_cannot_read_is_one_line(prompts_file, tmp_path, command):
    args = [str(prompts_file("x\n")) if arg == "PROMPTS" else arg for arg in command]
    result = h3gen(*args, env={"H3GEN_STRICT_PLUGINS": "maybe"}, check_code=2, cwd=tmp_path)
    assert result.stderr == ("h3gen: error: H3GEN_STRICT_PLUGINS is 'maybe', not a yes or a no (set it to 1 (or true, "
                             "yes, on) or 0 (or false, no, off), or unset it)\n")


def test_preset_using_a_stage_of_a_broken_plugin_says_why(site, prompts_file, tmp_path):
    preset = tmp_path / "uses-half.toml"
    preset.write_text((ROOT / "presets" / "tiny.toml").read_text().replace('use = "euler"', 'use = "half"'))
    result = h3gen("render", prompts_file("x\n"), "-o", tmp_path / "out", "--preset", preset,
                   env={**site, "H3GEN_LOAD_PLUGINS": "raises"})
    assert result.returncode == 2
    assert "unknown sampler stage 'half' (registered sampler stages: " in result.stderr
    assert "euler; plugin 'raises' failed during registration: RuntimeError: boom while registering" in result.stderr


PRESETS = '''
from pathlib import Path
from h3gen.plugins.hookspecs import hookimpl


@hookimpl
def h3gen_register_presets(register):
    here = Path(__file__).parent
    if "{name}" == "broken":
        (here / "broken.toml").write_text("version = [")
    register(here / "{name}.toml")
'''


def test_a_registered_preset_that_is_missing_or_unreadable_is_named(tmp_path, prompts_file):
    """A preset file the package did not ship fails its plugin's registration, as the docs say; one that is there
    but not TOML is listed as unusable beside the others."""
    for name in ("missing", "broken"):
        site = install(tmp_path / "site", name, PRESETS.replace("{name}", name))
    listed = h3gen("presets", "list", env=site, check_code=0)
    assert (f"h3gen: plugin 'missing' failed during registration: registered preset {tmp_path}/site/missing.toml is "
            "not a file (a preset in a package ships as its package data: list it under [tool.setuptools.package-data] in "
            f"pyproject.toml) {SKIPPED.format('missing')}") in listed.stderr.splitlines()
    [broken] = [line for line in listed.stdout.splitlines() if line.startswith("broken ")]
    assert "(unusable: preset " in broken and "is not valid TOML" in broken
    assert "h3-base " in listed.stdout
    strict = h3gen("render", prompts_file("x\n"), "-o", tmp_path / "out", "--strict-plugins",
                   env={**site, "H3GEN_LOAD_PLUGINS": "missing"}, check_code=2)
    assert strict.stderr.startswith("h3gen: error: plugin 'missing' failed during registration: registered preset ")
