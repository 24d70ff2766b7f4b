"""What the workers tell global rank 0, the one process that reports: events through the torchrun store.

Each group's first rank sends the events of its clips (started, stage times, denoise steps, results, lines to say),
numbered in a stream of its own; rank 0 replays them into its reporter, so the live display, the plain lines and
the --json records look the same with any number of workers. The store rather than a process group: sending never
waits for the reader, and rank 0 reads on a thread of its own while its main thread renders.

A group whose first rank dies (killed, out of memory) sends nothing more: rank 0 stops waiting for it once that
process is gone (on rank 0's machine, where it said its pid), or PUMP_DRAIN_S after rank 0 was itself stopped.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pickle
import signal
import threading
import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

PLAN_KEY = "h3gen/plan"
# Rank 0 reads the prompts file and checks which clips are already written before the others hear the plan.
PLAN_WAIT = timedelta(hours=6)
COMMAND_WAIT = timedelta(minutes=5)  # every rank sends its settings as it starts: they are there long before this
# What the sampler wrote on a clip, sent with each stage's time: a clip whose worker died before it reported the
# clip done is recorded with them.
SAMPLED = ("forwards", "forwards_reused", "attention")
STOP_KEY = "h3gen/stop"  # why machine 0 stopped ("machine 0 was stopped by SIGINT"), for the other machines' workers
PUMP_DRAIN_S = 20  # how long a stopped rank 0 waits for the last results of a group whose first rank it cannot see
BEAT_S = 2  # how often a group's first rank says it is there
ASK_S = 1  # how often rank 0 asks the store after a group of another machine
SILENT_S = 60  # a group on another machine not heard from this long is lost (the machine died, or its network)


class StoreGone(BaseException):
    """The run's store answers no more: the machine holding it (rank 0's, or the c10d endpoint) stopped or died.
    A BaseException, as a stop signal is: the render loop's per-clip `except Exception` lets it through, so the
    clip in flight is discarded rather than recorded as a failed one."""

    def error(self):
        from h3gen.errors import H3genError

        error = H3genError(f"the run's store at {os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')} "
                           "answers no more: the machine that holds it (machine 0) stopped or died",
                           "run the same command again on every machine to render the rest; clips already written "
                           "are kept and skipped")
        error.exit_code = 1
        return error


def connect(timeout: timedelta = timedelta(minutes=30)):
    """A client of the store torchrun's rendezvous set up (MASTER_ADDR:MASTER_PORT), after init_process_group."""
    import torch.distributed as dist

    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=timeout)


def publish_plan(store, plan: dict) -> None:
    # pickle: the plan holds the parsed requests, and goes from this job's rank 0 to its own workers only
    store.set(PLAN_KEY, pickle.dumps(plan))


def receive_plan(store) -> dict:
    store.wait([PLAN_KEY], PLAN_WAIT)
    return pickle.loads(store.get(PLAN_KEY))


def command_key(rank: int) -> str:
    return f"h3gen/command/{rank}"


def publish_command(store, rank: int, settings: dict) -> None:
    """The settings this worker's machine was started with, for rank 0 to compare with its own."""
    store.set(command_key(rank), json.dumps(settings))


def commands_of_others(store, world: int) -> dict[int, dict]:
    """Every other rank's settings as `publish_command` sent them (each rank sends them as it starts)."""
    keys = [command_key(rank) for rank in range(1, world)]
    if keys:
        store.wait(keys, COMMAND_WAIT)
    return {rank: json.loads(store.get(key)) for rank, key in enumerate(keys, start=1)}


def publish_stop(store, why: str) -> None:
    """Stop the other machines' workers: `why` machine 0 stopped, as they say it."""
    if not store.check([STOP_KEY]):
        store.set(STOP_KEY, why)


def machine_key(machine: int | str) -> str:
    return f"h3gen/machine/{machine}"


def tell_machine_ended(store, machine: int, what: str) -> None:
    """A machine's launcher, its workers ended other than by finishing (`what`: "was stopped by SIGINT"), says so
    to rank 0, which stops waiting for that machine's groups; machine 0's stops the others' workers too."""
    store.set(machine_key(machine), what)
    if machine == 0:
        publish_stop(store, f"machine 0 {what}")


def machine_0_stop_file(job: dict) -> Path:
    """The file a worker of another machine than rank 0's writes why machine 0 stopped in, for its launcher to
    say."""
    return Path(job["status_file"]).with_name("stopped-on-machine-0")


# A worker's threads that talk to the store: ended before the worker exits (`end_threads`), since a thread inside
# a store call as the interpreter finalizes aborts the process ("terminate called without an active exception").
_threads: list[threading.Thread] = []
_ending = threading.Event()


def on_a_thread(name: str, target) -> None:
    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    _threads.append(thread)


