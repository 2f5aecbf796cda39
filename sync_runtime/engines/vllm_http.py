"""EngineControl of a `vllm serve` server: vLLM's HTTP RL routes, over httpx.

The routes exist only when the server runs with `VLLM_SERVER_DEV_MODE=1` (vLLM 0.31/0.32:
`vllm/entrypoints/rl/online/api_router.py`). That mode also mounts `/collective_rpc` and other
development routes, so only the WeightSync runtime may reach the server's port for them
(docs/vllm.md: the chart's NetworkPolicy). The server must be started with
`--weight-transfer-config '{"backend": "weightsync"}'` and WeightSync installed in its image.
"""

from __future__ import annotations

from typing import Any

from sync_runtime.errors import DestinationError

TIMEOUT_S = 600.0
"""One route call: `init_weight_transfer_engine` sets every worker up; `update_weights` with
`ws_commit` runs the apply."""


class HttpControl:
    """vLLM's weight-transfer control surface of one server at `base_url` (http://host:port)."""

    def __init__(self, base_url: str, timeout_s: float = TIMEOUT_S) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s

    def _call(self, verb: str, route: str, *, params: dict | None = None, body: dict | None = None) -> Any:
        import httpx

        url = f"{self.base_url}{route}"
        try:
            r = httpx.request(verb, url, params=params, json=body, timeout=self.timeout_s)
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
        """Workers of this server (TP x PP). A data-parallel server is refused: its DP ranks'
        workers share local indices, and each DP rank would have to be its own replica."""
        ranks = int(self._call("GET", "/get_world_size", params={"include_dp": "false"})["world_size"])
        total = int(self._call("GET", "/get_world_size", params={"include_dp": "true"})["world_size"])
        if total != ranks:
            raise DestinationError(
                f"vLLM server {self.base_url}: data parallel ({total // ranks} x {ranks} workers) is not "
                "supported by the weightsync backend yet; run one server per DP rank"
            )
        return ranks

    def init(self, init_info: dict[str, Any]) -> None:
        self._call("POST", "/init_weight_transfer_engine", body={"init_info": init_info})

    def start(self) -> None:
        self._call("POST", "/start_weight_update")

    def update(self, update_info: dict[str, Any]) -> None:
        self._call("POST", "/update_weights", body={"update_info": update_info})

    def finish(self, version: str | None) -> None:
        self._call("POST", "/finish_weight_update", body={"weight_version": version})

    def pause(self, mode: str) -> None:
        self._call("POST", "/pause", params={"mode": mode})

    def resume(self) -> None:
        self._call("POST", "/resume")

    def version(self) -> str:
        return str(self._call("GET", "/weight_info")["weight_version"])

    def alive(self) -> bool:
        import httpx

        try:
            return httpx.get(f"{self.base_url}/health", timeout=5.0).status_code == 200
        except httpx.HTTPError:
            return False
