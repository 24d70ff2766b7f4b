"""What a worker does between init_process_group and exit: hear the plan, join its group, render, report."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import time
from pathlib import Path

from h3gen.parallel import events
from h3gen.parallel.layout import Layout, choose_layout
from h3gen.run.report import SilentReporter
from h3gen.run.settings import RunSettings


class Worker:
    def __init__(self, job: dict, device: str, make_reporter):
        import torch.distributed as dist

        self.job, self.device, self.make_reporter = job, device, make_reporter
        self.settings = RunSettings.from_json(job["settings"])
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.per_node = int(os.environ["LOCAL_WORLD_SIZE"])
        self.store = events.connect()
        self.batch = None  # rank 0's checked run
        self.began = time.time()  # a clip file older than this is not this run's (--force redoes it in place)

    def run(self) -> int:
        if self.rank:
            events.publish_command(self.store, self.rank, command_of(self.settings))
        plan = self.make_plan() if self.rank == 0 else events.receive_plan(self.store)
        if "error" in plan:  # rank 0 stopped at its checks and reports why; another machine's command says it too
            if plan.get("problem") and self.rank // self.per_node and not int(os.environ.get("LOCAL_RANK", 0)):
                from h3gen.errors import H3genError

                error = H3genError(plan["problem"])
                error.exit_code = plan["exit_code"]
                raise error
            return 0
        layout, pending = Layout(*plan["layout"]), plan["pending"]
        index = layout.group_of(self.rank)
        leader = layout.ranks_of(index)[0]
        group = make_groups(layout, index)
        share = pending[index::layout.groups]
        if self.rank == 0:
            return self.report(layout, pending, plan["finished"], share, group)
        from h3gen.run.loop import Interrupted

        events.stop_with_rank0(self.job)
        reporter = events.RemoteReporter(self.store, index) if self.rank == leader else SilentReporter()
        try:
            self.render(share, reporter, group, leader)
        except Interrupted as stop:  # rank 0 may run on another machine, which this signal did not reach
            if self.rank == leader:
                reporter.stopped(stop.signal_name)
            raise
        finally:
            if self.rank == leader:
                reporter.finished()
        return 0

    def make_plan(self) -> dict:
        """Rank 0 checks the run as a one-process run would, with the same reporter, and publishes the plan."""
        from h3gen.run.loop import prepare, say_to_render, skip_finished

        job, settings, planned = self.job, self.settings, {}

        def announce(pending: list) -> None:  # the layout, then the header, before the lines of clips already there
            heads = job["heads"] if not job["split_refusal"] else 1
            layout = choose_layout(self.world, self.per_node, len(pending), heads, settings.parallel.ulysses or 0)
            # Why the clips are not split, where the layout would have split them
            unsplit = job["split_refusal"] and choose_layout(self.world, self.per_node, len(pending), job["heads"],
                                                             settings.parallel.ulysses or 0).ulysses > 1
            why = f" (no Ulysses: {job['split_refusal']})" if unsplit else ""
            worker = "GPU" if job["device"] == "gpu" else "CPU worker"
            if pending:  # a run with nothing to render has no layout to tell
                self.batch.reporter.say(f"h3gen: layout {layout.describe(worker, len(pending))}{why}")
            say_to_render(self.batch, settings, pending, f", {self.world} worker(s)")
            planned.update(layout=layout, pending=pending)

        try:
            check_same_command(command_of(settings), events.commands_of_others(self.store, self.world))
            preset, found = self.preset()
            # rank 0 reports the run from the command's start, the launcher's and torchrun's time included
            make_reporter = functools.partial(self.make_reporter, since=job["began"], quiet=settings.quiet)
            self.batch = prepare(settings, preset, found, make_reporter)
            self.batch.reporter = events.SharedReporter(self.batch.reporter)
            finished = skip_finished(self.batch, settings, announce)
        except BaseException as e:
            from h3gen.errors import H3genError

            said = {"problem": str(e), "exit_code": e.exit_code} if isinstance(e, H3genError) else {}
            events.publish_plan(self.store, {"error": True, **said})
            raise
        layout, pending = planned["layout"], planned["pending"]
        events.publish_plan(self.store, {"layout": (layout.groups, layout.ulysses), "pending": pending})
        return {"layout": (layout.groups, layout.ulysses), "pending": pending, "finished": finished}

    def preset(self):
        from h3gen.plugins.manager import registry
        from h3gen.config.preset import resolve

        found = registry()
        preset = resolve(self.settings.preset, found, list(self.settings.overrides))
        preset.runtime["device"] = self.device  # this worker's own GPU (cuda:LOCAL_RANK), or the CPU
        return preset, found

    def render(self, share: list, reporter, group, leader: int) -> list:
        from h3gen.models.repo import ModelRepo
        from h3gen.run.loop import render_pending

        if not share:
            return []  # a group with nothing to do loads nothing
        if self.batch is not None:
            preset, found, repo = self.batch.preset, self.batch.found, self.batch.repo
            preset.runtime["device"] = self.device
            plan = self.batch.memory_plan
        else:
            from h3gen.models.tiny import ensure_tiny_model
            from h3gen.run.budget import planned

            preset, found = self.preset()
            repo = ModelRepo(self.settings.model or ensure_tiny_model())
            plan = planned(preset, share, repo, self.device)  # each rank streams its own copy, on its own GPU
        results = render_pending(share, self.settings, preset, found, repo, reporter, group, leader, plan)
        if group is not None:
            import torch.distributed as dist

            # A collective can return on one rank before its messages are through (gloo's gather on the sender);
            # the group meets before any of its ranks tears the process group down.
            dist.barrier(group=group)
        return results

    def report(self, layout: Layout, pending: list, finished: list, share: list, group) -> int:
        """Rank 0: render its own group's share while a thread replays the other groups' events; then the
        summary, and for the launcher the run's exit status and the clips in flight a stop discarded."""
        from h3gen.errors import H3genError
        from h3gen.run.loop import Interrupted, report_end, summary_before

        reporter = self.batch.reporter
        pump = events.EventPump(reporter, pending, range(1, layout.groups)) if layout.groups > 1 else None
        reporter.begin()
        if pump:
            pump.start()
        results, stopped, ended = [], None, None
        try:
            results = self.render(share, reporter, group, 0)
            if pump:
                pump.join()
        except Interrupted as stop:  # in its own render, or while it waited for the others
            results, stopped = results + stop.results, stop
            events.publish_stop(self.store, f"machine 0 was stopped by {stop.signal_name}")  # the others stop too
            if pump:  # the other groups were stopped too: their last results are on the way
                pump.drain()
        except H3genError as error:  # its group lost a rank, say: the launcher names the first failure after this
            ended = error
        finally:
            reporter.end()
        if ended is not None:
            summary_before(ended, reporter, finished + (pump.results if pump else []), len(self.batch.requests))
            raise ended
        discarded = stopped.discarded if stopped else 0
        if pump:
            unreported = pump.unreported()
            written = self.written_unreported(unreported)
            results += pump.results + written
            discarded += len(unreported) - len(written)
        results = finished + results
        code = report_end(reporter, results, len(self.batch.requests), stopped, say_stopped=False)
        unfinished = len(self.batch.requests) - len(results)
        if unfinished and not stopped and pump and pump.gone:  # another machine's workers stopped or went silent
            reporter.warn(lost_elsewhere(pump.fates(), unfinished))
            code = code or 1
        Path(self.job["status_file"]).write_text(f"{code} {discarded} {unfinished}")
        if stopped:
            raise stopped
        return 0

    def written_unreported(self, clips: list) -> list:
        """Of the clips another group started and never reported, those whose file is there, whole and from this
        run (written by a worker that died before it said so): recorded and counted as written. What a dead worker
        left beside them (a partial file, a lock) goes."""
        from h3gen.run import outputs
        from h3gen.run.resume import already_done, clip_name
        from h3gen.stages.clip import PIPELINE

        batch, output = self.batch, self.settings.output
        written = []
        for clip in clips:
            path = output / clip_name(clip.request, batch.preset.name)
            outputs.clear_leftovers(path)
            if not path.is_file() or path.stat().st_mtime < self.began:
                continue
            found = already_done(clip.request, output, batch.preset.name, self.settings.save_latents, batch.run_fields)
            if found is None or found.status != "skipped":
                continue
            result = dataclasses.replace(found, skipped=False, status="ok", seconds=clip.seconds,
                                         end_to_end=sum(clip.seconds.get(kind, 0.0) for kind in PIPELINE),
                                         **{name: getattr(clip, name) for name in events.SAMPLED})
            result = outputs.recorded(output, result, batch.preset.name)
            batch.reporter.clip_done(result)
            written.append(result)
        return written


