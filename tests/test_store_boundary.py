"""Sync control only for the sync's members: the coordinator's TCPStore (real, on loopback).

The store listens on the advertised address only, and every key of a sync lives under a group
name with 128 random bits that reaches the participants over the Ray connection alone; a client
that can reach the port but was not handed the name cannot touch the sync's keys.
"""

from __future__ import annotations

import re
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.unit

dist = pytest.importorskip("torch.distributed")

from sync_runtime.runtime.coordinator import Coordinator  # noqa: E402


def _listeners(port: int) -> list[str]:
    """Local addresses (hex, as /proc/net/tcp* writes them) of sockets listening on `port`."""
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            addr, _, hexport = local.rpartition(":")
            if state == "0A" and int(hexport, 16) == port:
                out.append(addr)
    return out


@pytest.fixture
def coordinator() -> SimpleNamespace:
    """Just the state `_ensure_store` and `_group_name` read (no Ray, no participants)."""
    spec = SimpleNamespace(transport=SimpleNamespace(connect_timeout_seconds=5))
    return SimpleNamespace(
        advertise_host="127.0.0.1",
        _store=None,
        spec=spec,
        _instance="abcd1234",
        _generation=0,
        store_address=None,
    )


def test_store_listens_on_the_advertised_address_only(coordinator: SimpleNamespace) -> None:
    host, port = Coordinator._ensure_store(coordinator)
    assert host == "127.0.0.1"
    # 0100007F is 127.0.0.1; torch's default would be the wildcard (0.0.0.0 or ::).
    assert _listeners(port) == ["0100007F"], _listeners(port)
    client = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=5))
    client.set("k", "v")
    assert coordinator._store.get("k") == b"v"
    assert Coordinator._ensure_store(coordinator) == (host, port)  # one store per coordinator


def test_group_names_carry_an_unguessable_part(coordinator: SimpleNamespace) -> None:
    plan = SimpleNamespace(digest="0123456789abcdef")
    a, b = Coordinator._group_name(coordinator, plan), Coordinator._group_name(coordinator, plan)
    assert a != b
    assert re.fullmatch(r"ws-0123456789-abcd1234-g0-[0-9a-f]{32}", a), a


def test_keys_forged_outside_the_prefix_do_not_reach_the_sync(coordinator: SimpleNamespace) -> None:
    """An outsider who knows the digest, instance and generation (all observable) but not the
    random part writes progress, connect and failure keys under every name it can guess."""
    host, port = Coordinator._ensure_store(coordinator)
    real = Coordinator._group_name(coordinator, SimpleNamespace(digest="0123456789abcdef"))
    guessed = real.rsplit("-", 1)[0]
    outsider = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=5))
    for name in (guessed, f"{guessed}-", f"{guessed}-{'0' * 32}"):
        outsider.set(f"{name}/progress/0", "999/999")
        root = dist.PrefixStore(f"weightsync/{name}", outsider)
        root.add("connect/2", 2)
        dist.PrefixStore("0", root).set("failed/1", "forged")
    store = coordinator._store
    assert not store.check([f"{real}/progress/0"])
    sync_root = dist.PrefixStore(f"weightsync/{real}", store)
    assert sync_root.add("connect/2", 0) == 0  # no one joined the real group
    assert not dist.PrefixStore("0", sync_root).check(["failed/1"])
