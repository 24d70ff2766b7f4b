"""Help in plain words: a value is shown by its metavar (PROMPTS, FILE..., N, SECTION.KEY=VALUE), never by typer's
type labels ({PROMPTS}, <list[Path]>, <int>), and an option that can be given more than once says so.

The commands' `--help` and the man page (h3gen.cli.manpage) both read their lines from here; PlainCommand is
also where every command meets a closed stdout.
"""

from __future__ import annotations

import contextlib
import sys

import typer
from typer.core import TyperCommand, TyperGroup

try:  # the click typer parses with: its own copy in recent typer, else click itself
    from typer._click.exceptions import NoArgsIsHelpError, UsageError
except ImportError:
    from click.exceptions import NoArgsIsHelpError, UsageError

REPEATABLE = "(repeatable)"


def value_name(param) -> str:
    """A parameter's value as help shows it: its metavar, else its name in capitals; `...` after an argument that
    takes several."""
    name = param.metavar or param.name.upper()
    return f"{name}..." if is_argument(param) and param.nargs != 1 else name


def is_argument(param) -> bool:
    return param.param_type_name == "argument"


def usage_piece(argument) -> str:
    name = value_name(argument)
    return name if argument.required else f"[{name}]"


def with_repeatable(text: str) -> str:
    return f"{text[:-1]} {REPEATABLE}." if text.endswith(".") else f"{text} {REPEATABLE}".strip()


def help_record(param, ctx) -> tuple[str, str] | None:
    """(what to type, what it does) for one parameter; None when it is hidden."""
    record = param.get_help_record(ctx)
    if record is None:
        return None
    text = param.help or ""
    extra = record[1][len(text):].strip()  # typer's "[default: ...; required]" after the help text
    if getattr(param, "multiple", False):
        text = with_repeatable(text)
    if is_argument(param):
        name = value_name(param)
    else:
        name = ", ".join(sorted(param.opts, key=lambda opt: opt.startswith("--")))
        if not param.is_flag or param.metavar:
            name += f" {value_name(param)}"
    return name, f"{text}  {extra}".strip()


def help_records(command, ctx) -> tuple[list, list]:
    """The (arguments, options) rows of `command`'s help."""
    rows = [(param, help_record(param, ctx)) for param in command.get_params(ctx)]
    return ([row for param, row in rows if row and is_argument(param)],
            [row for param, row in rows if row and not is_argument(param)])


def write_params(command, ctx, formatter) -> None:
    arguments, options = help_records(command, ctx)
    for title, rows in (("Arguments", arguments), ("Options", options)):
        if rows:
            with formatter.section(title):
                formatter.write_dl(rows)


@contextlib.contextmanager
def ended_as_sigpipe_ends():
    """stdout's reader gone (`h3gen validate --json ... | head -1`): the command ends as SIGPIPE ends other tools,
    quietly with 141, not with Click's exit 1 (`render` ends its run so itself, at the next clip)."""
    import signal

    try:
        yield
    except BrokenPipeError:
        from h3gen.cli.ui import silence_stdout

        silence_stdout()
        raise SystemExit(128 + signal.SIGPIPE) from None


class PlainCommand(TyperCommand):
    def invoke(self, ctx):
        with ended_as_sigpipe_ends():
            return super().invoke(ctx)

    def collect_usage_pieces(self, ctx) -> list[str]:
        pieces = [self.options_metavar] if self.options_metavar else []
        return pieces + [usage_piece(param) for param in self.get_params(ctx) if is_argument(param)]

    def format_options(self, ctx, formatter) -> None:
        write_params(self, ctx, formatter)


class OneLineUsageError(UsageError):
    """A usage error the parser found (a missing argument, an unknown option, a value of the wrong type), said as
    h3gen says every error: one line, with where to look."""

    def show(self, file=None) -> None:
        from h3gen.errors import one_line

        where = self.ctx.command_path if self.ctx is not None else "h3gen"
        typer.echo(f"h3gen: error: {one_line(self.format_message()).rstrip('.')} (see {where} -h)",
                   file=file or sys.stderr)


@contextlib.contextmanager
def usage_errors_in_one_line():
    try:
        yield
    except NoArgsIsHelpError:  # `h3gen` alone: the help itself
        raise
    except UsageError as e:
        if isinstance(e, OneLineUsageError):
            raise
        raise OneLineUsageError(e.format_message(), e.ctx) from None


class PlainGroup(TyperGroup):
    def format_options(self, ctx, formatter) -> None:
        write_params(self, ctx, formatter)
        self.format_commands(ctx, formatter)
