"""A node of a multi-node tensor-parallel engine that is not the engine's own (torchrun's `--nnodes` /
`--node-rank`): `python -m engine.distributed.launch --nnodes 2 --node-rank 1 --tensor-parallel-size 4
--master-addr HOST --master-port PORT` spawns this node's ranks; each connects to the engine (nodes.py), gets its
config, loads its shard and serves steps until the engine stops it or goes away. Exits with the worst exit code."""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
from multiprocessing.connection import Client

from engine.distributed.nodes import authkey, master_address, node_ranks


def _remote_worker(rank: int, size: int, address: tuple[str, int], key: bytes, init_method: str, threads: int) -> None:
    from engine.executor.multiproc import _worker_main
    from engine.model.loader import resolve_model

    conn = Client(address, authkey=key)
    conn.send(("hello", rank))
    _, config = conn.recv()
    _worker_main(
        rank, size, init_method, config, resolve_model(config.model, config.revision), conn, os.getppid(), threads
    )


def run_node(
    nnodes: int,
    node_rank: int,
    tensor_parallel_size: int,
    master_addr: str | None = None,
    master_port: int | None = None,
) -> int:
    """Run node `node_rank`'s ranks until they end; the worst exit code."""
    if node_rank == 0:
        raise ValueError("node_rank: 0 is the engine's node (LLMEngine(..., nnodes=N) starts its ranks)")
    if tensor_parallel_size % nnodes:
        raise ValueError(f"nnodes: {nnodes} must divide tensor_parallel_size ({tensor_parallel_size})")
    ranks = node_ranks(tensor_parallel_size, nnodes, node_rank)
    addr, port = master_address(master_addr, master_port)
    key, threads = authkey(), max(1, (os.cpu_count() or 1) // len(ranks))
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(
            target=_remote_worker,
            name=f"tp-worker-{rank}",
            args=(rank, tensor_parallel_size, (addr, port + 1), key, f"tcp://{addr}:{port}", threads),
        )
        for rank in ranks
    ]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join()
    return max(abs(proc.exitcode or 0) for proc in procs)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m engine.distributed.launch", description=__doc__)
    p.add_argument("--nnodes", type=int, required=True)
    p.add_argument("--node-rank", type=int, required=True, help="this node (1 .. nnodes-1; 0 is the engine's)")
    p.add_argument("--tensor-parallel-size", type=int, required=True)
    p.add_argument("--master-addr", default=None, help="the engine's node (default: MASTER_ADDR, else 127.0.0.1)")
    p.add_argument("--master-port", type=int, default=None, help="default: MASTER_PORT, else 29500")
    args = p.parse_args(argv)
    return run_node(args.nnodes, args.node_rank, args.tensor_parallel_size, args.master_addr, args.master_port)


if __name__ == "__main__":
    sys.exit(main())
