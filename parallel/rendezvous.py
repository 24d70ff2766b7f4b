"""Where the machines of a multi-node run meet, at the start and at the end, waiting in Python.

The start, for machines that give their --node-rank: torchrun's static rendezvous waits inside one call into its
store (machine 0 for the others to connect, the others for machine 0 to listen), where no signal is handled: a
machine whose peers never came ignored Ctrl-C and SIGTERM until the timeout. Here each machine checks in and polls,
so a stop signal ends the wait at once.

The end: torchrun's agents wait for each other's (5 minutes at most) in one call into the store too, and a machine
that was stopped never comes: the others sat out the 5 minutes, deaf to signals. Here they poll, and rank 0's
machine, once it reported a run that some clips lack a result of, tells the others not to wait."""

from __future__ import annotations

import contextlib
import signal
import socket
import time
from datetime import timedelta

from torch.distributed.elastic.rendezvous.api import (RendezvousError, RendezvousHandler, RendezvousInfo,
                                                      RendezvousParameters, RendezvousStoreInfo,
                                                      RendezvousTimeoutError, rendezvous_handler_registry)

BACKEND = "h3gen-static"
JOIN_TIMEOUT_S = 900  # how long the machines of a run wait for each other (the c10d rendezvous too)
POLL_S = 0.2
EXIT = "h3gen/exit"  # the keys of the end's meeting, in the agents' store
LEAVE_S = 10  # how long the store's machine, stopped or failed, waits for the others to be done with it
LINGER_S = 3 * POLL_S  # how long the store's machine stays once all are done, for the others to see that


class RunUnderway(RendezvousError):
    """A machine came to a run whose machines have all met: one machine started again while machine 0 still runs
    the first start."""


class NodeRendezvous(RendezvousHandler):
    def __init__(self, host: str, port: int, rank: int, nnodes: int, run_id: str, timeout_s: float):
        self.host, self.port, self.rank, self.nnodes, self.run_id = host, port, rank, nnodes, run_id
        self.timeout_s, self.store = timeout_s, None

    def get_backend(self) -> str:
        return BACKEND

    @property
    def use_agent_store(self) -> bool:  # the workers use this store, as torchrun's static rendezvous has them do
        return True

    def next_rendezvous(self) -> RendezvousInfo:
        from torch.distributed import PrefixStore

        deadline = time.monotonic() + self.timeout_s
        self.store = self.store or self.connect(deadline)
        store = PrefixStore(self.run_id, self.store)
        if store.check(["h3gen/met"]):
            raise RunUnderway(f"machine 0 at {self.host}:{self.port} is still running this run, whose "
                              f"{self.nnodes} machines have met")
        store.set(f"h3gen/node/{self.rank}", "here")
        keys = [f"h3gen/node/{rank}" for rank in range(self.nnodes)]
        while not store.check(keys):
            wait_a_little(deadline, f"{self.nnodes - sum(store.check([key]) for key in keys)} of the {self.nnodes} "
                                    f"machines did not come to {self.host}:{self.port}")
        store.set("h3gen/met", "yes")
        return RendezvousInfo(store, self.rank, self.nnodes, RendezvousStoreInfo(self.host, self.port))

    def connect(self, deadline: float):
        """Machine 0 listens at the endpoint without waiting for anyone; the others try to reach it once a second."""
        from torch.distributed import DistNetworkError, TCPStore

        timeout = timedelta(seconds=self.timeout_s)
        if self.rank == 0:
            try:
                return TCPStore(self.host, self.port, self.nnodes, True, timeout, wait_for_workers=False,
                                multi_tenant=True)
            except (OSError, DistNetworkError) as e:
                if "EADDRINUSE" not in str(e) and "address already in use" not in str(e).lower():
                    raise
                raise PortTaken(f"--rdzv-endpoint {self.host}:{self.port}: the port is taken on this machine (another "
                                "run, or another program)") from None
        while True:
            try:  # a socket of our own first: the store logs each refused try with a C++ stack
                socket.create_connection((self.host, self.port), timeout=1).close()
                store = TCPStore(self.host, self.port, self.nnodes, False, timedelta(seconds=5), multi_tenant=True)
            except (OSError, DistNetworkError):
                wait_a_little(deadline, f"machine 0 did not listen at {self.host}:{self.port}")
                continue
            store.set_timeout(timeout)
            return store

    def is_closed(self) -> bool:
        return False

    def set_closed(self) -> None:
        pass

    def num_nodes_waiting(self) -> int:
        return 0

    def get_run_id(self) -> str:
        return self.run_id

    def shutdown(self) -> bool:
        return True


