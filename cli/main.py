"""The `h3gen` command. Parses, resolves configuration, draws on stderr, writes results on stdout.

Nothing heavy is imported at module level, so `h3gen --help` and shell completion answer at once.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Annotated, Optional

import typer

from h3gen import __version__
from h3gen.cli.complete import (SHELL_OPTIONS, baseline_names, bench_stages, complete_for, named_shell,
                                preset_names, random_weights, set_keys, shells_after_option, use_h3gen_completion)
from h3gen.cli.environment import check_allocator_config, check_threads
from h3gen.cli.help import PlainCommand, PlainGroup, ended_as_sigpipe_ends, usage_errors_in_one_line
from h3gen.errors import H3genError, UsageError


class Root(PlainGroup):
    """`h3gen` itself: `--install-completion SHELL` and `--show-completion SHELL` act for the shell named."""

    def make_context(self, info_name, args, parent=None, **extra):
        with usage_errors_in_one_line():
            return super().make_context(info_name, args, parent, **extra)

    def invoke(self, ctx):
        with usage_errors_in_one_line():
            return super().invoke(ctx)

    def _main_shell_completion(self, ctx_args, prog_name, complete_var=None):
        use_h3gen_completion()  # after typer has registered its own
        return super()._main_shell_completion(ctx_args, prog_name, complete_var)

    def parse_args(self, ctx, args):
        if any(arg in SHELL_OPTIONS for arg in args):  # the script typer's options write, for a shell named or not
            use_h3gen_completion()
        asked = named_shell(args)
        if asked and not ctx.resilient_parsing:
            complete_for(ctx, *asked)
        return super().parse_args(ctx, args)

    def shell_complete(self, ctx, incomplete):
        from typer.core import CompletionItem  # the class of typer's own click, which draws the completions

        shells = None if incomplete.startswith("-") else shells_after_option(ctx, incomplete)
        return super().shell_complete(ctx, incomplete) if shells is None else list(map(CompletionItem, shells))

    def get_params(self, ctx):
        for param in self.params:  # typer adds them after the group is made
            if param.opts and param.opts[0] in SHELL_OPTIONS:
                param.metavar, param.help = "[SHELL]", SHELL_OPTIONS[param.opts[0]]
        return super().get_params(ctx)


app = typer.Typer(cls=Root, add_completion=True, no_args_is_help=True, rich_markup_mode=None,
                  pretty_exceptions_enable=False, context_settings={"help_option_names": ["-h", "--help"]},
                  help="Render MiniMax-H3 clips (video with a stereo soundtrack) from a prompts file.")
presets_app = typer.Typer(cls=PlainGroup, invoke_without_command=True, subcommand_metavar="[COMMAND [ARGS]...]",
                          help="List and inspect presets (alone: list them).")
app.add_typer(presets_app, name="presets")


def fail(error: H3genError) -> None:
    from h3gen.errors import debugging
    from h3gen.text import shown

    if debugging():  # where the failure came from, else where it was refused
        traceback.print_exception(error.__cause__ or error, file=sys.stderr)
    for each in (error, *error.also):
        typer.echo(f"h3gen: error: {shown(str(each))}", err=True)
    raise typer.Exit(error.exit_code)


def from_model_variable(ctx: typer.Context, model: Path | None, error: H3genError) -> H3genError:
    """An error naming the model directory says so when H3GEN_MODEL gave it, not --model: the command line the user
    reads then does not show it."""
    source = ctx.get_parameter_source("model")
    if model is None or getattr(source, "name", None) != "ENVIRONMENT":  # typer's own click's enum
        return error
    given, words = model.expanduser(), f" {error.problem} "
    if not any(f" {path}{end}" in words for path in {given, given.absolute(), given.resolve()} for end in " /"):
        return error  # the directory, or a file in it, as a word of its own
    named = type(error)(f"H3GEN_MODEL: {error.problem}", error.fix)
    named.__cause__ = error.__cause__ or error  # where it came from, for --traceback
    return named


def show_tracebacks(wanted: bool) -> None:
    """--traceback: failures print where they came from besides their one line, in this process and its workers."""
    if wanted:
        os.environ["H3GEN_DEBUG"] = "1"


VRAM_HELP = ("Device memory budget in GiB, as 24, 24G or 24GB (default, or 0: what is free on the GPU as the run "
             "starts; a budget above that plans for what is free; a card's size as sold is taken, up to a tenth "
             "above the size the GPU reports, more is refused): DiT blocks beyond it stream from pinned host memory, "
             "and the allocator is held to it. For a GPU: on the CPU only 0 is taken.")
TRACEBACK_HELP = "Print a failure's traceback besides its one line (also H3GEN_DEBUG=1)."


def strict_plugins_option(flag: bool) -> bool:
    """--strict-plugins, or H3GEN_STRICT_PLUGINS read here (not by Click), so a value it cannot take is one line."""
    text = os.environ.get("H3GEN_STRICT_PLUGINS", "").strip().lower()
    if text not in ("", "0", "false", "no", "off", "1", "true", "yes", "on"):
        fail(UsageError(f"H3GEN_STRICT_PLUGINS is '{text}', not a yes or a no",
                        "set it to 1 (or true, yes, on) or 0 (or false, no, off), or unset it"))
    return flag or text in ("1", "true", "yes", "on")


StrictPlugins = Annotated[bool, typer.Option("--strict-plugins", callback=strict_plugins_option,
                                             help="Stop when a plugin fails to load or to register instead of "
                                                  "skipping it (also H3GEN_STRICT_PLUGINS=1).")]


def output_directory(text: str | Path) -> Path:
    """-o as given: an empty one (an unset variable in a script, `-o "$OUT"`) is refused rather than read as `.`;
    the default comes as a Path already."""
    if isinstance(text, str) and not text.strip():
        fail(UsageError("-o is empty", "give the directory to write to; for this one, -o ."))
    return Path(text)


def vram_setting(text: str | None) -> list[str]:
    """`--vram` as the override it stands for: a number of GiB, with G, GB or GiB after it or not (a card sold as
    24 GB has 24 GiB)."""
    import re

    if text is None:
        return []
    found = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*(?:g|gb|gib)?\s*", text, re.IGNORECASE)
    if not found:
        below = re.fullmatch(r"\s*-\s*0*[1-9.][\d.]*\s*(?:g|gb|gib)?\s*", text, re.IGNORECASE)
        what = "below 0" if below else "not a number of GiB"
        said = f"--vram {text} is {what}" if text.strip() else "--vram is empty"
        raise UsageError(said, "give one like 24, 24G or 24GB, or 0 for what is free")
    return [f"runtime.vram_gib={float(found.group(1)):g}"]


def request_setting(size: str | None, duration: float | None) -> list[str]:
    """`--size` and `--duration` as the overrides they stand for, checked as a prompt's own are."""
    from h3gen.inputs.prompts import check_duration, check_size, parse_size

    settings = []
    if size is not None:
        width, height = parse_size(size)
        check_size(width, height, f"--size {size}")
        settings += [f"request.width={width}", f"request.height={height}"]
    if duration is not None:
        check_duration(duration, f"--duration {duration:g}")
        settings.append(f"request.duration={duration:g}")
    return settings


