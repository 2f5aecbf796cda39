"""A gloo world of processes this (driver) process starts: the rendezvous store it serves.

The store binds port 0 itself. A port found free here and bound later by rank 0 can be taken in
between by any other process (it was, in CI: EADDRINUSE while the vLLM lane ran beside).
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

# The stores this (driver) process serves; a world's ranks use theirs for their whole life
# (Megatron's groups are made through it), so they live as long as this process.
_HELD_STORES: list[dist.TCPStore] = []


def hold_rendezvous() -> str:
    """host:port of a TCPStore this process serves for a gloo world of other processes."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    _HELD_STORES.append(store)
    return f"127.0.0.1:{store.port}"


def join_gloo_world(address: str, rank: int, world_size: int) -> None:
    """Join the default gloo group whose store `hold_rendezvous` serves at `address`."""
    host, port = address.rsplit(":", 1)
    store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(minutes=5))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
