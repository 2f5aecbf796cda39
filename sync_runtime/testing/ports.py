"""Ports for the servers the tests start (etcd, kube-apiserver, Ray, `vllm serve`).

A port from `bind(("", 0))` comes from the kernel's ephemeral range, the range every outgoing
connection's local port also comes from: between finding such a port and the server binding it,
any process's `connect()` can take it (it happened in CI, with two test lanes opening
connections beside each other). Below that range, only a process that binds that very port
itself can, so `free_port` looks there first.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_SPAN = 12000
"""How many ports below the ephemeral range to draw from."""


def _ephemeral_low() -> int:
    try:
        return int(_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default when the setting cannot be read


def _bindable(port: int) -> bool:
    """Free on every address: the tests' servers bind 127.0.0.1 or a pod's own loopback address,
    and vLLM binds its ports on all of them."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def free_port(tries: int = 200) -> int:
    """A port that nothing holds now on any address, below the ephemeral range where there is room."""
    low = _ephemeral_low()
    if low - _SPAN >= 1024:
        draw = random.SystemRandom()  # not the tests' seeded `random`: parallel lanes would agree
        for _ in range(tries):
            port = draw.randrange(low - _SPAN, low)
            if _bindable(port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