def version_callback(ctx: typer.Context, value: bool):
    if value and not ctx.resilient_parsing:  # not while the shell completes the words after it
        typer.echo(f"h3gen {__version__}")
        raise typer.Exit()


@app.callback()
def main_options(version: Annotated[bool, typer.Option("--version", callback=version_callback, is_eager=True,
                                                       help="Print the version and exit.")] = False):
    """Render MiniMax-H3 clips (video with a stereo soundtrack) from a prompts file."""
    try:
        check_allocator_config()
    except H3genError as e:
        fail(e)


@app.command(cls=PlainCommand)
def render(
    ctx: typer.Context,
    prompts: Annotated[Path, typer.Argument(metavar="PROMPTS",
                                            help="Prompts file: one prompt per line, or JSON Lines; - reads "
                                                 "standard input.")],
    output: Annotated[Path, typer.Option("-o", "--output", metavar="DIR", parser=output_directory,
                                         help="Directory the MP4s are written to.")] = Path("out"),
    preset: Annotated[Optional[str], typer.Option("--preset", metavar="NAME|FILE", autocompletion=preset_names,
                                                  help="Preset name or TOML file (default: h3-base with "
                                                       "--model or H3GEN_MODEL, else tiny).")] = None,
    model: Annotated[Optional[Path], typer.Option("--model", envvar="H3GEN_MODEL", metavar="DIR",
                                                  help="MiniMax-H3 repository directory (default: embedded tiny "
                                                       "model).")] = None,
    seed: Annotated[int, typer.Option("--seed", metavar="N",
                                      help="Base seed; a clip's seed is this plus its index.")] = 0,
    size: Annotated[Optional[str], typer.Option("--size", metavar="WxH",
                                                help="WIDTHxHEIGHT of the clips whose line gives none (as --set "
                                                     "request.width=W --set request.height=H); a line with a keyframe "
                                                     "and no size takes the keyframe's aspect ratio on this canvas "
                                                     "(its short edge and area).  [default: the preset's]")] = None,
    duration: Annotated[Optional[float], typer.Option("--duration", metavar="SECONDS",
                                                      help="Seconds, 5 to 15, of the clips whose line gives none (as "
                                                           "--set request.duration=S).  [default: the "
                                                           "preset's]")] = None,
    overrides: Annotated[Optional[list[str]], typer.Option("--set", metavar="SECTION.KEY=VALUE",
                                                           autocompletion=set_keys,
                                                           help="Override a preset value.")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON line per finished clip on stdout.")] = False,
    quiet: Annotated[bool, typer.Option("-q", "--quiet", help="On stderr only what needs someone: warnings (a "
                                                              "clip found damaged among them), the counts with a "
                                                              "line for each clip failed or in conflict, a stop. A "
                                                              "run that went well prints nothing there (for "
                                                              "cron).")] = False,
    vram: Annotated[Optional[str], typer.Option("--vram", metavar="GIB", help=VRAM_HELP)] = None,
    save_latents: Annotated[bool, typer.Option("--save-latents", help="Also write each clip's final latents (NAME.latents"
                                                                      ".safetensors, stamped as the clip is); a rerun "
                                                                      "with it renders again a clip whose latents are "
                                                                      "missing, damaged or of other settings, and a "
                                                                      "clip rendered again without it takes its old "
                                                                      "latents away.")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print each prompt's output file and whether it would "
                                                            "render, skip or conflict (or finds it busy); render and "
                                                            "change nothing. Exits 1 when a clip would conflict, or "
                                                            "the output disk has less free than any clip takes "
                                                            "(64 KiB) or no free inode, as the run would.")] = False,
    force: Annotated[bool, typer.Option("--force", help="Render every clip again, over whatever file is at its "
                                                        "name: a valid clip (by default skipped), one rendered with "
                                                        "other settings or a file h3gen did not write (by default "
                                                        "left alone as conflicts).")] = False,
    redo_conflicts: Annotated[bool, typer.Option("--redo-conflicts", help="Render again the clips whose file h3gen "
                                                                          "rendered with other settings (by default "
                                                                          "they are left alone and the run exits 1); "
                                                                          "clips with these settings are still "
                                                                          "skipped.")] = False,
    strict_plugins: StrictPlugins = False,
    shard: Annotated[Optional[str], typer.Option("--shard", metavar="I/N",
                                                 help="Render only shard I of N (0-based): the prompts whose place "
                                                      "in the file (0-based, comments and blank lines not counted) "
                                                      "is I modulo N. For independent runs splitting one "
                                                      "file.")] = None,
    gpus: Annotated[Optional[int], typer.Option("--gpus", metavar="N",
                                                help="Render with N GPU workers (torchrun, NCCL), each on its own "
                                                     "GPU.")] = None,
    cpu_workers: Annotated[Optional[int], typer.Option("--cpu-workers", metavar="N",
                                                       help="Render with N CPU worker processes (torchrun, "
                                                            "gloo).")] = None,
    ulysses: Annotated[Optional[int], typer.Option("--ulysses", metavar="K",
                                                   help="Ranks per clip (Ulysses sequence parallelism); default: "
                                                        "chosen from the worker and prompt counts.")] = None,
    nnodes: Annotated[Optional[int], typer.Option("--nnodes", metavar="M",
                                                  help="Machines in a multi-node run (torchrun --nnodes).")] = None,
    node_rank: Annotated[Optional[int], typer.Option("--node-rank", metavar="R",
                                                     help="This machine's number, 0 to nnodes-1 (static rendezvous; "
                                                          "omit for c10d).")] = None,
    rdzv_endpoint: Annotated[Optional[str], typer.Option("--rdzv-endpoint", metavar="HOST:PORT",
                                                         help="Where the machines of a multi-node run meet.")] = None,
    rdzv_id: Annotated[Optional[str], typer.Option("--rdzv-id", metavar="ID",
                                                   help="Job id shared by the machines of one multi-node "
                                                        "run.")] = None,
    tracebacks: Annotated[bool, typer.Option("--traceback", help=TRACEBACK_HELP)] = False,
):
    """Render one MP4 per prompt.

    \b
    Examples:
      h3gen render prompts.txt -o out/
      h3gen render prompts.txt -o out/ --model ~/models/MiniMax-H3 --set sampler.steps=25 --json
      h3gen render prompts.txt -o out/ --model ~/models/MiniMax-H3 --size 768x1344 --duration 10
      h3gen render prompts.txt -o out/ --dry-run
    """
    began = time.time()  # the run's wall time counts from here, in one process or in workers
    show_tracebacks(tracebacks)
    from h3gen.cli.render import run_render
    from h3gen.inputs.prompts import parse_shard
    from h3gen.run.settings import Parallel, RunSettings

    prompts = Path("/dev/stdin") if str(prompts) == "-" else prompts
    try:
        check_threads()
        if json_out and "stdout" in CLOSED_STREAMS:
            raise UsageError("--json with standard output closed: its lines would go nowhere",
                             "give standard output a file or a pipe, or leave out --json")
        if str(prompts) == "/dev/stdin" and "stdin" in CLOSED_STREAMS:
            raise UsageError("prompts from standard input (-), which is closed",
                             "pipe the prompts in, or give the prompts file's path")
        if preset is not None and not preset.strip():
            raise UsageError("--preset is empty", "give a preset name or file, or leave --preset out")
        if force and redo_conflicts:
            raise UsageError("--force and --redo-conflicts both given",
                             "--force renders every clip again, --redo-conflicts only those from other settings: "
                             "keep one")
        preset = preset or ("h3-base" if model is not None else "tiny")
        overrides = [*request_setting(size, duration), *(overrides or ()), *vram_setting(vram)]
        settings = RunSettings(prompts, output, preset, model, seed, tuple(overrides), json_out, save_latents,
                               force, strict_plugins, parse_shard(shard) if shard is not None else None,
                               Parallel(gpus, cpu_workers, ulysses, nnodes, node_rank, rdzv_endpoint, rdzv_id),
                               dry_run, redo_conflicts, quiet)
        code = run_render(settings, began)
    except H3genError as e:
        fail(from_model_variable(ctx, model, e))
    raise typer.Exit(code)


