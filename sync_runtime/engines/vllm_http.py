"""EngineControl of a `vllm serve` server: vLLM's HTTP RL routes, over httpx.

The routes exist only when the server runs with `VLLM_SERVER_DEV_MODE=1` (vLLM 0.31/0.32:
`vllm/entrypoints/rl/online/api_router.py`). That mode also mounts `/collective_rpc` and other
development routes, so only the WeightSync runtime may reach the server's port for them
(docs/vllm.md: the chart's NetworkPolicy). The server must be started with
`--weight-transfer-config '{"backend": "weightsync"}'` and WeightSync installed in its image.
"""

from __future__ import annotations

import threading
from typing import Any

from sync_runtime.engines.vllm_ranks import one_update_session
from sync_runtime.errors import DestinationError, ParticipantDied
from sync_runtime.transfer.spans import span

TIMEOUT_S = 600.0
"""One route call: `init_weight_transfer_engine` sets every worker up; `update_weights` with
`ws_commit` runs the apply."""
KEEPALIVE_S = 2.0
"""An idle kept-alive connection is dropped by the client after this, before vLLM's server
closes it (VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s by default): with equal limits a call could go out
on a connection the server is closing at that moment and fail with a connection reset."""


class HttpControl:
    """vLLM's weight-transfer control surface of one server at `base_url` (http://host:port).

    One `httpx.Client` per instance and process (made on first use, dropped when pickled: the
    proxy actor gets its own), so the calls of a sync reuse one kept-alive connection. A
    module-level `httpx.request` builds a client, its SSL context and a TCP connection per
    call: about 55 ms each on a 2-core host, against about 3 ms on a kept connection, and a
    sync makes some 30 calls.
    """

    def __init__(self, base_url: str, timeout_s: float = TIMEOUT_S) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self._client: Any = None
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        return {"base_url": self.base_url, "timeout_s": self.timeout_s}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["base_url"], state["timeout_s"])  # type: ignore[misc]

    def client(self) -> Any:
        """This process's client of the server (httpx.Client is safe to share between threads)."""
        import httpx

        with self._lock:
            if self._client is None:
                limits = httpx.Limits(keepalive_expiry=KEEPALIVE_S)
                self._client = httpx.Client(timeout=self.timeout_s, limits=limits)
            return self._client

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()

    def _call(self, verb: str, route: str, *, params: dict | None = None, body: dict | None = None) -> Any:
        import httpx

        url = f"{self.base_url}{route}"
        try:
            with span(f"http{route}"):
                r = self.client().request(verb, url, params=params, json=body)
        except (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError) as e:
            # The connection was up and broke mid-request (reset, closed with no answer): the
            # server's process went away, as a killed pod's does. The same death is reported as
            # ParticipantDied when the proxy's liveness check sees it first; one name either way.
            raise ParticipantDied(
                f"vLLM server {self.base_url}: {route}: the server dropped the connection "
                f"({type(e).__name__}: {e})"
            ) from e
        except httpx.HTTPError as e:
            raise DestinationError(f"vLLM server {self.base_url}: {route}: {type(e).__name__}: {e}") from e
        if r.status_code == 404:
            raise DestinationError(
                f"vLLM server {self.base_url}: no route {route} (start it with VLLM_SERVER_DEV_MODE=1)"
            )
        if r.status_code >= 400:
            raise DestinationError(
                f"vLLM server {self.base_url}: {route}: HTTP {r.status_code}: {r.text[:300]}"
            )
        return r.json() if r.content else None

    def world_size(self) -> int:
        """Workers of this server: TP x PP x DP. The workers of every DP engine take part in each
        weight-transfer call (vLLM sends them to all its engines), each DP rank a replica of its
        own, or with wide EP all of them one replica (engines/vllm_worker._worker_coord)."""
        return int(self._call("GET", "/get_world_size", params={"include_dp": "true"})["world_size"])

    def data_parallel_size(self) -> int:
        """The server's DP engines (`--data-parallel-size`): its world size with DP over without."""
        engine = int(self._call("GET", "/get_world_size", params={"include_dp": "false"})["world_size"])
        return self.world_size() // max(engine, 1)

    def init(self, init_info: dict[str, Any]) -> None:
        self._call("POST", "/init_weight_transfer_engine", body={"init_info": init_info})

    def start(self) -> None:
        self._call("POST", "/start_weight_update")

    def start_draft(self) -> None:
        """A session whose updates reach the speculative drafter (vllm_ranks: MTP setup)."""
        self._call("POST", "/start_draft_weight_update")

    def update(self, update_info: dict[str, Any]) -> None:
        self._call("POST", "/update_weights", body={"update_info": update_info})

    def finish(self, version: str | None) -> None:
        self._call("POST", "/finish_weight_update", body={"weight_version": version})

    def one_update(self, update_info: dict[str, Any]) -> None:
        """Three requests: vLLM's HTTP routes have no one-request session."""
        one_update_session(self.start, self.update, self.finish, update_info)

    def pause(self, mode: str) -> None:
        self._call("POST", "/pause", params={"mode": mode})

    def resume(self) -> None:
        self._call("POST", "/resume")

    def version(self) -> str:
        return str(self._call("GET", "/weight_info")["weight_version"])

    def alive(self) -> bool:
        import httpx

        try:
            return self.client().get(f"{self.base_url}/health", timeout=5.0).status_code == 200
        except httpx.HTTPError:
            return False
