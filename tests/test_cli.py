"""The command itself: fast help, a current man page, the tiny command."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, child_env, h3gen
from h3gen.run.validate import validate_clip


def test_help_does_not_import_torch():
    code = ("import sys; from typer.testing import CliRunner; from h3gen.cli.main import app; "
            "r = CliRunner().invoke(app, ['render', '--help']); assert r.exit_code == 0, r.output; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_man_page_is_current_and_renders():
    from h3gen.cli.manpage import page

    committed = (ROOT / "man" / "h3gen.1").read_text()
    assert committed == page(), "man/h3gen.1 is stale: run `make man`"
    shown = subprocess.run(["man", "-l", str(ROOT / "man" / "h3gen.1")], capture_output=True, text=True,
                           env={"MANWIDTH": "80", "MANPAGER": "cat", "PAGER": "cat", "PATH": "/usr/bin:/bin"})
    assert shown.returncode == 0, shown.stderr
    assert "h3gen render" in shown.stdout and all(f"\n{title}\n" in shown.stdout for title in SECTIONS)


SECTIONS = ("NAME", "SYNOPSIS", "DESCRIPTION", "OPTIONS", "COMMANDS", "PROMPTS FILE", "PRESET KEYS", "PLUGINS",
            "ENVIRONMENT", "FILES", "JSON RECORDS", "EXIT STATUS", "EXAMPLES", "SEE ALSO")


def man_section(page: str, heading: str) -> str:
    """The lines under `heading` (".SH TITLE" or ".SS TITLE"), up to the next heading of its level or above."""
    start = page.index(f"{heading}\n") + len(heading) + 1
    ends = (".SH ",) if heading.startswith(".SH") else (".SH ", ".SS ")
    found = [page.find(f"\n{end}", start) for end in ends]
    return page[start:min([i for i in found if i >= 0], default=len(page))]


def test_man_page_has_the_reference_sections_and_every_preset_key():
    """Each built-in stage's Config fields, each section's keys and each prompts-file field are in the page: none
    can be added without it."""
    import dataclasses

    from h3gen.cli.manpage import argument, page
    from h3gen.config.contract import AdapterConfig
    from h3gen.config.preset import MODEL_DEFAULTS, PARALLEL_DEFAULTS, REQUEST_DEFAULTS, RUNTIME_DEFAULTS
    from h3gen.inputs.prompts import FIELDS
    from h3gen.plugins.manager import registry
    from h3gen.stages.base import BUILTIN

    text = page()
    assert [line[4:] for line in text.splitlines() if line.startswith(".SH ")] == list(SECTIONS)
    keys = man_section(text, ".SH PRESET KEYS")
    tables = [(f"[{name}]", list(defaults)) for name, defaults in (
        ("request", REQUEST_DEFAULTS), ("runtime", RUNTIME_DEFAULTS), ("parallel", PARALLEL_DEFAULTS),
        ("model", MODEL_DEFAULTS))] + [("[adapter]", [f.name for f in dataclasses.fields(AdapterConfig)])]
    stages = [entry for entry in registry().stages.values() if entry.origin == BUILTIN]
    assert len(stages) >= 14
    tables += [(f'[{entry.kind}] use = "{entry.name}"', [f.name for f in dataclasses.fields(entry.stage.Config)])
               for entry in stages]
    for title, fields in tables:
        section = man_section(keys, ".SS " + argument(title))
        for field in fields:
            assert f"\n.B {argument(field)} = " in f"\n{section}", (title, field)
        if not fields:
            assert "No other keys." in section, title
    prompts = man_section(text, ".SH PROMPTS FILE")
    terms = {name for line in prompts.splitlines() if line.startswith(".B ") for name in line[3:].split(", ")}
    assert set(FIELDS) <= terms


def test_man_page_names_every_field_of_a_clip_s_record():
    from h3gen.cli.manpage import page
    from h3gen.inputs.request import Request
    from h3gen.run.records import ClipResult, clip_record

    request = Request(index=0, prompt="p", seed=1, width=32, height=32, frames=124)
    fields = clip_record(ClipResult(request, Path("out/a.mp4"), True, {}, 0.0), "tiny")
    named = {name.strip() for line in man_section(page(), ".SH JSON RECORDS").splitlines()
             if line.startswith(".B ") for name in line[3:].replace("\\-", "-").split(",")}
    assert named == set(fields)


def test_man_page_names_every_exit_status_and_environment_variable_the_code_has():
    import re
    import signal

    from h3gen.cli.manpage import page
    from h3gen.errors import ClipError, ModelError, UsageError, WriteError
    from h3gen.run.loop import STOP_SIGNALS, Interrupted
    from h3gen.stages.base import StageFailed

    text = page()
    codes = {code for line in man_section(text, ".SH EXIT STATUS").splitlines() if line.startswith(".B ")
             for code in line[3:].split(", ")}
    stops = {str(Interrupted(signum).exit_code) for signum in (*STOP_SIGNALS, signal.SIGPIPE)}
    assert codes == {"0", *(str(e.exit_code) for e in (ClipError, ModelError, UsageError, WriteError, StageFailed)),
                     *stops}
    documented = {line[3:] for line in man_section(text, ".SH ENVIRONMENT").splitlines() if line.startswith(".B ")}
    read = set()
    for path in ROOT.rglob("*.py"):
        if not {".venv", "tests", "examples"} & set(path.relative_to(ROOT).parts):
            read |= set(re.findall(r"""(?:environ(?:\.get|\.setdefault)?[(\[]|getenv\(|envvar=)\s*["']([A-Z0-9_]+)""",
                                   path.read_text()))
    set_by_others = {"GROUP_RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",  # torchrun, for each worker
                     "MASTER_PORT",
                     "TORCHELASTIC_ERROR_FILE",  # torchrun too
                     "COMP_LINE", "COMP_POINT", "COMP_WORDBREAKS",  # bash, to the completion script
                     "TRITON_INTERPRET",  # Triton's interpreter, which the kernels' tests run
                     "OUT"}  # the folder the GPU check scripts in bench/ write to
    assert {"H3GEN_MODEL", "H3GEN_DEBUG", "OMP_NUM_THREADS"} <= read
    assert read - set_by_others <= documented, read - set_by_others - documented
    assert "XDG_CACHE_HOME" in documented


def test_man_page_is_the_same_on_every_machine_and_its_examples_parse():
    """No path of the machine that wrote it (the cache directory is written as $XDG_CACHE_HOME/h3gen), and every
    example is a command line h3gen takes."""
    import os
    import shlex
    from pathlib import Path

    from platformdirs import user_cache_dir
    from typer.main import get_command

    from h3gen.cli.main import app
    from h3gen.cli.manpage import page
    from h3gen.cli.reference import EXAMPLES

    text = page()
    for local in (user_cache_dir("h3gen"), os.environ["XDG_CACHE_HOME"], str(Path.home()), str(ROOT)):
        assert local not in text.replace("\\-", "-"), local
    assert "$XDG_CACHE_HOME/h3gen/embeddings/" in text.replace("\\-", "-")
    root = get_command(app)
    for example in EXAMPLES:
        words = shlex.split(example.command)
        assert words[0] == "h3gen"
        command, path, args = root, ["h3gen"], words[1:]
        while hasattr(command, "commands") and args and args[0] in command.commands:
            path.append(args[0])
            command = command.commands[args.pop(0)]
        if command is root:  # h3gen's own options act as they parse: only checked to be there
            assert args[0] in {opt for param in root.params for opt in param.opts}, example
        else:
            command.make_context(" ".join(path), args)  # raises on an option or argument it does not take


def test_tiny_writes_the_model_where_asked(tmp_path):
    result = h3gen("tiny", tmp_path / "tiny", check_code=0)
    assert result.stdout.strip() == str(tmp_path / "tiny")
    assert (tmp_path / "tiny" / "transformer" / "config.json").is_file()
    assert "smoke-test model" in result.stderr


def test_runs_that_start_together_write_the_tiny_model_once(tmp_path, monkeypatch):
    """Two runs finding no tiny model write it one after the other: the second waits for the first's lock and uses
    its copy (writing its own over it took the files from under the first run's loading)."""
    import threading

    from h3gen.models import tiny

    writes, real_write = [], tiny.write_into

    def counted(target):
        writes.append(target)
        real_write(target)

    monkeypatch.setattr(tiny, "write_into", counted)
    target = tmp_path / "cache" / "tiny"
    found = []
    runs = [threading.Thread(target=lambda: found.append(tiny.ensure_tiny_model(target))) for _ in range(2)]
    for run in runs:
        run.start()
    for run in runs:
        run.join()
    assert found == [target, target] and writes == [target] and tiny.files_intact(target)


def test_version():
    assert h3gen("--version", check_code=0).stdout.startswith("h3gen ")


def test_dash_h_is_help():
    assert "--dry-run" in h3gen("render", "-h", check_code=0).stdout
    assert "presets" in h3gen("-h", check_code=0).stdout


def test_small_things_read_right(tmp_path, prompts_file):
    """An id ending in .mp4 is the file name; a stage without keys says so; validate --json; a missing file is
    reported among the others and exits 2."""
    from h3gen.errors import UsageError
    from h3gen.inputs.request import Request
    from h3gen.run.resume import clip_name
    from h3gen.config.stage_config import build_config
    from h3gen.stages.base import NoConfig

    assert clip_name(Request(0, "x", 0, 32, 32, 124, id="x.mp4"), "tiny") == "x.mp4"
    assert clip_name(Request(0, "x", 0, 32, 32, 124, id="x"), "tiny") == "x.mp4"
    with pytest.raises(UsageError) as refused:
        build_config(NoConfig, {"crf": 1}, "preset p [vae]")
    assert "this stage takes no keys" in str(refused.value) and "none" not in str(refused.value)
    bad = tmp_path / "bad.mp4"
    bad.write_bytes(b"not a video")
    checked = h3gen("validate", "--json", bad, check_code=1)
    [record] = map(json.loads, checked.stdout.splitlines())
    assert record["path"] == str(bad) and record["ok"] is False and record["problems"]
    missing = h3gen("validate", tmp_path / "nope.mp4", bad, check_code=2)
    assert "nope.mp4: INVALID: does not exist" in missing.stderr and "bad.mp4: INVALID" in missing.stderr


def test_a_bad_model_directory_from_h3gen_model_names_the_variable(prompts_file, tmp_path):
    missing = tmp_path / "nope"
    error = f"model directory {missing} does not exist (pass --model DIR pointing at a MiniMax-H3 repository)\n"
    for command in (["render", prompts_file("x\n"), "-o", tmp_path / "out", "--dry-run"],
                    ["bench", "-o", tmp_path / "results"]):
        from_variable = h3gen(*command, env={"H3GEN_MODEL": str(missing)}, check_code=2)
        assert from_variable.stderr == f"h3gen: error: H3GEN_MODEL: {error}", from_variable.stderr
        given = h3gen(*command, "--model", missing, env={"H3GEN_MODEL": str(tmp_path)}, check_code=2)
        assert given.stderr == f"h3gen: error: {error}", given.stderr


def complete(words: str) -> list[str]:
    """What bash completion offers for the last word of `words`."""
    result = h3gen(env={"_H3GEN_COMPLETE": "complete_bash", "COMP_WORDS": words,
                        "COMP_CWORD": str(len(words.split()) - (0 if words.endswith(" ") else 1))}, check_code=0)
    return result.stdout.split()


def test_completion_knows_presets_set_keys_and_stage_names():
    assert {"h3-base", "h3-base-fp8"} <= set(complete("h3gen render p.txt --preset h3-b"))
    assert "sampler.steps=" in complete("h3gen render p.txt --set sampler.st")
    assert "adapter.paths=" in complete("h3gen render p.txt --preset fasth3 --set adapter.pa")
    assert set(complete("h3gen render p.txt --set vae.use=")) >= {"vae.use=fast", "vae.use=reference"}
    assert "sampler.steps=" in complete("h3gen presets show h3-base --set sampler.st")
    assert complete("h3gen presets show fasth3-fp8 --set quant.ma") == ["quant.matmul="]  # its keys, not tiny's
    # the keys of the stage an earlier --set picked; a --set still being typed does not stop the rest completing
    assert "vae.tile_batch=" in complete("h3gen render p.txt --set vae.use=fast --set vae.ti")
    assert "cache.threshold=" in complete("h3gen render p.txt --preset h3-base --set cache.use=residual --set cache.")
    assert "vae.use=" in complete("h3gen render p.txt --set vae.use=nosuch --set vae.")


def test_completion_of_bench_options_and_of_the_shell_to_install_for():
    assert {"h3-base", "fasth3", "tiny"} <= set(complete("h3gen bench --preset "))
    assert {"diffusers", "none"} <= set(complete("h3gen bench --baseline "))
    assert complete("h3gen bench --baseline n") == ["none"]
    assert complete("h3gen bench --stages ") == ["encode", "dit", "vae", "mux"]
    assert complete("h3gen bench --stages encode,v") == ["encode,vae"]
    assert complete("h3gen bench --random-weights ") == ["full", "tiny"]
    assert "cache.threshold=" in complete("h3gen bench --preset h3-base-fast --set cache.th")  # the keys of its preset
    assert set(complete("h3gen bench --set vae.use=")) >= {"vae.use=fast", "vae.use=reference"}
    assert complete("h3gen --install-completion ") == ["bash", "zsh", "fish", "powershell", "pwsh"]
    assert complete("h3gen --show-completion z") == ["zsh"]
    assert "render" in complete("h3gen --version ")  # the version is printed when asked, not offered as a word


@pytest.mark.parametrize("columns", [140, 80, 40])
def test_compare_s_table_keeps_clip_names_and_numbers_whole_in_a_narrow_terminal(monkeypatch, capsys, columns):
    from h3gen.cli.ui import compare_table

    monkeypatch.setenv("COLUMNS", str(columns))
    name = "a-very-long-clip-name-from-a-prompt-id-0001.mp4"
    compare_table([{"a": f"out/{name}", "b": f"ref/{name}", "psnr_mean": 35.2, "psnr_worst": 30.0, "ssim_mean": 0.98,
                    "ssim_worst": 0.95, "audio_snr_db": float("inf"), "log_mel_distance_db": 0.1}], terminal())
    lines = capsys.readouterr().err.splitlines()
    assert max(map(len, lines)) <= columns
    assert "".join(line.split("│")[1].strip() for line in lines if line.startswith("│")) == name  # folded at most
    assert all(any(number in line for line in lines) for number in ("35.20", "30.00", "0.9800", "0.9500", "inf"))


def test_compare_s_table_cuts_no_number_at_any_width(monkeypatch, capsys):
    """Widths where rich's measure says a row a clip fits but its layout would cut a cell ("-0.84…"): those get the
    row a measure too."""
    from h3gen.cli.ui import compare_table

    record = {"a": "out/h3-0123456789-seed1101.mp4", "b": "ref/h3-0123456789-seed1101.mp4", "psnr_mean": -0.8412,
              "psnr_worst": -12.34, "ssim_mean": -0.84123, "ssim_worst": 0.12345, "audio_snr_db": -120.55,
              "log_mel_distance_db": -0.845}
    for columns in range(50, 141):
        monkeypatch.setenv("COLUMNS", str(columns))
        compare_table([record], terminal())
        text = capsys.readouterr().err
        assert "…" not in text and max(map(len, text.splitlines())) <= columns, columns
        assert all(n in text for n in ("-0.84", "-12.34", "-0.8412", "0.1235", "-120.55", "-0.845")), columns


@pytest.mark.parametrize("columns", [50, 60])
def test_compare_s_table_never_squeezes_the_numbers_away_beside_a_long_name(monkeypatch, capsys, columns):
    """A name matched by request ("A (B)") leaves the numbers' columns no room: rich draws them empty, no mark."""
    from h3gen.cli.ui import compare_table

    monkeypatch.setenv("COLUMNS", str(columns))
    compare_table([{"a": "out/other.mp4", "b": "ref/h3-2cde9a4d8a31.mp4", "psnr_mean": 35.2, "psnr_worst": 30.0,
                    "ssim_mean": 0.98, "ssim_worst": 0.95, "audio_snr_db": 12.5, "log_mel_distance_db": 0.1}],
                  terminal())
    text = capsys.readouterr().err
    assert all(n in text for n in ("35.20", "30.00", "0.9800", "0.9500", "12.50", "0.100", "PSNR dB")), text
    assert max(map(len, text.splitlines())) <= columns


def terminal():
    """A console that draws as on a terminal, onto the stderr pytest captures."""
    from rich.console import Console

    return Console(stderr=True, highlight=False, force_terminal=True, color_system=None)


def test_compare_s_table_in_a_log_is_plain_aligned_lines_with_every_name_whole(monkeypatch, capsys):
    from h3gen.cli.ui import compare_table

    monkeypatch.setenv("COLUMNS", "40")
    name = "a-very-long-clip-name-from-a-prompt-id-0001.mp4"
    compare_table([{"a": f"out/{name}", "b": f"ref/{name}", "psnr_mean": 35.2, "psnr_worst": 30.0, "ssim_mean": 0.98,
                    "ssim_worst": 0.95, "audio_snr_db": float("inf"), "log_mel_distance_db": 0.1},
                   {"a": "out/b.mp4", "b": "ref/b.mp4", "psnr_mean": 9.5, "psnr_worst": 8.0, "ssim_mean": 0.5,
                    "ssim_worst": 0.25, "audio_snr_db": None, "log_mel_distance_db": 1.0}])
    title, header, first, second = capsys.readouterr().err.splitlines()
    assert title == "h3gen compare (A against B)" and header.split()[:3] == ["clip", "PSNR", "dB"]
    assert first.split() == [name, "35.20", "30.00", "0.9800", "0.9500", "inf", "0.100"]
    assert second.split() == ["b.mp4", "9.50", "8.00", "0.5000", "0.2500", "-", "1.000"]
    assert len({len(line) for line in (header, first, second)}) == 1  # numbers flush right under their headings
    assert not any(c in title + header + first for c in "│┃━…")


def test_every_command_has_an_example_and_plain_metavars():
    for command in (["render"], ["validate"], ["presets", "list"], ["presets", "show"], ["plugins"], ["tiny"],
                    ["bench"], ["compare"]):
        text = h3gen(*command, "--help", check_code=0).stdout
        assert "Example" in text and f"h3gen {' '.join(command)}" in text.split("Example", 1)[1], command
    render = h3gen("render", "--help", check_code=0).stdout
    assert "--set SECTION.KEY=VALUE" in render and "repeatable" in render and "<list[str]>" not in render


def help_texts() -> dict[str, str]:
    """`-h` of h3gen and of every command and group under it, by command path ("" for h3gen itself)."""
    from typer.main import get_command
    from typer.testing import CliRunner

    from h3gen.cli.main import app

    def paths(group, path):
        yield path
        for name, command in group.commands.items():
            yield from paths(command, path + [name]) if hasattr(command, "commands") else [path + [name]]

    runner = CliRunner()
    return {" ".join(path): runner.invoke(app, [*path, "-h"], prog_name="h3gen").output
            for path in paths(get_command(app), [])}


def test_help_shows_plain_metavars_and_says_repeatable():
    from typer.main import get_command

    from h3gen.cli.main import app

    texts = help_texts()
    assert {"", "render", "validate", "compare", "bench", "plugins", "tiny", "presets", "presets list",
            "presets show"} <= set(texts)
    for command, text in texts.items():
        assert text.startswith(f"Usage: h3gen {command}".rstrip()), (command, text)
        for label in ("{", "<list", "list[", "<int", "<path", "<str", "<float"):
            assert label not in text, (command, label, text)
    usage = {command: text.splitlines()[0] for command, text in texts.items()}
    assert usage["render"] == "Usage: h3gen render [OPTIONS] PROMPTS"
    assert usage["validate"] == "Usage: h3gen validate [OPTIONS] FILE..."
    assert usage["compare"] == "Usage: h3gen compare [OPTIONS] A B"
    assert usage["tiny"] == "Usage: h3gen tiny [OPTIONS] [DIR]"
    assert usage["presets show"] == "Usage: h3gen presets show [OPTIONS] NAME|FILE"
    assert "--install-completion [SHELL]" in texts[""] and "--gpus N " in texts["render"]
    assert "--set SECTION.KEY=VALUE" in texts["bench"] and "--size WxH" in texts["bench"]
    root = get_command(app)
    for command in ("render", "bench", "presets show"):
        found = root
        for name in command.split():
            found = found.commands[name]
        repeatable = [param for param in found.params if getattr(param, "multiple", False)]
        assert repeatable and texts[command].count("(repeatable)") == len(repeatable), command



@pytest.mark.parametrize("shell, script, rc_file", [("zsh", ".zfunc/_h3gen", ".zshrc"),
                                                    ("fish", ".config/fish/completions/h3gen.fish", None),
                                                    ("bash", ".bash_completions/h3gen.sh", ".bashrc")])
def test_install_completion_installs_the_shell_asked_for(tmp_path, shell, script, rc_file):
    """Whatever shell h3gen runs under (SHELL, the process tree), the one named after the option is the one set up."""
    env = {"HOME": str(tmp_path), "SHELL": "/bin/zsh" if shell == "bash" else "/bin/bash"}
    installed = h3gen("--install-completion", shell, env=env, check_code=0)
    assert f"{shell} completion installed in {tmp_path / script}" in installed.stdout
    written = sorted(str(path.relative_to(tmp_path)) for path in tmp_path.rglob("*") if path.is_file())
    assert written == sorted([script] + ([rc_file] if rc_file else []))
    shown = h3gen("--show-completion", shell, env=env, check_code=0).stdout
    assert (tmp_path / script).read_text().strip() == shown.strip()
    assert {"zsh": "#compdef h3gen", "fish": "complete --command h3gen",
            "bash": "complete -o default -F _h3gen_completion h3gen"}[shell] in shown
    if shell == "zsh":  # the loading line alone: nothing that changes other commands' completion (a zstyle)
        assert (tmp_path / ".zshrc").read_text() == "fpath+=~/.zfunc; autoload -Uz compinit; compinit\n"
    if shell == "bash":
        assert f"source '{tmp_path / script}'" in (tmp_path / ".bashrc").read_text()


@pytest.mark.parametrize("shell, rc_file, line", [("zsh", ".zshrc", "fpath+=~/.zfunc; autoload -Uz compinit; compinit"),
                                                  ("bash", ".bashrc", "source '{home}/.bash_completions/h3gen.sh'")])
def test_install_adds_its_line_once_and_keeps_the_rest_of_the_startup_file(tmp_path, shell, rc_file, line):
    (tmp_path / rc_file).write_text("# mine\n  alias x=y")  # no newline at the end, indented: as the user wrote it
    for _ in range(3):
        h3gen("--install-completion", shell, env={"HOME": str(tmp_path)}, check_code=0)
    assert (tmp_path / rc_file).read_text() == f"# mine\n  alias x=y\n{line.format(home=tmp_path)}\n"


def test_bash_completes_a_set_value_past_its_equals_sign(tmp_path):
    """bash splits `--set vae.use=fa` at the `=`: the script h3gen installs hands over the line as typed, each
    completion comes back from where bash's word starts, and after a key, which ends in `=`, bash adds no space."""
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("needs bash")
    (tmp_path / "h3gen.sh").write_text(h3gen("--show-completion", "bash", check_code=0).stdout)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "h3gen").write_text(f'#!/bin/sh\nexec {sys.executable} -m h3gen.cli.main "$@"\n')
    (tmp_path / "bin" / "h3gen").chmod(0o755)
    lines = ["h3gen render p.txt --set mux.use=py", "h3gen render p.txt --set sampler.ste",
             "h3gen render p.txt --preset h3-base-fp", "h3gen render p.txt --set vae.use="]
    asked = "\n".join(f'ask "{line}"' for line in lines)
    shown = subprocess.run([bash, "--norc", "-c", f"""
        source {tmp_path / "h3gen.sh"}
        compopt() {{ printf 'compopt %s %s;' "$1" "$2"; }}  # bash's own acts only in a completion it is running
        ask() {{ COMP_LINE="$1"; COMP_POINT=${{#1}}; _h3gen_completion h3gen; printf '%s,' "${{COMPREPLY[@]}}"; echo; }}
        {asked}"""], capture_output=True, text=True, cwd=tmp_path,
        env={**os.environ, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}"}).stdout.splitlines()
    assert shown == ["pyav,", "compopt -o nospace;sampler.steps=,", "h3-base-fp8,", "diffusers,fast,reference,"]


def test_zsh_completion_adds_no_space_after_a_set_key():
    """What zsh's script evaluates: the keys, which end in `=`, with no suffix, so the value follows at once; other
    words as typer gives them, a space after each."""
    def zsh(words: str) -> str:
        return h3gen(env={"_H3GEN_COMPLETE": "complete_zsh", "_TYPER_COMPLETE_ARGS": words}, check_code=0).stdout

    assert zsh("h3gen render p.txt --set sampler.st").startswith("compadd -S '' -- 'sampler.steps=' ")
    assert zsh("h3gen render p.txt --set vae.use=fa").strip() == """_arguments '*: :(("vae.use=fast"))'"""


ZSH_DRIVER = """
zmodload zsh/zpty
for line in "$@"; do  # each in a new interactive zsh, as a user's terminal: TAB, then 7, then the line printed
  zpty z 'zsh -i'
  zpty -w z 'PS1="> "'
  zpty -w -n z "$line"$'\\t7\\C-aprint -r -- "[\\C-e]"\\n'
  zpty -w z 'exit'
  while zpty -r z out; do print -r -- "$out"; done
  zpty -d z
done
"""


def test_zsh_completes_from_the_installed_script_on_the_first_tab(tmp_path):
    """The script --install-completion writes (autoloaded from ~/.zfunc by the lines it adds to ~/.zshrc) completes
    on the first TAB of a new shell, and a --set key takes its value with no space between."""
    zsh = shutil.which("zsh")
    if zsh is None:
        pytest.skip("needs zsh")
    h3gen("--install-completion", "zsh", env={"HOME": str(tmp_path), "SHELL": "/bin/zsh"}, check_code=0)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "h3gen").write_text(f'#!/bin/sh\nexec {sys.executable} -m h3gen.cli.main "$@"\n')
    (tmp_path / "bin" / "h3gen").chmod(0o755)
    lines = ["h3gen render p.txt --set sampler.ste", "h3gen render p.txt --set vae.use=fa",
             "h3gen render p.txt --preset h3-base-fp"]
    shown = subprocess.run([zsh, "-f", "-c", ZSH_DRIVER, "zsh", *lines], capture_output=True, text=True, timeout=120,
                           env={**os.environ, "HOME": str(tmp_path), "ZDOTDIR": str(tmp_path),
                                "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}"}).stdout
    printed = [line.strip() for line in shown.splitlines() if line.startswith("[h3gen")]
    assert printed == ["[h3gen render p.txt --set sampler.steps=7]", "[h3gen render p.txt --set vae.use=fast 7]",
                       "[h3gen render p.txt --preset h3-base-fp8 7]"], shown


def test_install_completion_in_the_shell_it_runs_under_adds_its_line_once(tmp_path):
    """Without a shell named, the shell detected (bash here, the command's parent) gets h3gen's own install: its
    loading line once, no blank line added at each install."""
    command = f"'{sys.executable}' -m h3gen.cli.main --install-completion"
    for _ in range(2):
        result = subprocess.run([shutil.which("bash"), "-c", command], capture_output=True, text=True,
                                env=child_env({"HOME": str(tmp_path)}))
        assert result.returncode == 0, result.stderr
    assert (tmp_path / ".bashrc").read_text() == f"source '{tmp_path}/.bash_completions/h3gen.sh'\n"


def test_install_completion_for_a_powershell_that_is_not_installed_says_so(tmp_path):
    refused = h3gen("--install-completion", "pwsh", env={"HOME": str(tmp_path), "PATH": str(tmp_path)},
                    check_code=2)
    assert ("--install-completion pwsh: pwsh is not installed here, so its profile cannot be found (run `h3gen "
            "--show-completion pwsh` and add what it prints") in refused.stderr
    assert refused.stderr.strip().count("\n") == 0, refused.stderr


def test_install_completion_refuses_a_shell_it_does_not_know(tmp_path):
    refused = h3gen("--install-completion", "tcsh", env={"HOME": str(tmp_path)}, check_code=2)
    assert "--install-completion tcsh: not a shell h3gen completes in" in refused.stderr
    assert not list(tmp_path.iterdir())


def test_a_run_started_in_the_checkout_finds_installed_packages_not_its_folders():
    """`python -m` in the checkout (pytest, a render's torchrun workers) puts the checkout's root on sys.path, as ''
    or as its path; its kernels/ must not stand in for Hugging Face's `kernels`, which transformers imports."""
    root = str(ROOT.resolve())
    probe = ("import importlib.util, sys; sys.path.insert(0, sys.argv[1]); import h3gen; "
             "spec = importlib.util.find_spec('kernels'); print(spec.origin if spec else None)")
    found = subprocess.run([sys.executable, "-c", probe, root], cwd=root, capture_output=True, text=True, check=True)
    assert found.stdout.strip() != os.path.join(root, "kernels", "__init__.py"), found.stdout


@pytest.mark.parametrize("debug", ["", "1"])
@pytest.mark.parametrize("command, where", [("render", "--traceback"), ("validate", "H3GEN_DEBUG=1")])
def test_a_bug_is_one_line_and_with_traceback_the_traceback_comes_before_it(monkeypatch, capsys, debug, command,
                                                                          where):
    """The line names a way to see the traceback that the command has: only render and bench take --traceback."""
    import h3gen.cli.main as cli

    def broken(**kwargs):
        raise RuntimeError("something h3gen did not expect")

    monkeypatch.setattr(cli, "app", broken)
    monkeypatch.setenv("H3GEN_DEBUG", debug)
    monkeypatch.setattr(sys, "argv", ["h3gen", command, "x.mp4"])
    with pytest.raises(SystemExit) as exit:
        cli.main()
    assert exit.value.code == 1
    err = capsys.readouterr().err
    fix = "report it with the traceback above" if debug else f"rerun with {where} for where, and report it"
    assert err.splitlines()[-1] == f"h3gen: error: RuntimeError: something h3gen did not expect (a bug; {fix})"
    assert ("Traceback (most recent call last)" in err) == bool(debug)


def test_plugins_lists_its_columns_aligned():
    """Kind, name, origin and class padded to the widest of each, so the descriptions start in one column."""
    import re

    lines = h3gen("plugins", check_code=0).stdout.splitlines()
    classes = [re.search(r"h3gen(\.\w+)+", line) for line in lines]  # the class: a dotted path
    starts = {c.start() for c in classes}
    descriptions = {c.end() + len(line[c.end():]) - len(line[c.end():].lstrip()) for c, line in zip(classes, lines)}
    assert len(starts) == 1 and len(descriptions) == 1, (starts, descriptions)


@pytest.mark.parametrize("args, line", [
    (["render", "p.txt", "--seed", "abc"], "h3gen: error: Invalid value for '--seed': Input should be a valid integer, "
                                           "unable to parse string as an integer (see h3gen render -h)"),
    (["render"], "h3gen: error: Missing argument 'PROMPTS' (see h3gen render -h)"),
    (["validate", "--frames", "0", "x.mp4"], "h3gen: error: Invalid value for '--frames': Input should be greater "
                                             "than or equal to 1 (see h3gen validate -h)"),
    (["presets", "nosuch"], "h3gen: error: No such command 'nosuch' (see h3gen presets -h)"),
    (["--bogus"], "h3gen: error: No such option: --bogus (see h3gen -h)"),
])
def test_what_the_parser_refuses_is_one_line(args, line):
    result = h3gen(*args, check_code=2)
    assert result.stderr == line + "\n" and result.stdout == ""


def test_h3gen_alone_still_prints_its_help():
    result = h3gen(check_code=2)
    assert "Usage: h3gen [OPTIONS] COMMAND [ARGS]..." in result.stdout + result.stderr


@pytest.mark.parametrize("text", ["expandable_segments:True", "max_split_size_mb:128,garbage_collection_threshold:0.6",
                                  "roundup_power2_divisions:[256:1,512:2,>:4]", " backend : cudaMallocAsync "])
def test_allocator_settings_of_torch_s_form_are_taken_without_trying_torch(monkeypatch, text):
    from h3gen.cli import environment

    monkeypatch.setenv("PYTORCH_ALLOC_CONF", text)
    monkeypatch.setattr(environment, "torch_imports", lambda: pytest.fail("torch tried on a well-formed setting"))
    assert environment.allocator_entries(text) is not None
    environment.check_allocator_config()


@pytest.mark.parametrize("imports", [True, False])
def test_an_allocator_setting_of_another_form_is_refused_only_when_torch_cannot_start_with_it(monkeypatch, imports):
    from h3gen.cli import environment
    from h3gen.errors import UsageError

    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "[odd]")
    monkeypatch.setattr(environment, "torch_imports", lambda: imports)
    if imports:
        environment.check_allocator_config()
    else:
        with pytest.raises(UsageError, match="PYTORCH_CUDA_ALLOC_CONF is '\\[odd\\]', which torch cannot read"):
            environment.check_allocator_config()