@app.command(cls=PlainCommand)
def bench(
    ctx: typer.Context,
    presets: Annotated[Optional[list[str]], typer.Option("--preset", metavar="NAME|FILE", autocompletion=preset_names,
                                                         help="Preset to measure; h3-base when none is given.")] = None,
    baseline: Annotated[str, typer.Option("--baseline", metavar="NAME", autocompletion=baseline_names,
                                          help="Baseline preset; 'none' for no baseline.")] = "diffusers",
    durations: Annotated[Optional[str], typer.Option("--durations", metavar="S,...",
                                                     help="Media seconds, comma-separated (5, 10, 15).  [default: "
                                                          "10; 5 on the tiny model]", show_default=False)] = None,
    size: Annotated[Optional[str], typer.Option("--size", metavar="WxH", help="WIDTHxHEIGHT.  [default: 1344x768; "
                                                                             "32x32 on the tiny model]",
                                                show_default=False)] = None,
    repeat: Annotated[int, typer.Option("--repeat", metavar="N", min=1, help="Timed runs per stage.")] = 3,
    warmup: Annotated[int, typer.Option("--warmup", metavar="N", min=0, help="Untimed runs per stage first (with "
                                                                             "--batch: untimed clips).")] = 1,
    random_weights: Annotated[Optional[str], typer.Option("--random-weights", metavar="full|tiny",
                                                          autocompletion=random_weights,
                                                          help="full (real sizes, random) or tiny.")] = None,
    model: Annotated[Optional[Path], typer.Option("--model", envvar="H3GEN_MODEL", metavar="DIR",
                                                  help="Model directory. Refused with --random-weights, which "
                                                       "stand in for it (H3GEN_MODEL is then not read).")] = None,
    stages: Annotated[str, typer.Option("--stages", metavar="STAGE,...", autocompletion=bench_stages,
                                        help="Stages to time: encode,dit,vae,mux.")] = "encode,dit,vae,mux",
    forwards: Annotated[Optional[int], typer.Option("--forwards", metavar="K", min=1,
                                                    help="Time K DiT forwards and scale to the preset's "
                                                         "count.")] = None,
    text_tokens: Annotated[int, typer.Option("--text-tokens", metavar="N", min=1,
                                             help="Prompt length in tokens.")] = 256,
    output: Annotated[Path, typer.Option("-o", "--output", metavar="DIR", parser=output_directory,
                                         help="Results directory.")] = Path("h3gen-bench"),
    batch: Annotated[Optional[int], typer.Option("--batch", metavar="N", min=1,
                                                 help="Render N clips per preset as `render` does and time the batch "
                                                      "instead.")] = None,
    warm_cache: Annotated[bool, typer.Option("--warm-cache", help="With --batch: run each batch twice over one "
                                                                  "fresh embedding cache, cold then warm.")] = False,
    baseline_clips: Annotated[Optional[int], typer.Option("--baseline-clips", metavar="N", min=1,
                                                          help="With --batch: clips the baseline renders (default: "
                                                               "the batch's N).")] = None,
    baseline_forwards: Annotated[Optional[int], typer.Option("--baseline-forwards", metavar="K", min=1,
                                                             help="With --batch: DiT forwards per baseline clip "
                                                                  "(default: --forwards).")] = None,
    vram: Annotated[Optional[str], typer.Option("--vram", metavar="GIB", help=VRAM_HELP + " On the "
                                                  "measured presets, not the baseline.")] = None,
    sets: Annotated[Optional[list[str]], typer.Option("--set", metavar="SECTION.KEY=VALUE", autocompletion=set_keys,
                                                      help="Override a preset value in every measured preset, not "
                                                           "the baseline (model.needs=any reaches it too).")] = None,
    tracebacks: Annotated[bool, typer.Option("--traceback", help=TRACEBACK_HELP)] = False,
    strict_plugins: StrictPlugins = False,
):
    """Time presets against the diffusers baseline, stage by stage; write JSON, a markdown table and a chart.
    With --batch N: N clips through the renderer per preset (the baseline clip by clip), the time each clip adds
    beyond its DiT, and clips per hour.

    \b
    Example:
      h3gen bench --preset tiny --baseline none --random-weights tiny
    """
    from h3gen.cli.bench import run_bench_command
    from h3gen.cli.ui import plugin_registry

    show_tracebacks(tracebacks)
    found = plugin_registry()
    report_failed_plugins(found, strict_plugins)
    try:
        check_threads()
        model = bench_model(ctx, model, random_weights)
        code = run_bench_command(presets or ["h3-base"], baseline, durations, size, repeat, warmup, random_weights,
                                 model, stages, forwards, text_tokens, output, batch, warm_cache, baseline_clips,
                                 [*(sets or ()), *vram_setting(vram)], baseline_forwards, found)
    except H3genError as e:
        fail(from_model_variable(ctx, model, e))
    raise typer.Exit(code)