def end_threads() -> None:
    _ending.set()
    for thread in _threads:
        if thread is not threading.current_thread():
            thread.join(timeout=10)
    _threads.clear()


def stop_with_rank0(job: dict) -> None:
    """On a machine other than rank 0's: stop this worker as a signal would once machine 0 stopped (a Ctrl-C on
    machine 0 reaches only that machine's workers), on a thread that looks for rank 0's word every second."""
    if os.environ["GROUP_RANK"] == "0":
        return

    def watch():
        from torch.distributed import DistError

        try:
            store = connect()
            while not store.check([STOP_KEY]):
                if _ending.wait(1):
                    return
            machine_0_stop_file(job).write_text(store.get(STOP_KEY).decode())
        except DistError:  # the run ended, its store gone
            return
        os.kill(os.getpid(), signal.SIGTERM)

    on_a_thread("h3gen-stop", watch)


def event_key(group: int, number: int) -> str:
    return f"h3gen/event/{group}/{number}"


def leader_key(group: int) -> str:
    return f"h3gen/leader/{group}"


def beat_key(group: int) -> str:
    return f"h3gen/beat/{group}"


def beat(group: int) -> None:
    """Count in the store every BEAT_S while this process lives: rank 0 cannot see a process of another machine."""
    from torch.distributed import DistError

    def count():
        store = connect()
        with contextlib.suppress(DistError):  # the run ended, its store gone
            while True:
                store.add(beat_key(group), 1)
                if _ending.wait(BEAT_S):
                    return

    on_a_thread("h3gen-beat", count)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def result_event(result) -> dict:
    fields = dataclasses.asdict(result)
    fields["request"], fields["path"] = result.request.index, str(result.path)
    return fields


def result_from_event(fields: dict, requests: dict):
    from h3gen.run.records import ClipResult

    return ClipResult(**{**fields, "request": requests[fields["request"]], "path": Path(fields["path"])})


class RemoteReporter:
    """The reporter of a group's first rank other than rank 0: every event goes to rank 0, in order."""

    def __init__(self, store, group: int):
        self.store, self.group, self.sent, self.lost = store, group, 0, False
        store.set(leader_key(group), f"{os.environ['GROUP_RANK']} {os.getpid()}")  # rank 0 sees when it is gone
        beat(group)  # or hears, on another machine

    def send(self, event: dict) -> None:
        """Whole: a stop signal lands after the event is in the store and counted, so none goes missing."""
        from h3gen.run.loop import signals_held

        from torch.distributed import DistError

        if self.lost:  # said once: what the worker does on its way out (close its claims, finish a mux) goes unsaid
            return
        with signals_held():
            try:
                self.store.set(event_key(self.group, self.sent + 1), json.dumps(event))
            except DistError:
                self.lost = True
                raise StoreGone() from None
            self.sent += 1

    def say(self, text: str) -> None:
        self.send({"say": f"{text} ({self.where()})"})

    def warn(self, text: str) -> None:
        self.send({"warn": f"{text} ({self.where()})"})

    def where(self) -> str:
        """The group, and its machine when not rank 0's: a line about a signal there is not about this one."""
        machine = os.environ["GROUP_RANK"]
        return f"group {self.group}" + (f" on machine {machine}" if machine != "0" else "")

    def start(self):
        return self

    def stop(self):
        pass

    def clip_started(self, clip):
        self.send({"started": clip.request.index, "path": str(clip.path)})

    def stage_done(self, clip, kind, seconds):
        self.send({"stage": clip.request.index, "kind": kind, "seconds": seconds, "clip": clip.seconds,
                   **{name: getattr(clip, name) for name in SAMPLED}})

    def step(self, clip, step, steps):
        self.send({"step": clip.request.index, "n": step, "of": steps})

    def clip_done(self, result):
        self.send({"done": result_event(result)})

    def stopped(self, signal_name: str):
        self.send({"stopped": signal_name, "machine": os.environ["GROUP_RANK"]})

    def finished(self):
        self.send({"finished": self.group})


class SharedReporter:
    """Rank 0's reporter, called from the main thread (its own group's clips) and the event thread (the others').

    The display runs from before the first clip of any group to after the last (`begin`, `end`): the render loop's
    own start and stop, which frame only this group's clips, are left out."""

    def __init__(self, reporter):
        self.reporter, self.lock = reporter, threading.RLock()

    def begin(self):
        self.reporter.start()

    def end(self):
        self.reporter.stop()

    def start(self):
        return self

    def stop(self):
        pass

    def __getattr__(self, name):
        method = getattr(self.reporter, name)

        def locked(*args, **kwargs):
            with self.lock:
                return method(*args, **kwargs)

        return locked