class PortTaken(RendezvousError):
    """Machine 0 cannot listen at the endpoint: something on it holds the port."""


def wait_a_little(deadline: float, what: str) -> None:
    """Sleep between two checks (where a signal is handled), or give up at the deadline saying `what` is missing."""
    if time.monotonic() > deadline:
        raise RendezvousTimeoutError(f"{what} in time")
    time.sleep(POLL_S)


def create(params: RendezvousParameters) -> NodeRendezvous:
    host, _, port = params.endpoint.rpartition(":")
    return NodeRendezvous(host.strip("[]"), int(port), int(params.config["rank"]), params.max_nodes, params.run_id,
                          float(params.config.get("timeout", JOIN_TIMEOUT_S)))


def register() -> None:
    rendezvous_handler_registry.register(BACKEND, create)


@contextlib.contextmanager
def polled_exit(ended_short, hosts_store: bool, cause):
    """While torchrun's agent runs in this process, it meets the other machines' agents at the end as
    `meet_at_exit` does; an agent whose workers end another way (stopped, failed) tells rank 0 so, and counts itself
    done, so no machine waits for it. `ended_short()`: whether rank 0 reported here a run that some clips lack a
    result of; `hosts_store`: whether this machine's agent holds the store the others talk through; `cause(failures)`:
    the first of a run result's failures, in words."""
    from torch.distributed.elastic.agent.server.api import SimpleElasticAgent
    from torch.distributed.elastic.multiprocessing.api import SignalException

    torch_run, torch_wait = SimpleElasticAgent.run, SimpleElasticAgent._exit_barrier

    def run(agent, *args, **kwargs):
        ended = "lost its workers"
        try:
            result = torch_run(agent, *args, **kwargs)
            ended = f"lost a worker: {cause(result.failures)}" if result.is_failed() else ""
            return result
        except SignalException as stop:
            ended = f"was stopped by {signal.Signals(int(stop.sigval)).name}"
            raise
        finally:  # the store's host waits a while for the others to count
            if ended:
                tell_ended(agent, ended)
            if count_done(agent) and hosts_store:
                wait_for_all(agent, LEAVE_S, hosts_store)

    def exit_barrier(agent):
        meet_at_exit(agent, agent._exit_barrier_timeout, ended_short(), hosts_store)

    SimpleElasticAgent.run, SimpleElasticAgent._exit_barrier = run, exit_barrier
    try:
        yield
    finally:
        SimpleElasticAgent.run, SimpleElasticAgent._exit_barrier = torch_run, torch_wait


def tell_ended(agent, what: str) -> None:
    """Into the store the workers talk through (the agents' without its prefix), where the store is there."""
    from torch.distributed import DistError, PrefixStore

    from h3gen.parallel.events import tell_machine_ended

    store = getattr(agent, "_store", None)
    while isinstance(store, PrefixStore):
        store = store.underlying_store
    if store is not None:
        with contextlib.suppress(DistError):
            tell_machine_ended(store, agent._worker_group.group_rank, what)


def count_done(agent) -> bool:
    """This machine is done with the run: counted once, where the store is there (False when it was counted
    before, or there is none); the last to count says all are."""
    from torch.distributed import DistError

    if getattr(agent, "_h3gen_done", False) or getattr(agent, "_store", None) is None:
        return False
    agent._h3gen_done = True
    with contextlib.suppress(DistError):
        if agent._store.add(f"{EXIT}/done", 1) >= agent._worker_group.group_world_size:
            agent._store.set(f"{EXIT}/all", "1")
    return True


def meet_at_exit(agent, timeout_s: float, leave: bool, hosts_store: bool) -> None:
    """Wait until every machine is done, `timeout_s` at most, or rank 0's machine says to go (`leave` there: a
    machine was stopped, and may never say it is done)."""
    from torch.distributed import DistError

    if leave:
        with contextlib.suppress(DistError):
            agent._store.set(f"{EXIT}/all", "1")
    count_done(agent)
    wait_for_all(agent, timeout_s, hosts_store)


def wait_for_all(agent, timeout_s: float, hosts_store: bool) -> None:
    """Poll for every machine being done (a stop signal is handled between two looks); a store gone (its host
    left) ends the wait too. The store's host lingers a moment after, for the others to see it before it goes."""
    from torch.distributed import DistError

    deadline = time.monotonic() + timeout_s
    try:
        while not agent._store.check([f"{EXIT}/all"]):
            if time.monotonic() > deadline:
                return
            time.sleep(POLL_S)
    except DistError:
        return
    if hosts_store and agent._worker_group.group_world_size > 1:
        time.sleep(LINGER_S)