def bench_model(ctx: typer.Context, model: Path | None, random_weights: str | None) -> Path | None:
    """--model, unless random weights stand in for it: H3GEN_MODEL is then not read (said once), and --model given
    with them is refused, as it would not be read either."""
    if model is None or random_weights is None:
        return model
    if getattr(ctx.get_parameter_source("model"), "name", None) == "ENVIRONMENT":
        typer.echo(f"h3gen: note: H3GEN_MODEL is not read with --random-weights {random_weights}", err=True)
        return None
    raise UsageError(f"--model and --random-weights {random_weights} both given: the random weights stand in for the "
                     "model, and nothing is read from its directory", "leave out one of them")


@app.command(cls=PlainCommand)
def validate(
    files: Annotated[list[Path], typer.Argument(metavar="FILE", help="MP4 files to check, or directories: their "
                                                                     "clips.")],
    frames: Annotated[Optional[int], typer.Option("--frames", metavar="N", min=1, help="Expected frame count "
                                                  "(without it, any count H3 renders: 17n+5).")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON line per file on stdout: path, ok, "
                                                          "problems.")] = False,
):
    """Check that clips are valid MP4s: one H.264 stream at 24 fps, one AAC stereo stream at 32 kHz, matching
    durations, not blank or silent; and, where the manifest.jsonl beside a clip recorded its bytes, unchanged since
    h3gen wrote it.
    Every file is checked, and every .mp4 in a directory named (but the hidden ones a run is still writing); a line
    each, "ok" on stdout, "INVALID" on stderr; exit 0 when all are valid, 1 when one is not, 2 when one does not exist
    (a link to nothing included, or a directory without clips). A clip cut
    short, or stamped by h3gen and damaged since, is one that the render which wrote it renders again: its line
    says so.

    \b
    Example:
      h3gen validate out/ --frames 124
    """
    import json

    from h3gen.run.outputs import changed_since_written, clips_in, written_sha256
    from h3gen.run.resume import rendered_again
    from h3gen.run.validate import not_an_mp4, validate_clip
    from h3gen.text import shown

    bad = missing = 0
    for path in (clip for named in files for clip in (named.is_dir() and clips_in(named, files_only=False)) or [named]):
        if not path.exists():  # not a clip at all
            missing += 1
            problems = [f"does not exist (a link to {path.readlink()}, which is missing)" if path.is_symlink()
                        else "does not exist"]
        elif path.is_dir():
            missing += path in files
            problems = ["is a directory with no .mp4 clips in it" if path in files else "is a directory, not a clip"]
        else:
            problems = validate_clip(path, expected_frames=frames) or changed_since_written(path, written_sha256(path))
            if problems and path.suffix.lower() in (".txt", ".jsonl") and not_an_mp4(path):  # a prompts file
                problems.append(f"a prompts file is checked with h3gen render {shown(str(path))} --dry-run")
            elif problems and rendered_again(path):
                problems.append("the h3gen render that wrote it renders it again when run once more")
        bad += bool(problems)
        if json_out:
            typer.echo(json.dumps({"path": str(path), "ok": not problems, "problems": problems}))
        elif problems:
            typer.echo(f"{shown(str(path))}: INVALID: {shown('; '.join(problems))}", err=True)
        else:
            typer.echo(f"{shown(str(path))}: ok")
        sys.stdout.flush()  # ok lines (stdout) and INVALID ones (stderr) in their order in a log of both
    raise typer.Exit(2 if missing else 1 if bad else 0)


