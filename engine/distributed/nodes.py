"""Tensor parallelism over several machines, the way torch.distributed names it: `nnodes` nodes, the ranks split
evenly (node n holds ranks n*k .. n*k+k-1), and one master address and port (config.master_addr / master_port,
else the MASTER_ADDR / MASTER_PORT environment variables, else 127.0.0.1:29500).

Node 0 is the engine's: it spawns its own ranks and rank 0 hosts the process group's TCP store on the master port
(`init_method="tcp://addr:port"`). The other nodes run `python -m engine.distributed.launch` (launch.py), whose
workers connect to the engine on the master port + 1 (a `multiprocessing.connection` Listener: the same
Connection as a local worker's pipe, so a step, a reply, an EOF and a timeout read the same), say their rank,
and get the engine's config. The channel carries pickles, so it needs a shared secret: WORKBENCH_DIST_AUTHKEY.
"""

from __future__ import annotations

import os
import threading
from multiprocessing.connection import Connection, Listener
from typing import Any

AUTHKEY_ENV = "WORKBENCH_DIST_AUTHKEY"


def master_address(addr: str | None = None, port: int | None = None) -> tuple[str, int]:
    """The master's address and port: the arguments, else MASTER_ADDR / MASTER_PORT, else 127.0.0.1:29500."""
    return addr or os.environ.get("MASTER_ADDR", "127.0.0.1"), port or int(os.environ.get("MASTER_PORT", "29500"))


def node_ranks(size: int, nnodes: int, node_rank: int) -> range:
    """The tensor-parallel ranks node `node_rank` holds (the ranks split evenly, in order)."""
    if not 0 <= node_rank < nnodes:
        raise ValueError(f"node_rank: must be in [0, {nnodes}) for nnodes {nnodes}, got {node_rank}")
    per_node = size // nnodes
    return range(node_rank * per_node, (node_rank + 1) * per_node)


def authkey() -> bytes:
    """The secret every node shares (the channel carries pickles: nobody else may connect)."""
    key = os.environ.get(AUTHKEY_ENV)
    if not key:
        raise ValueError(f"{AUTHKEY_ENV}: set the same secret on every node to run tensor parallelism over nodes")
    return key.encode()


def accept_ranks(listener: Listener, ranks: range, config: Any, timeout_s: float) -> list[Connection]:
    """Accept one connection from each of `ranks` (each says its rank and gets `config`), rank order; raise
    TimeoutError naming the ranks that did not connect within `timeout_s`."""
    conns: dict[int, Connection] = {}

    def accept() -> None:
        while len(conns) < len(ranks):
            conn = listener.accept()
            _, rank = conn.recv()  # ("hello", rank)
            conn.send(("config", config))
            conns[rank] = conn

    thread = threading.Thread(target=accept, daemon=True, name="accept-ranks")
    thread.start()
    thread.join(timeout_s)
    listener.close()  # a thread still in accept() fails and ends
    missing = [r for r in ranks if r not in conns]
    if missing:
        for conn in conns.values():
            conn.close()
        raise TimeoutError(
            f"rank(s) {missing} of the other nodes did not connect within {timeout_s:.0f} s "
            "(is `python -m engine.distributed.launch` running there, with the same master address, "
            f"port and {AUTHKEY_ENV}?)"
        )
    return [conns[r] for r in ranks]
