"""The `weightsync` weight-transfer engine: one vLLM worker as one WeightSync destination rank.

vLLM builds one `WeightSyncEngine` per worker (`WeightTransferEngineFactory`) and drives it only
through its public weight-transfer API, which reaches every worker at once (of every engine of a
data-parallel server too: each DP engine is then a replica of its own, or with wide EP all its
DP engines one replica, engines/vllm_worker.py):

- `init_weight_transfer_engine({"store_host", "store_port", "prefix", ...})`: the worker
  connects to the control store of the runtime's proxy for this engine (engines/vllm_ranks.py),
  becomes a destination rank (coordinates from vLLM's own parallel state, tensors from the live
  model's pre-load metadata: engines/vllm_worker.VllmRankParticipant with host `VllmStaging`) and
  posts its metadata there. An unknown vLLM version is refused here, by name.
- An engine speculating with MTP: vLLM hands a weight-transfer engine the target model only,
  and its drafter (which holds the MTP part) through the public draft-model session alone
  (`start_draft_weight_update` points this engine's `model` at the drafter until the session's
  finish). So at init such a worker posts `DRAFTER_PENDING` instead of its metadata, the proxy
  opens one draft session and sends `ws_setup` in it, and the worker becomes a rank holding both
  modules (its tensors and apply: vllm_drafter.py). A vLLM without that session refuses such an
  engine at init, in one line.
- `update_weights({"seq": n, "method": "ws_..."})`: one call of the WeightSync rank protocol.
  Per-rank arguments and each rank's answer travel through that store (pickled control data,
  never tensors: vLLM's RPC and HTTP carry only the small JSON update_info). `ws_join` and
  `ws_run` run on this worker's background thread and `update_weights` returns at once, so the
  engine keeps serving while the shards stream over the sync's own process group into host
  staging; every other method runs to completion inside the call. `ws_commit` (the apply) is
  only sent after the proxy paused the engine, and runs inside vLLM's own RPC, which the engine
  core never runs concurrently with a forward pass.
- `start_weight_update` / `finish_weight_update`: bracket a sync (vLLM requires them around
  update calls); nothing to do here, the apply is the two-phase commit's `ws_commit`.
"""

from __future__ import annotations

import contextlib
import logging
import pickle
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from sync_runtime.engines.vllm_apply import require_supported_vllm
from sync_runtime.engines.vllm_batch import Result
from sync_runtime.engines.vllm_drafter import DRAFTER_PENDING, speculates_with_mtp
from sync_runtime.engines.vllm_plugin import answer_key, args_key, init_key
from sync_runtime.engines.vllm_quiet import quiet_queue_waits
from sync_runtime.engines.vllm_worker import VllmWorkerExtension
from sync_runtime.errors import DestinationError, WeightSyncError
from sync_runtime.transfer.spans import span

log = logging.getLogger("weightsync.vllm")

BACKGROUND = frozenset({"ws_join", "ws_run"})
"""Methods that may take the whole transfer: run off vLLM's RPC, so serving goes on."""
QUIET_FROM = frozenset({"ws_run"})
QUIET_UNTIL = frozenset({"ws_resume", "ws_abort"})
"""From a sync's transfer to its resume or abort, vLLM's main loop in this worker waits for its next
message without busy-looping (vllm_quiet.quiet_queue_waits): a sync's calls come one after another,
each followed by vLLM's one-second spin, which would share the transfer's and the apply's core. A
sync whose coordinator vanished before either keeps it until the next sync ends: the loop then
wakes through vLLM's own idle path (one socket poll per message), with the same messages."""


@dataclass
class WeightSyncInitInfo(WeightTransferInitInfo):
    store_host: str
    store_port: int
    prefix: str
    replica: int = 0
    node: str = ""
    actor_name: str = ""
    actor_id: str = ""
    timeout_s: float = 60.0


@dataclass
class WeightSyncUpdateInfo(WeightTransferUpdateInfo):
    seq: int
    method: str


class _Dispatch(VllmWorkerExtension):
    """The worker extension's dispatch, on the attributes a weight-transfer engine is given."""

    def __init__(self, vllm_config: Any, model: torch.nn.Module, device: torch.device) -> None:
        self.vllm_config = vllm_config
        # `drafter.model` is where vllm_apply.mtp_drafter finds an MTP drafter (set_drafter)
        self.model_runner = SimpleNamespace(model=model, drafter=None)
        self.device = device

    def set_drafter(self, drafter: torch.nn.Module) -> None:
        self.model_runner.drafter = SimpleNamespace(model=drafter)


