"""man/h3gen.1, generated from the command tree, the presets' sections and the built-in stages' configs themselves, so
it cannot drift from `--help` or from the keys a preset takes.

Run `python -m h3gen.cli.manpage > man/h3gen.1`; a test checks the committed page is current.
"""

from __future__ import annotations

import click
import typer.main

from h3gen import __version__
from h3gen.cli import reference
from h3gen.cli.help import help_records
from h3gen.cli.main import app
from h3gen.cli.preset_keys import preset_keys
from h3gen.plugins.manager import registry


PLUGINS = """A plugin is a package with an entry point in the h3gen group whose module implements the hooks
h3gen_register_stages(register) and h3gen_register_presets(register) (hookimpl from h3gen.plugins.hookspecs). A stage
subclasses h3gen.stages.base.Stage with kind, name, a Config dataclass (every field with a default; bool, int, float,
str or a list of them) and run(clip), which returns the clip. h3gen builds it as Stage(config, runtime), calls
load(repo) once, parallelize(group) on the ranks of a group, run(clip) per clip and unload() at the end. A stage
declares what it can do with class attributes: splits_clip (a sampler), hands_over_frames (a vae), background (a
mux). A failing run() costs its clip, a failing constructor or load() the run, each in one line naming the stage, its
kind and its plugin. h3gen.stages.base.Wrapper wraps the stage a preset would have used (--set vae.use=NAME over a
preset), h3gen.stages.vae.FrameFilter changes its frames. A preset may extend another (extends = "h3-base").
docs/plugins.md has the whole contract and examples/plugin a working plugin."""


def roff(text: str) -> str:
    text = text.replace("\\", "\\\\").replace("-", "\\-")
    return "\n".join(("\\&" + line) if line.startswith((".", "'")) else line for line in text.splitlines())


def argument(text: str) -> str:
    """`text` as a macro's argument (.B, .SS), where a double quote would be read as the argument's delimiter."""
    return roff(text).replace('"', "\\(dq")


def items(entries) -> list[str]:
    """A section's paragraphs, terms and examples (h3gen.cli.reference)."""
    lines = []
    for entry in entries:
        if isinstance(entry, str):
            lines += [".PP", roff(entry)]
        elif isinstance(entry, reference.Example):
            lines += [".PP", roff(entry.text), ".RS", ".nf", roff(entry.command), ".fi", ".RE"]
        else:
            lines += [".TP", ".B " + argument(entry[0]), roff(entry[1])]
    return lines


def commands(group, prefix: str):
    for name in sorted(group.commands):
        command = group.commands[name]
        if hasattr(command, "commands"):
            yield from commands(command, f"{prefix}{name} ")
        else:
            yield f"{prefix}{name}", command


def described(command, ctx) -> list[str]:
    """A command's arguments and options as its `--help` lists them."""
    arguments, options = help_records(command, ctx)
    return items(arguments + options)


def page() -> str:
    root = typer.main.get_command(app)
    ctx = click.Context(root, info_name="h3gen", **root.context_settings)  # -h besides --help
    lines = [f'.TH H3GEN 1 "" "h3gen {__version__}" "User Commands"', ".SH NAME",
             roff("h3gen - batch renderer for MiniMax-H3 text-to-video with a stereo soundtrack"),
             ".SH SYNOPSIS", roff("h3gen COMMAND [OPTIONS] [ARGS]..."), ".SH DESCRIPTION", roff(root.help or ""),
             ".SH OPTIONS", *described(root, ctx), ".SH COMMANDS"]
    for name, command in commands(root, ""):
        sub = click.Context(command, info_name=f"h3gen {name}", parent=ctx)
        text, _, example = (command.help or "").partition("\b\n")  # click's mark: the lines after it as written
        lines += [".SS " + roff(f"h3gen {name} " + " ".join(command.collect_usage_pieces(sub))), roff(text.strip())]
        if example.strip():
            lines += [".PP", ".nf", roff(example.rstrip()), ".fi"]
        lines += described(command, sub)
    lines += [".SH PROMPTS FILE", *items(reference.PROMPTS_FILE), ".SH PRESET KEYS"]
    for title, entries in preset_keys(registry()):
        lines += ([".SS " + argument(title)] if title else []) + items(entries)
    lines += [".SH PLUGINS", roff(PLUGINS), ".SH ENVIRONMENT", *items(reference.ENVIRONMENT),
              ".SH FILES", *items(reference.FILES), ".SH JSON RECORDS", *items(reference.RECORD),
              ".SH EXIT STATUS", *items(reference.EXIT_STATUS),
              ".SH EXAMPLES", *items(reference.EXAMPLES),
              ".SH SEE ALSO", roff("README.md and docs/plugins.md of the h3gen repository.")]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(page(), end="")