def lost_elsewhere(gone: dict[int, tuple[str, str]], unfinished: int) -> str:
    """The line of a run whose other groups stopped in a way rank 0's launcher does not see: a signal on another
    machine (a Ctrl-C there), or a machine not heard from. `gone`: group -> (its machine, what became of it)."""
    alike = {}  # (machine, what became of it) -> its groups
    for group, fate in sorted(gone.items()):
        alike.setdefault(fate, []).append(str(group))
    which = "; ".join(f"{'group' if len(groups) == 1 else 'groups'} {and_list(groups)} on machine {machine} {what}"
                      for (machine, what), groups in alike.items())
    return (f"h3gen: {unfinished} clip{'s' if unfinished > 1 else ''} not rendered: {which}; run the same command "
            "again on every machine to render them (clips already written are kept and skipped)")


def and_list(words: list[str]) -> str:
    """'2', '2 and 3', '2, 3 and 4'."""
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} and {words[-1]}"


# How a setting is given on the command line, for the keys of RunSettings that differ between machines.
OPTION = {"prompts": "the prompts file's bytes", "output": "-o", "preset": "--preset", "model": "--model",
          "seed": "--seed", "overrides": "--set", "save_latents": "--save-latents", "force": "--force",
          "shard": "--shard", "dry_run": "--dry-run", "redo_conflicts": "--redo-conflicts",
          "strict_plugins": "--strict-plugins"}
