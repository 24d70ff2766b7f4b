"""The meeting of a multi-node run whose machines give their --node-rank: torchrun's static rendezvous, waiting in
Python. torch's own waits inside one call into its store (machine 0 for the others to connect, the others for
machine 0 to listen), where no signal is handled: a machine whose peers never came ignored Ctrl-C and SIGTERM until
the timeout. Here each machine checks in and polls, so a stop signal ends the wait at once."""

from __future__ import annotations

import socket
import time
from datetime import timedelta

from torch.distributed.elastic.rendezvous.api import (RendezvousHandler, RendezvousInfo, RendezvousParameters,
                                                      RendezvousStoreInfo, RendezvousTimeoutError,
                                                      rendezvous_handler_registry)

BACKEND = "h3gen-static"
JOIN_TIMEOUT_S = 900  # how long the machines of a run wait for each other (the c10d rendezvous too)
POLL_S = 0.2


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
        store.set(f"h3gen/node/{self.rank}", "here")
        keys = [f"h3gen/node/{rank}" for rank in range(self.nnodes)]
        while not store.check(keys):
            wait_a_little(deadline, f"{self.nnodes - sum(store.check([key]) for key in keys)} of the {self.nnodes} "
                                    f"machines did not come to {self.host}:{self.port}")
        return RendezvousInfo(store, self.rank, self.nnodes, RendezvousStoreInfo(self.host, self.port))

    def connect(self, deadline: float):
        """Machine 0 listens at the endpoint without waiting for anyone; the others try to reach it once a second."""
        from torch.distributed import DistNetworkError, TCPStore

        timeout = timedelta(seconds=self.timeout_s)
        if self.rank == 0:
            return TCPStore(self.host, self.port, self.nnodes, True, timeout, wait_for_workers=False,
                            multi_tenant=True)
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
