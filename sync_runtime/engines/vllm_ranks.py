"""Any vLLM engine started with the `weightsync` backend, as N destination ranks for discovery.

`VllmEngineRanks` is a named Ray actor owned by WeightSync, one per vLLM engine (replica). It
speaks the rank protocol to the coordinator like `VllmReplica` (`ws_meta()` returns one meta per
worker; calls arrive as `ws_rank_call` and are batched per method, engines/vllm_batch.py), but
it reaches the engine only through vLLM's own weight-transfer control surface, via an
`EngineControl`:

- `init`: `init_weight_transfer_engine`, once: every worker joins this actor's control store;
  an engine speculating with MTP then gets one draft-model session (`start_draft_weight_update`
  .. finish, vLLM's public API) with `ws_setup` in it, where each worker learns its drafter
  (vllm_plugin/backend.py); an engine whose vLLM refuses that session is refused in one line;
- each batched protocol call: `update_weights` with `{"seq", "method"}` inside its own
  `start_weight_update` .. `finish_weight_update` session (never left open: vLLM refuses a
  second start, so an open one would block the engine's next proxy); the per-rank arguments and
  answers go through the control store (vllm_plugin/backend.py);
- `ws_pause` pauses the engine (mode `keep`, `wait` or `abort`) before the workers apply;
  `ws_resume` labels the engine with the version (`finish_weight_update(version)`, vLLM's weight
  version label) and resumes generation. The seconds between the two are this replica's pause, reported apart
  from the transfer (`pause_seconds`).

A data-parallel server (`vllm serve --data-parallel-size D`): vLLM sends each weight-transfer
call to all D engines, so one proxy holds all their workers, and each DP engine is a replica of
its own (replica + DP rank, engines/vllm_worker._worker_coord). vLLM pauses, resumes and labels
the server as a whole, so the commit phase pauses, applies and resumes all its replicas together
(runtime/commit.engines_of): the pause holds every local rank, and the server resumes (labelled
once) only when all resume on one version in one batch; otherwise (a DP engine out of serving,
DP ranks on different versions) it stays paused and none of them reports serving
(`_after_batch`).
With wide EP (`--enable-expert-parallel` on a MoE model) the D engines are one replica: its ranks
are paused, committed and resumed together, one pause, one apply call, one resume.

`HttpControl` (engines/vllm_http.py) drives a `vllm serve` server; `ActorControl`
(engines/vllm_actor.py) a `vllm.LLM` or `AsyncLLM` inside a Ray actor the user wrote.
"""

from __future__ import annotations

import contextlib
import pickle
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch.distributed as dist

from sync_runtime.engines.vllm_batch import Batch, RankBatcher, Result, value
from sync_runtime.engines.vllm_drafter import DRAFTER_PENDING
from sync_runtime.engines.vllm_plugin import answer_key, args_key, init_key
from sync_runtime.errors import DestinationError, DiscoveryError, ParticipantDied
from sync_runtime.runtime.participant import ParticipantMeta
from sync_runtime.transfer.spans import span

PAUSE_MODES = ("keep", "wait", "abort")
ANSWER_TIMEOUT_S = 3600.0
"""Longest wait for one worker's answer (a ws_run lasts the whole transfer)."""
POLL_S = 0.005
LIVENESS_S = 2.0
"""While waiting for an answer, how often the engine's liveness is checked."""


def run_session(
    start: Callable[[], object], work: Callable[[], str | None], finish: Callable[[str | None], object]
) -> None:
    """`work` inside one vLLM weight-update session (start .. finish), never left open: vLLM
    accepts update_weights only inside one and refuses a second start while one is open, so a
    session left open (by a runtime that ended, or a proxy killed) would block every later proxy
    of the engine; it is closed first, its label kept. `work` returns the version label finish
    gives the engine's outputs (None: the label is kept); when it fails the session is closed
    (vLLM closes it itself in most cases). engines/vllm_actor.py has the same steps awaited."""
    try:
        start()
    except Exception as e:
        if "already active" not in str(e):
            raise
        finish(None)
        start()
    try:
        version = work()
    except Exception:
        with contextlib.suppress(Exception):
            finish(None)
        raise
    finish(version)