class EventPump(threading.Thread):
    """On rank 0: replays the other groups' events into the reporter until each of them has finished or is lost."""

    def __init__(self, reporter, requests: list, groups: range):
        super().__init__(name="h3gen-events", daemon=True)
        self.reporter = reporter
        self.requests = {request.index: request for request in requests}
        self.next = dict.fromkeys(groups, 1)  # group still waited for -> the number of its next event
        self.clips, self.results, self.pids, self.deadline = {}, [], {}, None
        self.gone = {}  # group -> (its machine, what became of it) where rank 0 learnt it from the group itself
        self.words = {}  # machine -> what its launcher said became of its workers
        self.heard = {}  # group -> (its beat count, when it last changed)
        self.asked = {}  # group of another machine -> when rank 0 last asked after it
        self.store = connect()  # a client of its own: the main thread keeps its own

    def run(self):
        while self.next:
            for group in list(self.next):
                lost = self.lost(group)  # before reading: a process gone has sent all it ever will
                while group in self.next:
                    key = event_key(group, self.next[group])
                    if not self.store.check([key]):
                        break
                    event = json.loads(self.store.get(key))
                    self.store.delete_key(key)
                    self.next[group] += 1
                    self.replay(event, group)
                if lost:
                    self.next.pop(group, None)
            time.sleep(0.05)

    def drain(self) -> None:
        """Rank 0 was stopped, and so were the other groups: wait for their last results, PUMP_DRAIN_S at most."""
        self.deadline = time.monotonic() + PUMP_DRAIN_S
        self.join()

    def lost(self, group: int) -> bool:
        """The group's first rank is gone (on this machine), not heard from (on another), or rank 0 stopped waiting
        for it."""
        if group not in self.pids and self.store.check([leader_key(group)]):
            node, pid = self.store.get(leader_key(group)).decode().split()
            self.pids[group] = (int(pid) if node == os.environ["GROUP_RANK"] else None, node)
        pid, node = self.pids.get(group, (None, None))
        if pid is None and self.due(group):
            if node is not None and self.store.check([machine_key(node)]):  # its launcher said why
                self.words[node] = self.store.get(machine_key(node)).decode()
                self.gone[group] = (node, self.words[node])
                return True
            if self.quiet(group):
                self.gone[group] = (node or "?", f"was not heard from for {SILENT_S} s")
                return True
        return (pid is not None and not alive(pid)) or (self.deadline is not None and time.monotonic() > self.deadline)

    def fates(self) -> dict[int, tuple[str, str]]:
        """What became of the groups that stopped short: group -> (its machine, in words). A machine's launcher
        knows best: a group its agent stopped because a sibling died says only that it was stopped by SIGTERM."""
        return {group: (machine, self.words.get(machine, what)) for group, (machine, what) in self.gone.items()}

    def due(self, group: int) -> bool:
        """Once every ASK_S: what a group of another machine has to say comes through the store, at a question each."""
        now = time.monotonic()
        if now - self.asked.get(group, float("-inf")) < ASK_S:
            return False
        self.asked[group] = now
        return True

    def quiet(self, group: int) -> bool:
        """Not heard from for SILENT_S: neither its first rank's beat nor, before that rank said where it runs, a
        word since rank 0 began waiting."""
        count, since = self.heard.get(group, (None, time.monotonic()))
        now = self.store.add(beat_key(group), 0)
        if now != count:
            self.heard[group] = (now, time.monotonic())
            return False
        return time.monotonic() - since > SILENT_S

    def unreported(self) -> list:
        """The clips started and never reported: discarded in flight by a stopped group, or written or not by one
        whose worker died before it said so (rank 0 looks on disk)."""
        return list(self.clips.values())

    def replay(self, event: dict, group: int) -> None:
        if "say" in event:
            self.reporter.say(event["say"])
        elif "warn" in event:
            self.reporter.warn(event["warn"])
        elif "started" in event:
            clip = self.clip(event["started"], event["path"])
            self.reporter.clip_started(clip)
        elif "stage" in event:
            clip = self.clips.get(event["stage"]) or self.clip(event["stage"], "")
            clip.seconds = event["clip"]
            clip.__dict__.update({name: event[name] for name in SAMPLED if name in event})
            self.reporter.stage_done(clip, event["kind"], event["seconds"])
        elif "step" in event:
            clip = self.clips.get(event["step"]) or self.clip(event["step"], "")
            self.reporter.step(clip, event["n"], event["of"])
        elif "done" in event:
            result = result_from_event(event["done"], self.requests)
            self.clips.pop(result.request.index, None)
            self.results.append(result)
            self.reporter.clip_done(result)
        elif "stopped" in event:
            self.gone[group] = (event["machine"], f"was stopped by {event['stopped']}")
        elif "finished" in event:
            del self.next[group]

    def clip(self, index: int, path: str):
        """What a reporter reads of a clip: its request, file and stage times so far."""
        clip = SimpleNamespace(request=self.requests[index], path=Path(path), seconds={}, forwards=0,
                               forwards_reused=0, attention="")
        self.clips[index] = clip
        return clip
