"""examples/plugin, installed as a user installs it: its stage is listed and wraps whatever decode the preset uses,
the `reference` one and the `fast` one handing its frames to the background mux, and every frame comes out gray."""

import re
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT, h3gen


@pytest.fixture(scope="module")
def plugin_env(tmp_path_factory):
    scratch = tmp_path_factory.mktemp("plugin")
    source = shutil.copytree(ROOT / "examples" / "plugin", scratch / "source")  # pip builds in the source tree
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target",
                    str(scratch / "site"), str(source)], check=True, capture_output=True)
    return {"PYTHONPATH": str(scratch / "site")}


def chroma_spread(path) -> int:
    """How far the clip's colour planes stray from neutral: 0 for gray frames."""
    import av
    import numpy as np

    spread = 0
    with av.open(str(path)) as container:
        for frame in container.decode(video=0):
            planes = frame.to_ndarray(format="yuv420p")
            spread = max(spread, int(np.abs(planes[frame.height:].astype(int) - 128).max()))
    return spread


def test_the_example_plugin_is_listed_with_its_module(plugin_env):
    listed = h3gen("plugins", env=plugin_env, check_code=0).stdout.splitlines()
    assert ["vae", "grayscale", "grayscale", "h3gen_grayscale.Grayscale"] in [line.split()[:4] for line in listed]
    presets = h3gen("presets", "list", env=plugin_env, check_code=0).stdout
    [line] = [line for line in presets.splitlines() if line.startswith("grayscale ")]
    assert line.endswith(" (from plugin 'grayscale')"), line
    assert not [line for line in presets.splitlines() if line.startswith("tiny ") and "from plugin" in line]


@pytest.mark.parametrize("args, wrapped", [(["--preset", "grayscale"], "reference"),
                                           (["--set", "vae.use=fast", "--set", "vae.use=grayscale"], "fast")])
def test_the_example_plugin_turns_the_wrapped_decode_gray(plugin_env, prompts_file, tmp_path, args, wrapped):
    out = tmp_path / "out"
    shown = h3gen("presets", "show", *args[1:2] if args[0] == "--preset" else ["tiny", *args], env=plugin_env,
                  check_code=0).stdout
    assert re.search(rf'^vae\.wraps\.use +=  *"{wrapped}"', shown, re.M), shown
    h3gen("render", prompts_file("a red fox\n"), "-o", out, *args, env=plugin_env, check_code=0)
    (clip,) = out.glob("*.mp4")
    assert chroma_spread(clip) == 0
    if wrapped == "reference":  # the same clip unwrapped has colour
        h3gen("render", prompts_file("a red fox\n"), "-o", tmp_path / "colour", check_code=0)
        assert chroma_spread(next((tmp_path / "colour").glob("*.mp4"))) > 10