# What a machine may give on its own: its --node-rank, its working directory, how its own lines are drawn.
OWN = ("cwd", "quiet", "json_out", "node_rank", "named")


def command_of(settings: RunSettings) -> dict:
    """The settings every machine of a run must share, by option name; the prompts file by its bytes' digest (a
    piped one is held in a file of each machine's own), -o and --model as absolute paths (each machine gives its own
    working directory, which the worker is in)."""
    import hashlib

    try:
        prompts = hashlib.sha256(settings.prompts.read_bytes()).hexdigest()[:12]
    except OSError as e:
        prompts = f"unreadable ({e.strerror})"
    model = os.path.abspath(settings.model) if settings.model else None
    given = {**settings.to_json(), "prompts": prompts, "output": os.path.abspath(settings.output), "model": model}
    shared = {OPTION.get(key, key): value for key, value in given.items() if key not in (*OWN, "parallel")}
    shared.update({f"--{key.replace('_', '-')}": value for key, value in given["parallel"].items() if key not in OWN})
    return json.loads(json.dumps(shared))  # as another rank's arrive: lists, not tuples


def check_same_command(mine: dict, others: dict[int, dict]) -> None:
    """Refuse a run whose machines were started with different settings (`command_of` each): each would render its
    share of rank 0's clips its own way, into its own -o."""
    from h3gen.errors import UsageError

    for rank, theirs in sorted(others.items()):
        differ = [f"{name} {shown_value(mine[name])} against {shown_value(theirs.get(name))}"
                  for name in mine if theirs.get(name) != mine[name]]
        if differ:
            raise UsageError(f"the machines of workers 0 and {rank} were started with different settings "
                             f"({'; '.join(differ)})",
                             "run the same command on every machine: only --node-rank differs")


def shown_value(value) -> str:
    if isinstance(value, list):
        return " ".join(map(str, value)) if value else "none"
    return "none" if value is None else str(value)


def make_groups(layout: Layout, index: int):
    """Every rank creates every group (torch.distributed asks all ranks to enter new_group), keeping its own.
    No group for k = 1: a lone rank renders exactly as a one-process run does."""
    import torch.distributed as dist

    if layout.ulysses == 1:
        return None
    groups = [dist.new_group(layout.ranks_of(g)) for g in range(layout.groups)]
    return groups[index]