@app.command(cls=PlainCommand)
def compare(
    a: Annotated[Path, typer.Argument(metavar="A", help="An MP4, or a directory of them (say, rendered with a fast "
                                                        "preset).")],
    b: Annotated[Path, typer.Argument(metavar="B", help="The reference: an MP4, or a directory whose clips are matched "
                                                        "to A's by file name, else by the request (prompt, "
                                                        "seed, size, frames), else by that request without "
                                                        "the seed.")],
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON line per pair of clips on stdout, and one "
                                                          "per clip left out.")] = False,
):
    """How far clip A is from clip B: video PSNR and SSIM (mean and worst frame), audio SNR and log-mel distance.
    E.g. render one prompts file with h3-base into ref/ and with h3-base-fast into fast/, then compare them.

    \b
    Example:
      h3gen compare fast/ ref/ --json
    """
    from h3gen.cli.ui import compare_table
    from h3gen.run.compare import compare as compare_clips
    from h3gen.run.compare import pairs
    from h3gen.run.validate import box_problem
    from h3gen.text import shown

    try:
        matched, unmatched = pairs(a, b)
        left_out = []  # {"a", "b", "compared": False, "reason"}: what --json says of the clips not compared
        records, refused, damaged = [], [], []  # pairs that could not be compared; clips that are not whole
        for path in unmatched:
            # A clip cut short carries no readable stamp to match it by: refused as `h3gen validate` refuses it.
            damage = box_problem(path)
            reason = damage or "no single match in the other folder"
            if damage:
                damaged.append(path)
            if matched:  # with no pair at all, the error alone says it
                typer.echo(f"note: {shown(str(path))}: {shown(damage)}; not compared" if damage else
                           f"note: {shown(str(path))} has no single match in the other folder (by file name, by "
                           "prompt, seed, size and frames, or by those but the seed); not compared", err=True)
            side = "a" if path.parent == a else "b"
            left_out.append({"a": None, "b": None, side: str(path), "compared": False, "reason": reason})
        if not matched:
            if json_out:
                json_lines(left_out)
            raise UsageError(f"{a} and {b} hold no MP4s of the same prompts: none of their {len(unmatched)} clips "
                             "matches one in the other folder by file name, by prompt, seed, size and frames, or by "
                             "those but the seed", "compare folders rendered from one prompts file")
        for x, y in matched:
            try:
                records.append(compare_clips(x, y) | {"compared": True})
            except H3genError as e:  # two folders: that pair is left out, the others compared
                if not a.is_dir():
                    raise
                refused.append(e)
                left_out.append({"a": str(x), "b": str(y), "compared": False, "reason": e.problem})
                if len(matched) > 1:  # a lone pair's problem is the error itself
                    typer.echo(f"note: {shown(e.problem)}; not compared", err=True)
        if not records:
            if json_out:  # what was left out, and why, before the error
                json_lines(left_out)
            if len(refused) == 1:
                raise refused[0]
            raise UsageError(f"none of the {len(refused)} matched pairs of {a} and {b} could be compared (the notes "
                             "above say why)", "compare folders rendered from one prompts file at one size and duration")
    except H3genError as e:
        fail(e)
    compare_table(records)
    if json_out:
        json_lines(records + left_out)
    if refused or damaged:
        raise typer.Exit(1)


