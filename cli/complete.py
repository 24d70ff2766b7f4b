"""Shell completion of what only h3gen knows (preset names, `--set` keys, the registered stage names and the stages
`h3gen bench` times), and its installation for the shell asked for."""

from __future__ import annotations

import os
from pathlib import Path


def preset_names(incomplete: str) -> list[str]:
    from h3gen.cli.ui import plugin_registry

    return [name for name in sorted(plugin_registry().presets) if name.startswith(incomplete)]


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
    given yet) as the --set values before this one leave it (a stage another --set picked, with its keys); after
    `KIND.use=`, the registered stages of that kind."""
    from h3gen.config.preset import describe, resolve
    from h3gen.cli.ui import plugin_registry

    found = plugin_registry()
    key, equals, _ = incomplete.partition("=")
    if equals and key.endswith(".use"):
        kind = key[: -len(".use")]
        return [f"{key}={name}" for k, name in sorted(found.stages) if k == kind and
                f"{key}={name}".startswith(incomplete)]
    params = ctx.params or {}
    # `presets show NAME --set`: click, stopped by the --set still without its value, leaves NAME among ctx.args
    shown = params.get("name") or (ctx.args[0] if "name" in params and ctx.args else None)
    name = params.get("preset") or shown or (params.get("presets") or ["tiny"])[0]
    earlier = list(params.get("overrides") or params.get("sets") or [])
    # a half-typed preset or --set: the keys without the --set values, else the keys every preset has
    for tried, sets in ((name, earlier), (name, []), ("tiny", [])):
        try:
            preset = resolve(tried, found, sets)
            break
        except Exception:
            continue
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
    `--show-completion SHELL`, or `--install-completion` alone in a shell h3gen detects: typer's options take no
    value (the name after them would be read as a command), and typer's own install of bash's script adds a blank
    line to ~/.bashrc at every install."""
    for option, following in zip(args, [*args[1:], ""]):
        if not option.startswith("-"):
            return None
        if option in SHELL_OPTIONS and following and not following.startswith("-"):
            return option, following
        if option == "--install-completion":
            from typer._completion_shared import _get_shell_name

            detected = _get_shell_name()
            return (option, detected) if detected else None
    return None


ZSH_LOADER = "fpath+=~/.zfunc; autoload -Uz compinit; compinit"


def install_script(shell: str, prog_name: str, complete_var: str):
    """bash and zsh: the script in the home folder (~/.bash_completions/PROG.sh, ~/.zfunc/_PROG) and the line that
    loads it at the end of the shell's startup file, once, the rest of the file as it was. typer's own install adds
    a blank line to ~/.bashrc at every install, and for zsh also switches on menu selection for every command."""
    from typer.completion import get_completion_script

    home = Path.home()
    if shell == "zsh":
        script, startup, loader = home / ".zfunc" / f"_{prog_name}", home / ".zshrc", ZSH_LOADER
    else:
        script = home / ".bash_completions" / f"{prog_name}.sh"
        startup, loader = home / ".bashrc", f"source '{script}'"
    text = startup.read_text() if startup.is_file() else ""
    if loader not in text:
        with startup.open("a") as lines:
            lines.write(("\n" if text and not text.endswith("\n") else "") + loader + "\n")
    script.parent.mkdir(parents=True, exist_ok=True)
    script.write_text(get_completion_script(prog_name=prog_name, complete_var=complete_var, shell=shell))
    return script


def complete_for(ctx, option: str, shell: str) -> None:
    """Install or print the completion script of `shell`, as typer's options do for the detected one; exits."""
    import typer
    from typer.completion import get_completion_script, install

    if shell not in SHELLS:
        ctx.fail(f"{option} {shell}: not a shell h3gen completes in (use {', '.join(SHELLS)})")
    prog_name = ctx.info_name
    complete_var = f"_{prog_name.replace('-', '_').upper()}_COMPLETE"
    if option == "--install-completion":
        try:  # typer asks PowerShell itself where its profile is
            shell, path = ((shell, install_script(shell, prog_name, complete_var)) if shell in ("bash", "zsh") else
                           install(shell=shell, prog_name=prog_name, complete_var=complete_var))
        except FileNotFoundError as e:
            ctx.fail(f"{option} {shell}: {Path(e.filename or shell).name} is not installed here, so its profile "
                     f"cannot be found (run `{prog_name} --show-completion {shell}` and add what it prints to the "
                     "profile of the machine that has it)")
        typer.secho(f"{shell} completion installed in {path}", fg="green")
        typer.echo("Completion will take effect once you restart the terminal")
    else:
        typer.echo(get_completion_script(prog_name=prog_name, complete_var=complete_var, shell=shell))
    raise typer.Exit(0)


