"""What the workers tell global rank 0, the one process that reports: events through the torchrun store.

Each group's first rank sends the events of its clips (started, stage times, denoise steps, results, lines to say);
rank 0 replays them into its reporter, so the live display, the plain lines and the --json records look the same
with any number of workers. The store rather than a process group: sending never waits for the reader, and rank 0
reads on a thread of its own while its main thread renders.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import threading
import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

PLAN_KEY, COUNT_KEY = "h3gen/plan", "h3gen/events"
# Rank 0 reads the prompts file and checks which clips are already written before the others hear the plan.
PLAN_WAIT = timedelta(hours=6)


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


def send(store, event: dict) -> None:
    number = store.add(COUNT_KEY, 1)
    store.set(f"h3gen/event/{number}", json.dumps(event))


def result_event(result) -> dict:
    fields = dataclasses.asdict(result)
    fields["request"], fields["path"] = result.request.index, str(result.path)
    return fields


def result_from_event(fields: dict, requests: dict):
    from h3gen.run.render import ClipResult

    return ClipResult(**{**fields, "request": requests[fields["request"]], "path": Path(fields["path"])})


class RemoteReporter:
    """The reporter of a group's first rank other than rank 0: every event goes to rank 0."""

    def __init__(self, store, group: int):
        self.store, self.group = store, group

    def say(self, text: str) -> None:
        send(self.store, {"say": f"{text} (group {self.group})"})

    def start(self):
        return self

    def stop(self):
        pass

    def clip_started(self, clip):
        send(self.store, {"started": clip.request.index, "path": str(clip.path)})

    def stage_done(self, clip, kind, seconds):
        send(self.store, {"stage": clip.request.index, "kind": kind, "seconds": seconds, "clip": clip.seconds})

    def step(self, clip, step, steps):
        send(self.store, {"step": clip.request.index, "n": step, "of": steps})

    def clip_done(self, result):
        send(self.store, {"done": result_event(result)})

    def finished(self):
        send(self.store, {"finished": self.group})


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
    """On rank 0: replays the other groups' events into the reporter until each of them has finished."""

    def __init__(self, reporter, requests: list, groups: int):
        super().__init__(name="h3gen-events", daemon=True)
        self.reporter, self.waiting = reporter, groups
        self.requests = {request.index: request for request in requests}
        self.clips, self.results, self.next = {}, [], 1
        self.store = connect()  # a client of its own: the main thread keeps its own

    def run(self):
        while self.waiting:
            if self.next > self.store.add(COUNT_KEY, 0):
                time.sleep(0.05)
                continue
            key = f"h3gen/event/{self.next}"
            event = json.loads(self.store.get(key))
            self.store.delete_key(key)
            self.next += 1
            self.replay(event)

    def replay(self, event: dict) -> None:
        if "say" in event:
            self.reporter.say(event["say"])
        elif "started" in event:
            clip = self.clip(event["started"], event["path"])
            self.reporter.clip_started(clip)
        elif "stage" in event:
            clip = self.clips.get(event["stage"]) or self.clip(event["stage"], "")
            clip.seconds = event["clip"]
            self.reporter.stage_done(clip, event["kind"], event["seconds"])
        elif "step" in event:
            clip = self.clips.get(event["step"]) or self.clip(event["step"], "")
            self.reporter.step(clip, event["n"], event["of"])
        elif "done" in event:
            result = result_from_event(event["done"], self.requests)
            self.clips.pop(result.request.index, None)
            self.results.append(result)
            self.reporter.clip_done(result)
        elif "finished" in event:
            self.waiting -= 1

    def clip(self, index: int, path: str):
        """What a reporter reads of a clip: its request, file and stage times so far."""
        clip = SimpleNamespace(request=self.requests[index], path=Path(path), seconds={})
        self.clips[index] = clip
        return clip