def json_lines(records: list[dict]) -> None:
    """One JSON line each on stdout; a float that is not finite as a string ("inf": identical frames)."""
    import json

    for record in records:
        typer.echo(json.dumps({k: (str(v) if isinstance(v, float) and not math.isfinite(v) else v)
                               for k, v in record.items()}))


@presets_app.callback()
def presets_alone(ctx: typer.Context):
    """`h3gen presets` alone lists them, as `h3gen presets list` does."""
    if ctx.invoked_subcommand is None:
        with ended_as_sigpipe_ends():
            presets_list()


@presets_app.command("list", cls=PlainCommand)
def presets_list(strict_plugins: StrictPlugins = False):
    """List the presets every plugin registered (h3gen presets alone does too), a plugin's with its name.

    \b
    Example:
      h3gen presets list
    """
    from h3gen.cli.ui import plugin_registry
    from h3gen.config.preset import load_toml
    from h3gen.stages.base import BUILTIN

    found = plugin_registry()
    report_failed_plugins(found, strict_plugins)
    width = max(map(len, found.presets), default=0)
    for name, path in sorted(found.presets.items()):
        try:
            description = load_toml(path).get("description", "")
        except H3genError as e:  # the others are still listed
            description = f"(unusable: {e})"
        origin = found.preset_origins.get(name, BUILTIN)
        typer.echo(f"{name:{width}s} {description}" + (f" (from plugin '{origin}')" if origin != BUILTIN else ""))


