"""Property-based tests: whatever the prompts file or preset holds, the parsers answer with a result or an
H3genError (one line, exit 2), never a traceback."""

import json
import string
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from h3gen.errors import H3genError
from h3gen.plugins.manager import registry
from h3gen.config.preset import resolve
from h3gen.inputs.prompts import read_prompts

DEFAULTS = {"width": 32, "height": 32, "duration": 5.0}
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

json_scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20)
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=8)
field_names = st.sampled_from(["prompt", "id", "seed", "duration", "width", "height"]) | st.text(max_size=8)
json_lines = st.dictionaries(field_names, json_values, max_size=6).map(json.dumps)
plausible_lines = st.fixed_dictionaries({"prompt": st.text(max_size=20)}, optional={
    "id": st.text(max_size=12), "seed": st.integers(-5, 2**64), "duration": st.integers(0, 20) | st.floats(),
    "width": st.integers(-64, 8192), "height": st.sampled_from([0, 32, 100, 768, 1344, 4096])}).map(json.dumps)
prompt_lines = st.lists(plausible_lines | json_lines | st.text(max_size=40) | json_values.map(json.dumps),
                        max_size=6).map("\n".join)


def parses_or_refuses(parse, *args):
    try:
        return parse(*args)
    except H3genError as e:
        assert e.exit_code in (1, 2) and "\n" not in e.problem
        return None


@FUZZ
@given(raw=st.binary(max_size=200) | prompt_lines.map(str.encode))
def test_prompts_file_parser_never_crashes(raw):
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "prompts.txt"
        path.write_bytes(raw)
        requests = parses_or_refuses(read_prompts, path, 0, DEFAULTS)
    for request in requests or ():
        assert request.prompt.strip() and 5 * 24 <= request.frames <= 15 * 24
        assert request.width % 32 == 0 and request.height % 32 == 0
        assert request.id is None or "/" not in request.id and not request.id.startswith(".")


toml_keys = st.sampled_from(["use", "steps", "width", "dtype", "device", "version", "crf", "sigma_positions",
                             "video_shift", "layer", "duration", "request", "runtime", "sampler", "mux"]) | st.text(string.ascii_letters, min_size=1, max_size=6)
toml_values = st.sampled_from(['"euler"', '"none"', "1", "-3", "2.5", "true", "[1, 2]", "[0.5, \"x\"]", "{a = 1}",
                               '"cuda"', '"float32"', '"os:system"', "1979-05-27", '""', "[]", "nan", "inf"])
sections = st.sampled_from(["encode", "sampler", "vae", "quant", "mux", "request", "runtime", "bogus", "sampler.x"])
toml_lines = st.one_of(
    st.builds(lambda k, v: f"{k} = {v}", toml_keys, toml_values),
    sections.map(lambda s: f"[{s}]"),
    st.text(max_size=30),
)
tiny = (Path(__file__).resolve().parents[1] / "presets" / "tiny.toml").read_text()


@FUZZ
@given(lines=st.lists(toml_lines, max_size=10), keep=st.integers(0, 40), mixed=st.booleans())
def test_preset_resolve_never_crashes(lines, keep, mixed):
    text = ("\n".join(tiny.splitlines()[:keep]) + "\n" if mixed else "") + "\n".join(lines) + "\n"
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "fuzzed.toml"
        path.write_text(text)
        parses_or_refuses(resolve, str(path), registry())


overrides = st.builds(lambda s, k, v: f"{s}.{k}={v}", sections, toml_keys, toml_values | st.text(max_size=10))


@FUZZ
@given(sets=st.lists(overrides | st.text(max_size=20), max_size=4))
@example(sets=['encode.use="euler"', "encode.use=0\n0"])  # a stage name with a line break in it
def test_preset_overrides_never_crash(sets):
    parses_or_refuses(resolve, "tiny", registry(), sets)


def test_an_error_is_one_line_whatever_names_it_quotes():
    error = H3genError("unknown stage 'a\nb\u2028c'", "use x\ry")
    assert str(error).splitlines() == [str(error)] and "a\\nb" in error.problem and error.fix == "use x\\ry"