@pytest.mark.parametrize("workers", [(), ("--cpu-workers", "2")])
def test_a_run_with_standard_error_closed_renders_and_keeps_its_files_its_own(prompts_file, tmp_path, workers):
    """`2>&-` in a script: the lines go nowhere, and no file the run opens takes descriptor 2 and gets them. The
    workers inherit the stand-in (they started without a descriptor 2, and the first failed silently, exit 1)."""
    out = tmp_path / "out"
    result = h3gen("render", prompts_file("a fox\na heron\n"), "-o", out, *workers, preexec_fn=lambda: os.close(2),
                   env={"OMP_NUM_THREADS": "1"})
    assert result.returncode == 0
    assert len(list(out.glob("*.mp4"))) == 2 and all(validate_clip(p) == [] for p in out.glob("*.mp4"))


@pytest.mark.parametrize("closed, args, problem", [
    (1, ["--json"], "--json with standard output closed: its lines would go nowhere (give standard output a file or "
                    "a pipe, or leave out --json)"),
    (0, [], "prompts from standard input (-), which is closed (pipe the prompts in, or give the prompts file's path)"),
])
def test_json_lines_or_prompts_on_a_closed_standard_stream_are_refused(prompts_file, tmp_path, closed, args, problem):
    prompts = "-" if closed == 0 else prompts_file("a fox\n")
    result = h3gen("render", prompts, "-o", tmp_path / "out", *args, preexec_fn=lambda: os.close(closed))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == f"h3gen: error: {problem}"
    assert not (tmp_path / "out").exists()


def test_a_clip_ffmpeg_cannot_read_is_named_without_ffmpeg_s_error_number(tmp_path, monkeypatch):
    import av

    from h3gen.run import validate

    clip = tmp_path / "a.mp4"
    clip.write_bytes(b"\0\0\0\x18ftypisom" + b"\0" * 64)

    def damaged(path, pictures):
        raise av.error.InvalidDataError(1094995529, "Invalid data found when processing input", None,
                                        "avcodec_send_packet()")

    monkeypatch.setattr(validate, "box_problem", lambda path: "")
    monkeypatch.setattr(validate, "probe_clip", damaged)
    assert validate.validate_clip(clip) == [f"cannot read {clip}: Invalid data found when processing input"]