def one_update_session(
    start: Callable[[], object],
    update: Callable[[dict[str, Any]], object],
    finish: Callable[[str | None], object],
    update_info: dict[str, Any],
) -> None:
    """One `update_weights` in its own session, the engine's weight-version label kept."""

    def work() -> None:
        update(update_info)

    run_session(start, work, finish)


def _pause_mode(mode: str) -> str:
    if mode not in PAUSE_MODES:
        raise DestinationError(f"pause mode {mode!r}: expected one of {', '.join(PAUSE_MODES)}")
    return mode


class EngineControl(Protocol):
    """vLLM's public weight-transfer control surface of one engine."""

    def world_size(self) -> int: ...
    def init(self, init_info: dict[str, Any]) -> None: ...
    def start(self) -> None: ...
    def start_draft(self) -> None: ...
    def update(self, update_info: dict[str, Any]) -> None: ...
    def finish(self, version: str | None) -> None: ...
    def one_update(self, update_info: dict[str, Any]) -> None:
        """One session holding one update, the engine's label kept: `one_update_session` of the
        three calls above, run where the engine is when its surface allows (one round trip)."""
        ...

    def pause(self, mode: str) -> None: ...
    def resume(self) -> None: ...
    def version(self) -> str: ...
    def alive(self) -> bool: ...


