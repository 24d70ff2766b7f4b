"""Presets that build on another (`extends`), wrapping stages filled with the stage a preset would have used, and
`presets show --toml`, which prints what resolves back to the same values."""

import re
import textwrap

import pytest

from conftest import h3gen


def resolved(preset, overrides=()):
    from h3gen.config.preset import describe, resolve
    from h3gen.plugins.manager import registry

    return {key: value for key, value, _ in describe(resolve(str(preset), registry(), list(overrides)))}


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def test_a_preset_that_extends_another_says_only_what_changes(tmp_path):
    child = write(tmp_path, "short.toml", """\
        extends = "h3-base"
        description = "h3-base at 8 forwards"
        [sampler]
        steps = 9
        [request]
        duration = 10.0
        """)
    base, values = resolved("h3-base"), resolved(child)
    assert values["sampler.steps"] == 9 and values["request.duration"] == 10.0
    assert {k: v for k, v in values.items() if k not in ("sampler.steps", "request.duration")} == \
           {k: v for k, v in base.items() if k not in ("sampler.steps", "request.duration")}
    grandchild = write(tmp_path, "shorter.toml", 'extends = "short.toml"\n[sampler]\nsteps = 5\n')
    assert resolved(grandchild)["sampler.steps"] == 5 and resolved(grandchild)["request.duration"] == 10.0


def test_naming_another_stage_drops_the_keys_of_the_one_it_replaces(tmp_path):
    child = write(tmp_path, "ref.toml", 'extends = "h3-base-fp8"\n[quant]\nuse = "none"\n')
    values = resolved(child)
    assert values["quant.use"] == "none" and not [k for k in values if k.startswith("quant.") and k != "quant.use"]
    assert resolved("h3-base-fp8", ["quant.use=none"]) == values


@pytest.mark.parametrize("text, message", [
    ('extends = "no-such-preset"\n', "unknown preset 'no-such-preset'"),
    ('extends = "loop.toml"\n', "preset {dir}/loop.toml extends itself ({dir}/loop.toml -> {dir}/loop.toml)"),
    ("extends = 3\n", "extends must be a preset name or file, got 3"),
])
def test_unknown_bases_and_cycles_are_refused_in_one_line(tmp_path, prompts_file, text, message):
    preset = write(tmp_path, "loop.toml", text)
    result = h3gen("presets", "show", preset, check_code=2)
    assert result.stderr.count("\n") == 1 and message.format(dir=tmp_path) in result.stderr


def test_a_cycle_is_named_from_its_first_preset_by_the_files_to_fix(tmp_path):
    from h3gen.config.preset import resolve
    from h3gen.errors import UsageError
    from h3gen.plugins.manager import registry

    write(tmp_path, "a.toml", 'extends = "b.toml"\n')
    write(tmp_path, "b.toml", 'extends = "c.toml"\n')
    write(tmp_path, "c.toml", 'extends = "b.toml"\n')
    b, c = tmp_path / "b.toml", tmp_path / "c.toml"
    with pytest.raises(UsageError, match=re.escape(f"preset {b} is in a cycle of extends ({b} -> {c} -> {b})")):
        resolve(str(tmp_path / "a.toml"), registry())


def test_a_bad_value_is_blamed_on_the_preset_that_set_it(tmp_path):
    from h3gen.config.preset import resolve
    from h3gen.errors import UsageError
    from h3gen.plugins.manager import registry

    write(tmp_path, "parent.toml", 'extends = "tiny"\n[runtime]\ndevice = "tpu"\n[parallel]\nulysses = -1\n')
    child = write(tmp_path, "child.toml", 'extends = "parent.toml"\n[sampler]\nsteps = 5\n')
    parent = re.escape(str(tmp_path / "parent.toml"))  # named by its path, from the folder of the one extending it
    with pytest.raises(UsageError, match=rf"^preset {parent} \[runtime\] device 'tpu' is not a device"):
        resolve(str(child), registry())
    with pytest.raises(UsageError, match=r"^--set runtime.vram_gib=-1 is no budget"):
        resolve(str(child), registry(), ["runtime.device=cpu", "runtime.vram_gib=-1"])
    with pytest.raises(UsageError, match=rf"^preset {parent} \[parallel\] ulysses -1: give a whole number"):
        resolve(str(child), registry(), ["runtime.device=cpu"])
    with pytest.raises(UsageError, match=r"^--set request.width=10000000, --set request.height=10000000: "):
        resolve("tiny", registry(), ["request.width=10000000", "request.height=10000000"])


def test_a_file_named_after_the_builtin_it_extends_is_named_by_its_file(tmp_path):
    """`presets show` and errors tell a file tiny.toml that extends tiny from the built-in tiny by its path."""
    child = write(tmp_path, "tiny.toml", 'extends = "tiny"\n[sampler]\nsteps = 2\n[runtime]\ndevice = "tpu"\n')
    failed = h3gen("presets", "show", child, check_code=2)
    assert failed.stderr == f"h3gen: error: preset {child} [runtime] device 'tpu' is not a device h3gen runs on " \
                            "(use auto, cpu, cuda or cuda:N)\n", failed.stderr
    shown = h3gen("presets", "show", child, "--set", "runtime.device=cpu", check_code=0).stdout.splitlines()
    source = {line.split()[0]: line.split("# ", 1)[1] for line in shown if " = " in line}
    assert source["sampler.steps"] == f"preset {child}" and source["sampler.use"] == "preset tiny"
    assert source["runtime.device"] == "--set"