class WeightSyncEngine(WeightTransferEngine[WeightSyncInitInfo, WeightSyncUpdateInfo]):
    init_info_cls = WeightSyncInitInfo
    update_info_cls = WeightSyncUpdateInfo
    supports_draft_weight_update = True
    """The draft session is how an MTP drafter is learnt (module doc); any other update in one
    is the rank protocol as in a target session (the modules were fixed at setup)."""

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self._dispatch = _Dispatch(vllm_config, model, device)
        self._store: dist.TCPStore | None = None
        self._prefix = ""
        self._index = -1
        self._pending_setup: dict[int, tuple] | None = None
        """ws_setup's arguments while an MTP worker waits for its drafter (init .. draft session)."""
        # One thread: the protocol's calls run in the order they arrive, as on a Ray actor.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weightsync")
        self._quiet: contextlib.ExitStack | None = None
        """Holds `quiet_queue_waits` from QUIET_FROM to QUIET_UNTIL (entered and left on that thread)."""

    def _release_quiet(self) -> None:
        if self._quiet is not None:
            self._quiet.close()
            self._quiet = None

    def init_transfer_engine(self, init_info: WeightSyncInitInfo) -> None:
        require_supported_vllm()  # an unknown vLLM is refused here, before any byte moves
        info = init_info
        self._store = dist.TCPStore(
            info.store_host, info.store_port, is_master=False, timeout=timedelta(seconds=info.timeout_s)
        )
        self._prefix = info.prefix
        self._index = self._dispatch._ws_local_index()
        setup = {self._index: (info.replica, info.node, info.actor_name, info.actor_id)}
        if speculates_with_mtp(self.vllm_config):
            _require_draft_session()
            self._pending_setup = setup
            self._store.set(init_key(self._prefix, self._index), pickle.dumps(DRAFTER_PENDING))
            return
        result = self._dispatch._ws_dispatch("ws_setup", setup)
        self._store.set(init_key(self._prefix, self._index), pickle.dumps(result))

    def _setup_with_drafter(self) -> Result:
        """`ws_setup` sent inside the draft session: `self.model` is the drafter there."""
        setup, target = self._pending_setup, self._dispatch.model_runner.model
        if setup is None:
            return "error", DestinationError("ws_setup: this worker is not waiting for its drafter")
        if self.model is target:
            return "error", DestinationError(
                "ws_setup of an MTP engine must run in a draft-model session (start_draft_weight_update)"
            )
        self._dispatch.set_drafter(self.model)
        result = self._dispatch._ws_dispatch("ws_setup", setup)
        if result[0] == "ok":
            self._pending_setup = None
        return result

    def start_weight_update(self) -> None:
        pass  # staging begins inside ws_run (VllmStaging.begin); nothing to prepare here

    def finish_weight_update(self) -> None:
        pass  # the apply is ws_commit, sent while the engine is paused

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class would synchronize the accelerator after every call: nothing here
        # launches device work except ws_commit, which synchronizes itself (receive_weights).
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: WeightSyncUpdateInfo) -> None:
        store = self._store
        if store is None:
            raise DestinationError("update_weights before init_weight_transfer_engine (weightsync backend)")
        seq, method = update_info.seq, update_info.method
        key = args_key(self._prefix, seq, self._index)
        per_rank = {self._index: pickle.loads(store.get(key))} if store.check([key]) else {}

        def run() -> None:
            if method in QUIET_FROM and self._quiet is None:
                self._quiet = contextlib.ExitStack()
                self._quiet.enter_context(quiet_queue_waits())
            with span(f"worker.{method}"):
                if method == "ws_setup":
                    result: Result = self._setup_with_drafter()
                else:
                    result = self._dispatch._ws_dispatch(method, per_rank)
            if method in QUIET_UNTIL:
                self._release_quiet()
            if method == "ws_commit" and torch.accelerator.is_available():
                torch.accelerator.synchronize()  # the next forward pass reads the applied weights
            try:
                payload = pickle.dumps(result)
            except Exception as e:  # an unpicklable answer still reaches the proxy, as one line
                payload = pickle.dumps(("error", DestinationError(f"{method}: answer not picklable: {e}")))
            store.set(answer_key(self._prefix, seq, self._index), payload)

        future = self._executor.submit(run)
        if method not in BACKGROUND:
            future.result()

    def shutdown(self) -> None:
        part = self._dispatch._ws_part
        if part is not None:
            try:
                part.ws_leave()
            except WeightSyncError as e:
                log.warning("weightsync backend: leaving the sync group failed: %s", e)
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._release_quiet()
        self._store = None


def _require_draft_session() -> None:
    """An MTP engine's drafter is reached only through vLLM's draft-model session
    (`WeightTransferEngine.set_weight_update_target`, which `start_draft_weight_update` calls):
    without it the drafter would keep stale weights, so the engine is refused."""
    if not callable(getattr(WeightTransferEngine, "set_weight_update_target", None)):
        import vllm

        raise DestinationError(
            f"vLLM {vllm.__version__}: the engine speculates with MTP, but this vLLM has no draft-model "
            "weight-update session (start_draft_weight_update): its drafter cannot be synced"
        )