class VllmEngineRanks(RankBatcher):
    """The WeightSync side of one vLLM engine with the weightsync backend (see module doc).

    Wrap with `ray.remote(...).options(name=..., max_concurrency=...)` (see `attach`).
    """

    def __init__(
        self, control: EngineControl, *, replica: int = 0, pause: str = "keep", host: str = ""
    ) -> None:
        import ray

        self._control, self._pause_mode = control, _pause_mode(pause)
        self._host = host or ray.util.get_node_ip_address()
        self._store = dist.TCPStore(self._host, 0, is_master=True, wait_for_workers=False)
        self._store_lock = threading.Lock()
        self._prefix = f"ws-{secrets.token_hex(6)}"
        self._seq = 0
        self._state = threading.Lock()
        self._session = threading.Lock()
        self._paused_at: float | None = None
        self._held: set[int] = set()
        """Local ranks paused and not resumed since: the engine resumes when none is left (a
        data-parallel server's DP ranks are replicas of their own, resumed together)."""
        self._resumed_on: dict[int, str] = {}
        """Per local rank, the version its latest resume held."""
        self._pauses: list[float] = []
        self._last_pause: float | None = None
        ctx = ray.get_runtime_context()
        world = control.world_size()
        self._init_batcher(world)
        control.init(
            {
                "store_host": self._host,
                "store_port": self._store.port,
                "prefix": self._prefix,
                "replica": replica,
                "node": self._host,
                "actor_name": ctx.get_actor_name() or "",
                "actor_id": ctx.get_actor_id() or "",
            }
        )
        answers = [pickle.loads(self._await(init_key(self._prefix, i))) for i in range(world)]
        metas = [value(r) for r in self._setup_drafters(answers)]
        replicas = [m.coord.replica for m in metas]
        check_replicas(replicas, replica)

    def _setup_drafters(self, answers: list[Result]) -> list[Result]:
        """The init answers; where the workers wait for their MTP drafter, their `ws_setup`
        answers from one draft-model session (the only place vLLM hands the backend the drafter)."""
        pending = [a == DRAFTER_PENDING for a in answers]
        if not any(pending):
            return answers
        if not all(pending):
            raise DiscoveryError(f"workers {pending.count(True)} of {len(pending)} wait for an MTP drafter")
        with self._state:
            self._seq += 1
            seq = self._seq

        def work() -> None:
            self._control.update({"seq": seq, "method": "ws_setup"})

        try:
            self._in_session(work, draft=True)
        except Exception as e:  # vLLM's own refusal (no drafter, no draft session): one line
            reason = (str(e).strip().splitlines() or [type(e).__name__])[-1]  # a traceback's last line
            raise DestinationError(
                f"the engine speculates with MTP, but its draft-model weight-update session failed "
                f"({reason[:300]}): its drafter cannot be synced"
            ) from e
        return self._answers(seq)

    # ---- the WeightSync protocol ------------------------------------------------------------

    def ws_meta(self) -> list[ParticipantMeta]:
        return [value(r) for r in self._rpc("ws_meta", {i: () for i in range(self._ranks)})]

    def ws_set_pause_mode(self, mode: str) -> None:
        """The mode of the next pauses: the attacher keeps a proxy across syncs, and a spec whose
        `pause` changed must reach it (engines/vllm_servers.py)."""
        checked = _pause_mode(mode)
        with self._state:
            self._pause_mode = checked

    def pause_seconds(self) -> list[float]:
        """Seconds each apply held generation paused, in order (apart from transfer time)."""
        with self._state:
            return list(self._pauses)

    def ws_pause_seconds(self) -> float | None:
        """The pause the latest resume ended (None: that resume ended no pause); the commit
        phase reads it per replica for the report, right after resuming it."""
        with self._state:
            return self._last_pause

    def weight_version(self) -> str:
        return self._control.version()

    def _rpc(self, method: str, per_rank: dict[int, tuple]) -> list[Result]:
        with self._state:
            self._seq += 1
            seq = self._seq
        with self._store_lock:
            for i, args in per_rank.items():
                self._store.set(args_key(self._prefix, seq, i), pickle.dumps(args))
        results: list[Result] = []

        def work() -> str | None:
            self._send(method, seq, set(per_rank))
            if method != "ws_resume":
                return None
            # The answers are in (ws_resume runs inside update_weights): this session's finish
            # labels the engine with the version, where a second session would cost two more
            # round trips to every worker while generation is still paused.
            results.extend(self._answers(seq))
            # '' is a rank that does not know its version (set up by this proxy after another
            # proxy's commit): it resumes, but the engine keeps the label it has rather than ''
            return self._label_after(per_rank, results) or None

        with span(f"proxy.send.{method}"):
            if method in ("ws_pause", "ws_resume"):  # pause first; resume labels at finish
                self._in_session(work)
            else:  # one round trip to the engine where its control surface allows
                with self._session:
                    self._control.one_update({"seq": seq, "method": method})
        if not results:
            with span(f"proxy.await.{method}"):
                results = self._answers(seq)
        with self._store_lock:
            for i in range(self._ranks):
                self._store.delete_key(answer_key(self._prefix, seq, i))
                self._store.delete_key(args_key(self._prefix, seq, i))
        return results

    def _answers(self, seq: int) -> list[Result]:
        return [pickle.loads(self._await(answer_key(self._prefix, seq, i))) for i in range(self._ranks)]

    def _send(self, method: str, seq: int, ranks: set[int]) -> None:
        if method == "ws_pause":
            self._pause_engine(ranks)
        self._control.update({"seq": seq, "method": method})

    def _in_session(self, work: Callable[[], str | None], *, draft: bool = False) -> None:
        """`work` inside one vLLM weight-update session (`run_session`). `draft`: vLLM's
        draft-model session (its backend targets the drafter until finish)."""
        with self._session:
            start = self._control.start_draft if draft else self._control.start
            run_session(start, work, self._control.finish)

    def _label_after(self, per_rank: dict[int, tuple], results: list[Result]) -> str | None:
        """The version every local rank will have resumed on once this resume batch is counted
        (None: a rank is held or resumed on another version)."""
        with self._state:
            resumed = dict(self._resumed_on)
        resumed |= resumed_ranks(per_rank, results)
        if len(resumed) != self._ranks or len(set(resumed.values())) != 1:
            return None
        return next(iter(resumed.values()))

    def _after_batch(self, batch: Batch) -> None:
        if batch.method != "ws_resume":
            return
        ok = resumed_ranks(batch.args, batch.results)
        with self._state:
            self._last_pause = None
            self._held -= set(ok)
            self._resumed_on |= ok
            if self._held or len(set(self._resumed_on.values())) > 1:
                # A rank does not hold the version (its replica, a DP engine of this server, is
                # not resumed) or DP ranks hold different versions: vLLM pauses and labels a
                # server, not a DP rank, so it stays paused and no rank of this batch serves
                # (the commit phase resumes a server's replicas in one batch; the next sync
                # resends those out of serving).
                batch.results = [("ok", False) if i in ok else r for i, r in enumerate(batch.results)]
                self._held |= set(ok)
                for i in ok:
                    self._resumed_on.pop(i)
                return
        # _rpc's session already labelled the engine's outputs with the version
        with self._state:
            if self._paused_at is not None:
                self._control.resume()
                self._last_pause = time.monotonic() - self._paused_at
                self._pauses.append(self._last_pause)
                self._paused_at = None

    def _pause_engine(self, ranks: set[int]) -> None:
        """Pause the engine (vLLM pauses all of a server's DP engines at once) unless paused. A
        new pause holds every local rank: the engine resumes only once all have resumed on one
        version, so a data-parallel server never serves under a label one of its DP ranks does
        not hold."""
        with self._state:
            if self._paused_at is None:
                # From the call on: with `wait` it returns once the requests in flight finished,
                # and new requests have been held back meanwhile, which is part of the pause.
                started = time.monotonic()
                self._control.pause(self._pause_mode)
                self._paused_at = started
                self._held, self._resumed_on = set(range(self._ranks)), {}
            else:
                self._held |= ranks
                for i in ranks:
                    self._resumed_on.pop(i, None)

    def _await(self, key: str) -> bytes:
        """A worker's answer; a dead engine (checked every LIVENESS_S) fails the wait at once."""
        deadline = time.monotonic() + ANSWER_TIMEOUT_S
        checked = time.monotonic()
        while time.monotonic() < deadline:
            with self._store_lock:
                if self._store.check([key]):
                    return bytes(self._store.get(key))
            if time.monotonic() - checked > LIVENESS_S:
                if not self._control.alive():
                    raise ParticipantDied(f"vLLM engine stopped answering (waiting for {key})")
                checked = time.monotonic()
            time.sleep(POLL_S)
        raise DestinationError(f"no answer for {key} within {ANSWER_TIMEOUT_S:g}s")