def with_tint():
    """The registry with a vae stage 'tint' that wraps another decode and takes one key of its own, strength."""
    from h3gen.plugins.manager import Registered, registry
    from h3gen.stages.base import Wrapped
    from h3gen.stages.vae import FrameFilter
    import dataclasses

    @dataclasses.dataclass
    class TintConfig:
        strength: float = 1.0
        wraps: Wrapped = dataclasses.field(default_factory=Wrapped)

    class Tint(FrameFilter):
        name, Config = "tint", TintConfig

    found = registry()
    found.stages[("vae", "tint")] = Registered("vae", "tint", Tint, "test")
    return found


def test_a_wrapping_stage_wraps_the_stage_the_preset_would_have_used(tmp_path):
    from h3gen.config.preset import resolve

    found = with_tint()
    preset = resolve("h3-base", found, ["vae.use=tint", "vae.wraps.tile_batch=3"])
    name, config = preset.stages["vae"]
    assert name == "tint" and config.wraps.name == "fast" and config.wraps.config.tile_batch == 3
    assert found.stage("vae", "tint").refuses_split(config) == "the vae stage 'fast' renders a clip on one rank"
    explicit = write(tmp_path, "tinted.toml", 'extends = "tiny"\n[vae]\nuse = "tint"\n[vae.wraps]\nuse = "fast"\n')
    assert resolve(str(explicit), found).stages["vae"][1].wraps.name == "fast"


def test_an_unknown_key_on_a_wrapping_stage_says_where_it_was_set_and_which_stage_takes_it(tmp_path):
    """A typo gets the wrapper's own keys, as any stage's; a key of the stage it wraps, where to set it instead."""
    from h3gen.config.preset import resolve
    from h3gen.errors import UsageError

    found = with_tint()
    with pytest.raises(UsageError) as typo:
        resolve("h3-base", found, ["vae.use=tint", "vae.strenght=2"])
    assert str(typo.value) == "--set vae.strenght: unknown key 'strenght' for vae stage 'tint' (allowed keys: " \
                              "strength, wraps)", str(typo.value)
    with pytest.raises(UsageError) as theirs:
        resolve("h3-base", found, ["vae.use=tint", "vae.tile_batch=2"])
    assert str(theirs.value) == "--set vae.tile_batch: unknown key 'tile_batch' for vae stage 'tint', which wraps " \
                                "'fast', which takes it (set it under [vae.wraps], or --set " \
                                "vae.wraps.tile_batch=...)", str(theirs.value)
    tinted = write(tmp_path, "tinted.toml", 'extends = "tiny"\n[vae]\nuse = "tint"\ntile_batch = 2\n'
                                            '[vae.wraps]\nuse = "fast"\n')
    with pytest.raises(UsageError, match=rf"^unknown key 'tile_batch' in preset {re.escape(str(tinted))} \[vae\]: "
                                         r"vae stage 'tint' wraps 'fast', which takes it \(set it under"):
        resolve(str(tinted), found)


def test_presets_show_toml_resolves_back_to_every_builtin_preset(tmp_path):
    from h3gen.config.preset import as_toml, resolve
    from h3gen.plugins.manager import registry

    found = registry()
    for name in found.presets:
        copy = tmp_path / f"{name}.toml"
        copy.write_text(as_toml(resolve(name, found)))
        assert resolved(copy) == resolved(name), name
    printed = h3gen("presets", "show", "fasth3-fp8", "--toml", check_code=0).stdout
    (tmp_path / "printed.toml").write_text(printed)
    assert resolved(tmp_path / "printed.toml") == resolved("fasth3-fp8")
    # saved with --set values, they are the new preset's own: its description says what it was made from
    changed = h3gen("presets", "show", "fasth3-fp8", "--set", "mux.crf=20", "--toml", check_code=0).stdout
    assert '(fasth3-fp8 with mux.crf=20)"' in changed.splitlines()[1] and "--set" not in changed.splitlines()[1]


@pytest.mark.parametrize("base, message", [
    ("[sampler]\nstepz = 3\n", "unknown key 'stepz' in preset {dir}/base.toml [sampler] "),
    ('[sampler]\nsteps = "three"\n', "preset {dir}/base.toml [sampler].steps must be int, got 'three' "),
    ("[samplr]\nsteps = 3\n", "preset {dir}/base.toml: unknown section 'samplr' "),
    ("[request]\nwdth = 3\n", "unknown key 'wdth' in preset {dir}/base.toml [request] "),
    ('[runtime]\ndevice = 3\n', "preset {dir}/base.toml [runtime] device must be str, got 3 "),
    ('[vae]\nuse = "fast"\ntile_width = 100\n', "preset {dir}/base.toml [vae]: vae tile 256x100 with overlap 64 is not "
                                                  "a tiling "),
])
def test_a_mistake_in_an_extended_preset_names_the_file_that_holds_it(tmp_path, base, message):
    """The preset asked for is fine; the one it extends is not: the error sends the user to that file."""
    write(tmp_path, "base.toml", 'extends = "tiny"\n' + base)
    child = write(tmp_path, "child.toml", 'extends = "base.toml"\n[mux]\nuse = "pyav"\n')
    result = h3gen("presets", "show", child, check_code=2)
    assert result.stderr.startswith(f"h3gen: error: {message.format(dir=tmp_path)}"), result.stderr
    assert "child.toml" not in result.stderr