@presets_app.command("show", cls=PlainCommand)
def presets_show(
    name: Annotated[str, typer.Argument(metavar="NAME|FILE", autocompletion=preset_names,
                                        help="Preset name or TOML file.")],
    overrides: Annotated[Optional[list[str]], typer.Option("--set", metavar="SECTION.KEY=VALUE",
                                                           autocompletion=set_keys, help="Override a value.")] = None,
    as_toml: Annotated[bool, typer.Option("--toml", help="Print the resolved preset as TOML that resolves back to "
                                                        "the same values: a start for a preset of your own.")] = False,
    strict_plugins: StrictPlugins = False,
):
    """Print a preset's resolved configuration and where each value came from.

    \b
    Example:
      h3gen presets show h3-base --set sampler.steps=25
    """
    from h3gen.config.preset import check_stage_configs, describe, find_preset, preset_label, resolve, toml_value
    from h3gen.config.preset import as_toml as preset_toml
    from h3gen.cli.ui import plugin_registry

    found = plugin_registry()
    report_failed_plugins(found, strict_plugins)
    try:
        resolved = resolve(name, found, overrides or [])
        check_stage_configs(resolved, found)  # what render would refuse is not shown (nor saved)
    except H3genError as e:
        fail(e)
    own = preset_label(resolved.name, find_preset(name, found)[1], found)  # a file's label is its path
    described_by = resolved.sources.get("description", own)
    if described_by != own:  # inherited through extends
        resolved = dataclasses.replace(resolved, description=f"{resolved.description} ({described_by}'s description)")
    if overrides:  # the description was written for the preset as it was; saved, the changes are its own values
        changes = f"{resolved.name} with {', '.join(overrides)}" if as_toml else f"with --set {', '.join(overrides)}"
        resolved = dataclasses.replace(resolved, description=f"{resolved.description} ({changes})")
    if as_toml:
        typer.echo(preset_toml(resolved), nl=False)
        return
    typer.echo(f"# {resolved.name}: {resolved.description}")
    for key, value, source in describe(resolved):
        typer.echo(f"{key:26s} = {toml_value(value):40s} # {source}")


@app.command(cls=PlainCommand)
def plugins(strict_plugins: StrictPlugins = False):
    """List every registered stage with its kind and the plugin it came from.

    \b
    Example:
      h3gen plugins
    """
    from h3gen.cli.ui import plugin_registry

    found = plugin_registry()
    report_failed_plugins(found, strict_plugins)
    rows = [(kind, name, entry.origin, f"{entry.stage.__module__}.{entry.stage.__qualname__}",
             entry.stage.description or "") for (kind, name), entry in sorted(found.stages.items())]
    widths = [max((len(row[column]) for row in rows), default=0) for column in range(4)]
    for *columns, description in rows:  # columns padded to the widest of each, the description last
        line = " ".join(f"{text:{width}s}" for text, width in zip(columns, widths))
        typer.echo(f"{line}  {description}" if description else line.rstrip())