def resumed_ranks(per_rank: dict[int, tuple], results: list[Result]) -> dict[int, str]:
    """The local ranks a `ws_resume` batch resumed, with the version each holds (a rank that
    does not hold it answered False and is not among them)."""
    return {i: str(args[0]) for i, args in per_rank.items() if results[i] == ("ok", True)}


def check_replicas(reported: list[int], first: int) -> None:
    """The workers' replicas, in local-index order, must be `first`, `first`+1, ... with the same
    number of workers each (a data-parallel server: one replica per DP rank; else one replica)."""
    per = reported.count(first)
    want = [first + i // max(per, 1) for i in range(len(reported))]
    if per == 0 or len(reported) % per or reported != want:
        raise DiscoveryError(f"workers report replicas {reported}, expected {want}")


def attach(
    name: str,
    namespace: str,
    control: EngineControl,
    *,
    replica: int = 0,
    pause: str = "keep",
    ranks: int = 8,
) -> Any:
    """A named `VllmEngineRanks` actor for one engine (discovery finds it by name prefix)."""
    import ray

    return (
        ray.remote(VllmEngineRanks)
        .options(name=name, namespace=namespace, num_cpus=0, max_concurrency=4 * ranks + 4)
        .remote(control, replica=replica, pause=pause)
    )
