"""engines/vllm_http.HttpControl against a real HTTP/1.1 server: one kept-alive connection.

A sync makes some 30 calls to vLLM's RL routes; a client (and a TCP connection) per call cost
about 55 ms each on a 2-core host. The server here stands in for `vllm serve`'s routes (only
their JSON shapes); it counts the TCP connections it accepted.
"""

from __future__ import annotations

import json
import pickle
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from sync_runtime.engines import vllm_http
from sync_runtime.engines.vllm_http import HttpControl
from sync_runtime.errors import DestinationError, ParticipantDied

pytestmark = pytest.mark.unit

ANSWERS = {
    "/weight_info": {"weight_version": "v7"},
    "/get_world_size": {"world_size": 2},
    "/health": {},
}


class _Routes(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive
    connections: list[int] = []
    calls: list[str] = []
    drop: set[str] = set()  # routes whose request the server answers by closing the connection

    def setup(self) -> None:
        super().setup()
        type(self).connections.append(1)  # one handler per accepted connection

    def _answer(self) -> None:
        path = self.path.split("?")[0]
        length = int(self.headers.get("content-length") or 0)
        if length:
            self.rfile.read(length)
        type(self).calls.append(path)
        if path in type(self).drop:  # as a killed server's socket: no answer, the connection gone
            self.close_connection = True
            return
        known = path in ANSWERS or path in ("/start_weight_update", "/update_weights", "/pause")
        body = json.dumps(ANSWERS.get(path, {})).encode() if known else b"no"
        head = f"HTTP/1.1 {200 if known else 404} X\r\ncontent-length: {len(body)}\r\n\r\n".encode()
        self.wfile.write(head + body)  # one write: no delayed-ACK stall between head and body

    do_GET = do_POST = _answer

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[tuple[str, type[_Routes]]]:
    routes = type("Routes", (_Routes,), {"connections": [], "calls": [], "drop": set()})
    srv = ThreadingHTTPServer(("127.0.0.1", 0), routes)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{srv.server_port}", routes
    finally:
        srv.shutdown()
        srv.server_close()


def test_calls_of_one_control_share_one_connection(server: tuple[str, type[_Routes]]) -> None:
    url, routes = server
    control = HttpControl(url)
    for _ in range(5):
        control.start()
        control.update({"seq": 1, "method": "ws_meta"})
    assert control.version() == "v7"
    assert control.alive()
    assert len(routes.calls) == 12
    assert len(routes.connections) == 1  # a client per call would have opened 12


def test_an_idle_connection_is_dropped_before_the_server_would_close_it(
    server: tuple[str, type[_Routes]], monkeypatch: pytest.MonkeyPatch
) -> None:
    url, routes = server
    assert vllm_http.KEEPALIVE_S < 5.0  # vLLM's server closes idle connections after 5 s
    monkeypatch.setattr(vllm_http, "KEEPALIVE_S", 1.0)  # two calls in a row fit in it, even loaded
    control = HttpControl(url)
    control.version()
    control.version()
    assert len(routes.connections) == 1
    time.sleep(2.0)  # idle longer than the client keeps a connection
    assert control.version() == "v7"
    assert len(routes.connections) == 2


def test_concurrent_calls_from_threads(server: tuple[str, type[_Routes]]) -> None:
    url, routes = server
    control = HttpControl(url)
    got: list[str] = []
    threads = [threading.Thread(target=lambda: got.append(control.version())) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == ["v7"] * 8
    assert 1 <= len(routes.connections) <= 8  # the pool opens one per concurrent call at most


def test_pickled_control_makes_its_own_client(server: tuple[str, type[_Routes]]) -> None:
    url, routes = server
    control = HttpControl(url, timeout_s=12.0)
    control.version()
    copy = pickle.loads(pickle.dumps(control))  # as Ray hands it to the proxy actor
    assert (copy.base_url, copy.timeout_s) == (url, 12.0)
    assert copy.client() is not control.client()
    assert copy.version() == "v7"
    assert len(routes.connections) == 2


def test_unknown_route_and_dead_server_are_one_line_errors(server: tuple[str, type[_Routes]]) -> None:
    url, _ = server
    control = HttpControl(url)
    with pytest.raises(DestinationError, match="VLLM_SERVER_DEV_MODE=1"):
        control.init({})
    control.close()
    dead = HttpControl("http://127.0.0.1:9", timeout_s=2.0)
    assert not dead.alive()
    with pytest.raises(DestinationError, match="weight_info"):
        dead.version()


def test_a_connection_dropped_mid_request_is_the_server_gone(server: tuple[str, type[_Routes]]) -> None:
    """A server killed while a call is in flight resets or closes its connection: the participant
    died, as the proxy's liveness check would report it, not an error the engine answered."""
    url, routes = server
    control = HttpControl(url)
    assert control.version() == "v7"
    routes.drop.add("/weight_info")
    with pytest.raises(ParticipantDied, match="dropped the connection"):
        control.version()
    routes.drop.clear()
    assert control.version() == "v7"  # a new connection once the server answers again