def report_failed_plugins(found, strict: bool) -> None:
    """Each plugin that failed, said as a run says it; with --strict-plugins (H3GEN_STRICT_PLUGINS) the first
    stops the command, as it stops a run."""
    from types import SimpleNamespace

    from h3gen.run.loop import check_plugins

    try:
        check_plugins(found, strict, SimpleNamespace(warn=lambda text: typer.echo(text, err=True)))
    except H3genError as e:
        fail(e)


@app.command(cls=PlainCommand)
def tiny(directory: Annotated[Optional[Path], typer.Argument(metavar="DIR", help="Where to write it (default: user "
                                                                                 "cache).")] = None):
    """Write the embedded tiny random-weight model and print where it is. A copy already there is checked file by
    file and written again when damaged.

    \b
    Example:
      h3gen tiny ./tiny-model
    """
    from h3gen.models.tiny import TINY_NOTICE, ensure_tiny_model
    from h3gen.text import shown

    def repairing(target: Path) -> None:
        typer.echo(f"h3gen: note: the tiny model in {shown(str(target))} is damaged: written again", err=True)

    try:
        typer.echo(str(ensure_tiny_model(directory, on_repair=repairing)))
    except H3genError as e:
        fail(e)
    typer.echo(f"note: {TINY_NOTICE}", err=True)


CLOSED_STREAMS: set[str] = set()  # "stdin", "stdout", "stderr": closed when h3gen started, /dev/null since


def reopen_closed_streams() -> None:
    """Standard streams the shell closed (`2>&-`, `>&-`) get /dev/null: a file h3gen opens later would otherwise take
    their descriptor, and a line meant for the terminal would land in it (an MP4 being written). `--json` then
    refuses to run with nowhere to put its lines, and `-` with no prompts to read."""
    for fd, name in ((0, "stdin"), (1, "stdout"), (2, "stderr")):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDONLY if fd == 0 else os.O_WRONLY)
            if null != fd:
                os.dup2(null, fd)
                os.close(null)
            os.set_inheritable(fd, True)  # as the stream was: a worker, an encoder process inherit it
            setattr(sys, name, open(fd, "r" if fd == 0 else "w", closefd=False, encoding="utf-8",
                                    errors="backslashreplace"))
            CLOSED_STREAMS.add(name)


def main():
    reopen_closed_streams()
    # MKL's matrix products otherwise round differently with the memory layout a process happens to have (an
    # encoder that ran before the DiT changes it): conditional numerical reproducibility keeps one seed one clip.
    os.environ.setdefault("MKL_CBWR", "AUTO")
    # torch's C++ warnings print a stack with each (a store's lost connection on every try): h3gen says what
    # happened in its own line. Read as torch loads, so set before it does.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    # Streamed blocks, row passes and tile batches leave the allocator's fixed segments split into pieces that a
    # later, larger tensor cannot use: under a budget that was the difference between fitting and not (2.8 GiB
    # reserved but unused at the out of memory of a 24 GiB batch). Growable segments map pages where they are needed.
    if not os.environ.get("PYTORCH_ALLOC_CONF") and not os.environ.get("PYTORCH_CUDA_ALLOC_CONF"):
        os.environ["PYTORCH_ALLOC_CONF"] = "expandable_segments:True"
    try:
        app(prog_name="h3gen")
    except Exception as e:  # not bad input but a bug (h3gen's or a plugin's): one line, the details on request
        from h3gen.errors import HOST_MEMORY_FIX, debugging, host_memory_ran_out, one_line

        if debugging():  # where it came from, then the same one line
            traceback.print_exception(e, file=sys.stderr)
        if host_memory_ran_out(e):
            print(f"h3gen: error: out of host memory, {type(e).__name__}: {one_line(str(e))} ({HOST_MEMORY_FIX})",
                  file=sys.stderr)
            sys.exit(1)
        command = next((arg for arg in sys.argv[1:] if not arg.startswith("-")), "")
        where = "--traceback" if command in ("render", "bench") else "H3GEN_DEBUG=1"  # the others have no option
        fix = "report it with the traceback above" if debugging() else \
            f"rerun with {where} for where, and report it"
        print(f"h3gen: error: {type(e).__name__}: {one_line(str(e))} (a bug; {fix})", file=sys.stderr)
        sys.exit(1)
    finally:
        from h3gen.run.memory import exit_soon

        exit_soon()


if __name__ == "__main__":
    main()
