"""A data-parallel `vllm serve` whose engines span nodes (vLLM's multi-node DP), as its nodes are
started: the head (`--data-parallel-size D --data-parallel-size-local L`, the API servers and its
engines) and headless nodes (`--headless --data-parallel-start-rank R`, engines only), each with
vLLM's own `vllm serve` command (vllm_cli.py: `--headless` exists only there) and the weightsync
backend. Used by tests/engines/test_vllm_server_dp.py and test_vllm_server_wide_ep.py, where the
"nodes" are process trees of this machine meeting at 127.0.0.1, and by the Kubernetes e2e's
server pods (tests/e2e/vllm_pods.py: `command_args`, `node_args`).
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

from sync_runtime.testing.vllm_server import Server, free_port, serve_args, serve_env, start_group, stop


class DataParallelNode(NamedTuple):
    """One node of a data-parallel server whose engines span nodes (vLLM's multi-node DP)."""

    start_rank: int
    """Its first DP rank: 0 is the head (the API servers and its engines), others are headless."""
    local: int
    """DP engines on this node (`--data-parallel-size-local`)."""
    rpc_port: int
    """The head's DP RPC port (`--data-parallel-rpc-port`), the same on every node."""
    address: str = "127.0.0.1"
    """The head's address (`--data-parallel-address`)."""


def command_args(model_dir: str, port: int, **options: Any) -> list[str]:
    """`serve_args` (same `options`) through vLLM's own `vllm serve` command (vllm_cli) instead of
    its API server module: the Python arguments after the interpreter."""
    return ["-m", "sync_runtime.testing.vllm_cli", "serve", *serve_args(model_dir, port, **options)[2:]]


def node_args(
    model_dir: str,
    port: int,
    node: DataParallelNode,
    *,
    dp: int,
    tp: int = 1,
    expert_parallel: bool = False,
    api_servers: int | None = None,
    max_model_len: int = 128,
) -> list[str]:
    """The Python arguments (after the interpreter) of one node of a `dp`-engine data-parallel
    server (`tp` workers per engine) with the weightsync backend: vLLM's own `vllm serve`
    (vllm_cli: `--headless` is only there). The head serves HTTP on `port` with vLLM's default
    number of API servers (one per DP engine in 0.32); a headless node runs its engines only,
    which join the head's (and `port` is unused). `expert_parallel`: the experts split over every
    engine of every node (vLLM's wide EP). `api_servers`: the head's `--api-server-count` (None:
    vLLM's default; 1 runs it in the head's own process, each more is a spawned process of its
    own, about 12 CPU-s of imports here). Also the command of the Kubernetes e2e's node pods."""
    return [
        *command_args(model_dir, port, tp=tp, max_model_len=max_model_len),
        f"--data-parallel-size={dp}",
        f"--data-parallel-size-local={node.local}",
        f"--data-parallel-address={node.address}",
        f"--data-parallel-rpc-port={node.rpc_port}",
        *([f"--data-parallel-start-rank={node.start_rank}", "--headless"] if node.start_rank else []),
        *(["--enable-expert-parallel"] if expert_parallel else []),
        *([f"--api-server-count={api_servers}"] if api_servers and not node.start_rank else []),
    ]


def serve_node(
    model_dir: str,
    port: int,
    log: Path,
    node: DataParallelNode,
    *,
    dp: int,
    tp: int = 1,
    expert_parallel: bool = False,
    api_servers: int | None = None,
) -> subprocess.Popen:
    """One node of a data-parallel server (`node_args`), in a process group of its own, as
    `serve`'s."""
    options = {"dp": dp, "tp": tp, "expert_parallel": expert_parallel, "api_servers": api_servers}
    return start_group(
        [sys.executable, *node_args(model_dir, port, node, **options)], serve_env(tp, node.local), log
    )


@contextlib.contextmanager
def one_engine_per_node(
    model_dir: str,
    directory: Path,
    *,
    dp: int,
    expert_parallel: bool = False,
    api_servers: int | None = None,
) -> Iterator[tuple[Server, list[subprocess.Popen]]]:
    """A `dp`-engine data-parallel server over `dp` "nodes" of one engine each (TP 1), all on
    this machine: the head (yielded as the Server: its URL serves HTTP; logs `head.log` in
    `directory`) and the headless nodes (`node-{r}.log`), every node's processes in a process
    group of its own (yielded too, head first). Every node is stopped on exit. `expert_parallel`,
    `api_servers`: see `serve_node`."""
    port, rpc_port = free_port(), free_port()
    nodes: list[subprocess.Popen] = []
    try:
        options = {"dp": dp, "expert_parallel": expert_parallel, "api_servers": api_servers}
        for rank in range(dp):
            log = directory / ("head.log" if rank == 0 else f"node-{rank}.log")
            nodes.append(serve_node(model_dir, port, log, DataParallelNode(rank, 1, rpc_port), **options))
        yield Server(f"http://127.0.0.1:{port}", nodes[0], directory / "head.log"), nodes
    finally:
        for proc in reversed(nodes):
            stop(proc)
