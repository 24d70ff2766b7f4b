"""Shell completion of what only h3gen knows (preset names, `--set` keys, the registered stage names and the stages
`h3gen bench` times), and its installation for the shell asked for."""

from __future__ import annotations


def preset_names(incomplete: str) -> list[str]:
    from h3gen.plugins.manager import registry

    return [name for name in sorted(registry().presets) if name.startswith(incomplete)]


def baseline_names(incomplete: str) -> list[str]:
    """`h3gen bench --baseline`: a preset, or none."""
    return [name for name in [*preset_names(""), "none"] if name.startswith(incomplete)]


def bench_stages(incomplete: str) -> list[str]:
    """`h3gen bench --stages encode,d`: the list typed so far with each stage not yet in it."""
    from h3gen.cli.bench import STAGES

    typed, comma, last = incomplete.rpartition(",")
    return [f"{typed}{comma}{stage}" for stage in STAGES if stage.startswith(last) and stage not in typed.split(",")]


def random_weights(incomplete: str) -> list[str]:
    return [kind for kind in ("full", "tiny") if kind.startswith(incomplete)]


def set_keys(ctx, incomplete: str) -> list[str]:
    """`section.key=` for every key of the preset on the command line (bench's first --preset; tiny when none is
    given yet); after `KIND.use=`, the registered stages of that kind."""
    from h3gen.config.preset import describe, resolve
    from h3gen.plugins.manager import registry

    found = registry()
    key, equals, _ = incomplete.partition("=")
    if equals and key.endswith(".use"):
        kind = key[: -len(".use")]
        return [f"{key}={name}" for k, name in sorted(found.stages) if k == kind and
                f"{key}={name}".startswith(incomplete)]
    try:
        params = ctx.params or {}
        preset = resolve(params.get("preset") or params.get("name") or (params.get("presets") or ["tiny"])[0], found)
    except Exception:  # a half-typed preset: complete the keys every preset has
        preset = resolve("tiny", found)
    keys = [f"{key}=" for key, _, _ in describe(preset) if key != "version"]
    return [key for key in keys if key.startswith(incomplete)]


SHELLS = ("bash", "zsh", "fish", "powershell", "pwsh")
SHELL_OPTIONS = {  # typer's two options, as h3gen reads them: with the shell to act for after them
    "--install-completion": "Install completion for SHELL (bash, zsh, fish, powershell or pwsh; default: the "
                            "current shell).",
    "--show-completion": "Print the completion script for SHELL (default: the current shell), to copy it or "
                         "customize the installation.",
}


def shells_after_option(ctx, incomplete: str) -> list[str] | None:
    """`h3gen --install-completion <TAB>` (or --show-completion): the shells; None where neither option was given."""
    sources = [ctx.get_parameter_source(option[2:].replace("-", "_")) for option in SHELL_OPTIONS]
    given = any(getattr(source, "name", None) == "COMMANDLINE" for source in sources)  # typer's own click's enum
    return [shell for shell in SHELLS if shell.startswith(incomplete)] if given else None


def named_shell(args: list[str]) -> tuple[str, str] | None:
    """(option, shell) when the options before the command are `--install-completion SHELL` or
    `--show-completion SHELL`. typer's options take no value: alone they act for the shell they detect, and the
    name after them would be read as a command."""
    for option, following in zip(args, args[1:]):
        if not option.startswith("-"):
            return None
        if option in SHELL_OPTIONS and not following.startswith("-"):
            return option, following
    return None


def complete_for(ctx, option: str, shell: str) -> None:
    """Install or print the completion script of `shell`, as typer's options do for the detected one; exits."""
    import typer
    from typer.completion import get_completion_script, install

    if shell not in SHELLS:
        ctx.fail(f"{option} {shell}: not a shell h3gen completes in (use {', '.join(SHELLS)})")
    prog_name = ctx.info_name
    complete_var = f"_{prog_name.replace('-', '_').upper()}_COMPLETE"
    if option == "--install-completion":
        shell, path = install(shell=shell, prog_name=prog_name, complete_var=complete_var)
        typer.secho(f"{shell} completion installed in {path}", fg="green")
        typer.echo("Completion will take effect once you restart the terminal")
    else:
        typer.echo(get_completion_script(prog_name=prog_name, complete_var=complete_var, shell=shell))
    raise typer.Exit(0)
