"""Plugins: an installed package's entry point registers a stage that a preset then uses."""

import json
import textwrap
from pathlib import Path

import pytest

from conftest import h3gen
from faulty import install

PLUGIN = '''
import dataclasses, json, os
from h3gen.plugins.hookspecs import hookimpl
from h3gen.stages.mux import PyAVMux, PyAVMuxConfig

print("sidecar imported")  # on stdout as the module loads, and again as it registers, as some plugins do

@dataclasses.dataclass
class SidecarConfig(PyAVMuxConfig):
    note: str = ""


class SidecarMux(PyAVMux):
    """Writes the MP4 as usual plus a JSON sidecar, so the test can see the plugin ran."""
    kind, name = "mux", "sidecar"
    Config = SidecarConfig

    def run(self, clip):
        clip = super().run(clip)
        clip.path.with_suffix(".json").write_text(json.dumps({"note": self.config.note}))
        if self.config.note == "loud":  # on stdout, from Python and straight to the descriptor as C code writes
            print("LOUD", clip.path.name, flush=True)
            os.write(1, b"RAW\\n")
        return clip


@hookimpl
def h3gen_register_stages(register):
    os.write(1, b"sidecar registered\\n")
    register(SidecarMux)
'''


def test_entry_point_plugin_stage_is_listed_and_used_from_a_preset(tmp_path, prompts_file):
    site = tmp_path / "site"
    env = install(site, "sidecar", PLUGIN)
    listed = h3gen("plugins", env=env, check_code=0).stdout
    assert any(line.split()[:3] == ["mux", "sidecar", "sidecar"] for line in listed.splitlines())
    assert any(line.split()[:3] == ["sampler", "euler", "h3gen"] for line in listed.splitlines())
    preset = tmp_path / "with-sidecar.toml"
    preset.write_text(textwrap.dedent("""\
        version = 1
        [request]
        width = 32
        height = 32
        [runtime]
        dtype = "float32"
        [encode]
        use = "qwen3vl"
        [sampler]
        use = "euler"
        steps = 3
        [vae]
        use = "reference"
        [quant]
        use = "none"
        [mux]
        use = "sidecar"
        note = "from the plugin"
        """))
    out = tmp_path / "out"
    h3gen("render", prompts_file('{"id": "c", "prompt": "x"}\n'), "-o", out, "--preset", preset, env=env,
          check_code=0)
    assert (out / "c.mp4").stat().st_size > 0
    assert (out / "c.json").read_text() == '{"note": "from the plugin"}'


@pytest.mark.parametrize("workers", [[], ["--cpu-workers", "2"]])
def test_a_plugin_that_prints_leaves_the_json_records_alone(tmp_path, prompts_file, workers):
    """stdout carries the records alone: a stage's own writes to it go to stderr, in one process or in workers."""
    site = tmp_path / "site"
    result = h3gen("render", prompts_file('{"id": "a", "prompt": "x"}\n{"id": "b", "prompt": "y"}\n'), "-o",
                   tmp_path / "out", "--set", "mux.use=sidecar", "--set", "mux.note=loud", "--json", *workers,
                   env=install(site, "sidecar", PLUGIN), check_code=0)
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert sorted(Path(r["path"]).name for r in records) == ["a.mp4", "b.mp4"] and all(r["ok"] for r in records)
    assert result.stderr.count("RAW") == 2 and "LOUD a.mp4" in result.stderr and "LOUD b.mp4" in result.stderr
    assert "sidecar imported" in result.stderr and "sidecar registered" in result.stderr


def test_what_a_plugin_prints_as_it_loads_stays_off_the_lists_on_stdout(tmp_path):
    """A plugin's own prints as it is imported and registers go to stderr: `presets list` and a completion stay
    what a script or the shell reads."""
    site = tmp_path / "site"
    env = install(site, "sidecar", PLUGIN)
    listed = h3gen("presets", "list", env=env, check_code=0)
    assert "sidecar" not in listed.stdout and "sidecar imported" in listed.stderr
    words = "h3gen render p.txt --preset ti"
    completed = h3gen(env={**env, "_H3GEN_COMPLETE": "complete_bash", "COMP_WORDS": words, "COMP_CWORD": "4"},
                      check_code=0)
    assert completed.stdout.split() == ["tiny"] and "sidecar imported" in completed.stderr


def test_load_plugins_variable_restricts_plugins(tmp_path):
    site = tmp_path / "site"
    env = {**install(site, "sidecar", PLUGIN), "H3GEN_LOAD_PLUGINS": "other"}
    assert "sidecar" not in h3gen("plugins", env=env, check_code=0).stdout


def test_broken_plugin_is_reported_and_skipped(tmp_path):
    site = tmp_path / "site"
    env = install(site, "sidecar", PLUGIN)
    (site / "h3gen_sidecar.py").write_text("raise ImportError('no such dependency')\n")
    result = h3gen("plugins", env=env, check_code=0)
    assert "plugin 'sidecar' failed to load: ImportError: no such dependency" in result.stderr
    assert "euler" in result.stdout


def test_the_built_in_stages_and_presets_register_without_pyav():
    """PyAV is needed where a clip is muxed: without it `bench --stages dit` and `presets show` still have h3gen's
    stages and presets."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['av'] = None\n"
            "from h3gen.plugins.manager import registry\n"
            "found = registry(); assert not found.failed, found.failed; assert 'h3-base' in found.presets\n"
            "assert ('mux', 'pyav') in found.stages")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