# typer's bash script hands over bash's words, which bash splits at `=` and `:` (COMP_WORDBREAKS): `--set vae.use=fa`
# reaches the completion as `vae.use`, `=`, `fa`. This one hands over the line as typed, and after a `--set` key,
# which ends in `=`, adds no space, so the value follows at once.
BASH_SCRIPT = """
%(complete_func)s() {
    local IFS=$'\\n' reply
    COMPREPLY=( $( env COMP_LINE="$COMP_LINE" COMP_POINT="$COMP_POINT" COMP_WORDBREAKS="$COMP_WORDBREAKS" \\
                   %(autocomplete_var)s=complete_bash $1 ) )
    for reply in "${COMPREPLY[@]}"; do
        [[ $reply == *= ]] && compopt -o nospace 2>/dev/null
    done
    return 0
}

complete -o default -F %(complete_func)s %(prog_name)s
"""

# typer's zsh script, installed as ~/.zfunc/_h3gen and autoloaded, only registers its function on the first TAB, which
# then completes nothing. This one completes then too, and still registers itself when sourced.
ZSH_SCRIPT = """#compdef %(prog_name)s

%(complete_func)s() {
  eval $(env _TYPER_COMPLETE_ARGS="${words[1,$CURRENT]}" %(autocomplete_var)s=complete_zsh %(prog_name)s)
}

if [[ $zsh_eval_context[-1] == loadautofunc ]]; then
  %(complete_func)s "$@"
else
  compdef %(complete_func)s %(prog_name)s
fi
"""


def zsh_compadd(values: list[str], space: bool) -> str:
    """zsh's compadd of `values`, each quoted as one word through the script's `eval`; a space after each, or none."""
    quoted = " ".join("'" + value.replace("'", "'\\''") + "'" for value in values)
    return ("compadd -- " if space else "compadd -S '' -- ") + quoted


def use_h3gen_completion() -> None:
    """h3gen's bash and zsh scripts and the completions that read them, in place of typer's; scripts installed before
    still work (typer's bash script hands over bash's words)."""
    from typer import _completion_classes, _completion_shared

    class H3genBash(_completion_classes.BashComplete):
        source_template = BASH_SCRIPT

        def get_completion_args(self):
            if "COMP_LINE" not in os.environ:
                return super().get_completion_args()
            line = os.environ["COMP_LINE"]
            line = line[:int(os.environ.get("COMP_POINT") or len(line))]
            words = _completion_classes.click_split_arg_string(line)
            if not line or line[-1].isspace():
                return words[1:], ""
            return words[1:-1], words[-1]

        def complete(self) -> str:
            """Each completion from where bash's word starts: past the typed word's last `=` or `:`."""
            args, incomplete = self.get_completion_args()
            breaks = os.environ.get("COMP_WORDBREAKS", "=:") if "COMP_LINE" in os.environ else ""
            cut = max((incomplete.rfind(c) for c in "=:" if c in breaks), default=-1) + 1
            values = [str(item.value) for item in self.get_completions(args, incomplete)]
            return "\n".join(v[cut:] if v.startswith(incomplete[:cut]) else v for v in values)

    class H3genZsh(_completion_classes.ZshComplete):
        source_template = ZSH_SCRIPT

        def complete(self) -> str:
            """typer's, but a `--set` key, which ends in `=`, takes no space after it: its value follows at once."""
            args, incomplete = self.get_completion_args()
            values = [str(item.value) for item in self.get_completions(args, incomplete)]
            keys = [value for value in values if value.endswith("=")]
            if not keys:
                return super().complete()
            others = [value for value in values if not value.endswith("=")]
            return "; ".join([zsh_compadd(keys, space=False)] + ([zsh_compadd(others, space=True)] if others else []))

    _completion_shared._completion_scripts.update(bash=BASH_SCRIPT, zsh=ZSH_SCRIPT)
    _completion_classes.add_completion_class(H3genBash, "bash")
    _completion_classes.add_completion_class(H3genZsh, "zsh")
