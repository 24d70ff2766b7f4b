"""Rank 0's event pump against a store of its own, without workers: which groups it waits for, and how long."""

import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from h3gen.parallel import events


class Heard:
    """A reporter that keeps what it is told."""

    def __init__(self):
        self.said, self.started = [], []

    def say(self, text):
        self.said.append(text)

    def clip_started(self, clip):
        self.started.append(clip.request.index)


@pytest.fixture
def store(monkeypatch):
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(store.port))
    monkeypatch.setenv("GROUP_RANK", "0")
    yield store
    events.end_threads()  # the first ranks' beats, as a worker ends them
    events._ending.clear()


def gone_pid() -> int:
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


def clip(index: int):
    return SimpleNamespace(request=SimpleNamespace(index=index), path=Path(f"out/{index}.mp4"))


def pump_for(groups: int):
    heard = Heard()
    pump = events.EventPump(heard, [SimpleNamespace(index=i) for i in range(4)], range(1, groups + 1))
    pump.start()
    return pump, heard


def test_a_group_whose_first_rank_is_gone_is_not_waited_for(store):
    """Group 1's process died after starting a clip; group 2 finished: the pump ends, with group 1's clip
    unreported."""
    dead = events.RemoteReporter(store, 1)
    store.set(events.leader_key(1), f"0 {gone_pid()}")  # as a killed worker leaves it
    dead.clip_started(clip(1))
    finished = events.RemoteReporter(store, 2)
    finished.say("loaded")
    finished.finished()
    pump, heard = pump_for(2)
    pump.join(timeout=5)
    assert not pump.is_alive()
    assert heard.started == [1] and heard.said == ["loaded (group 2)"]
    assert [c.request.index for c in pump.unreported()] == [1]


def test_a_live_group_is_waited_for_until_rank_0_drains(store, monkeypatch):
    """A group still alive (here, this process) is waited for; once rank 0 is stopped, PUMP_DRAIN_S at most."""
    monkeypatch.setattr(events, "PUMP_DRAIN_S", 0.3)
    events.RemoteReporter(store, 1).clip_started(clip(2))
    pump, heard = pump_for(1)
    pump.join(timeout=0.5)
    assert pump.is_alive() and heard.started == [2]
    began = time.monotonic()
    pump.drain()
    assert not pump.is_alive() and time.monotonic() - began < 2


def test_machines_compare_their_output_and_model_as_absolute_paths(tmp_path, monkeypatch):
    """-o and --model are relative to each machine's working directory: `-o out` in /shared and `-o /shared/out` are
    one folder; `-o out` in two different directories are two."""
    from h3gen.errors import UsageError
    from h3gen.parallel.serve import check_same_command, command_of
    from h3gen.run.settings import RunSettings

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    prompts = tmp_path / "p.txt"
    prompts.write_text("a fox\n")

    def machine(cwd: str, output: str, model: str) -> dict:
        monkeypatch.chdir(tmp_path / cwd)
        return command_of(RunSettings(prompts=prompts, output=Path(output), model=Path(model)))

    check_same_command(machine("a", "out", "m"), {1: machine("b", str(tmp_path / "a" / "out"), "../a/m")})
    with pytest.raises(UsageError, match=f"-o {tmp_path / 'a' / 'out'} against {tmp_path / 'b' / 'out'}"):
        check_same_command(machine("a", "out", "m"), {1: machine("b", "out", "../a/m")})


def test_a_group_on_another_machine_says_where_its_lines_come_from(store, monkeypatch):
    """A line of group 1 on machine 1 ("another signal ends at once", say) is not about rank 0's machine."""
    monkeypatch.setenv("GROUP_RANK", "1")
    events.RemoteReporter(store, 1).say("finishing")
    monkeypatch.setenv("GROUP_RANK", "0")
    events.RemoteReporter(store, 2).say("loaded")
    assert [store.get(events.event_key(group, 1)).decode() for group in (1, 2)] == [
        '{"say": "finishing (group 1 on machine 1)"}', '{"say": "loaded (group 2)"}']


def test_a_store_gone_is_said_once_and_what_follows_goes_unsaid(store):
    """The first word to a store that answers no more ends the worker's render (StoreGone); the words of its way out
    (a background mux finished, its claims released) go nowhere, instead of raising again before the claims are
    released (their lock files stayed)."""
    import torch.distributed as dist

    class Gone:
        def set(self, key, value):
            if key.startswith("h3gen/event/"):
                raise dist.DistNetworkError("Broken pipe")

    reporter = events.RemoteReporter(Gone(), 1)
    with pytest.raises(events.StoreGone):
        reporter.say("finishing")
    reporter.say("finished the mux")
    reporter.finished()
