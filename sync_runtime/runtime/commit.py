"""The commit phase of a sync: a two-phase commit over every destination rank, and recovery.

prepare (inside ws_run: each destination rank records `prepared` with version and checksum)
-> decide (the coordinator writes `commit:<version>` or `abort` once, compare_set) -> apply,
one engine at a time: pause all its ranks, commit them, and resume it only when every rank
holds the new version. Other engines keep serving meanwhile, each on one complete version. An
engine is one replica, except a data-parallel vLLM server: its DP engines are replicas of their
own, but vLLM pauses, resumes and labels the server as a whole, so they commit together.
A replica whose ranks disagree (one died or failed its commit after the decision) stays paused
and is reported `Degraded` with reason `MixedVersions`; the next sync resends it in full.

`recover` runs before each sync: it reads every destination's own account of its last
transaction (`ws_txn_state`) and the record, finishes what a previous coordinator left (roll
forward when the decision was commit, back otherwise) and resumes the replicas that hold one
complete version.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import ray

from sync_runtime.errors import MixedVersions, ReplicaPoisoned, SyncFailure, SyncStep
from sync_runtime.runtime.calls import remote_error
from sync_runtime.runtime.discovery import DiscoveredSide, Participant
from sync_runtime.schema.report import ReplicaState, ReplicaVersion
from sync_runtime.transfer import CommitRecord, commit_decision, parse_decision

log = logging.getLogger("weightsync.commit")


@dataclass(frozen=True, slots=True)
class Dest:
    """A destination rank: its global rank, participant, and deployment (DeploymentRef.name)."""

    rank: int
    p: Participant
    deployment: str


@dataclass(frozen=True, slots=True)
class CommitHooks:
    """Test-only observer of the commit phase (fault injection), like the engine's EngineHooks."""

    after_decision: Callable[[], None] | None = None
    after_replica: Callable[[int], None] | None = None
    """(index of the replica just settled, in commit order)."""


def destinations(sides: Sequence[DiscoveredSide]) -> list[Dest]:
    """The destination ranks of discovered sides (source first), with their global ranks."""
    out, rank = [], len(sides[0].participants)
    for side in sides[1:]:
        for p in side.participants:
            out.append(Dest(rank, p, side.ref.name))
            rank += 1
    return out


def begin_txn(dests: Sequence[Dest], staging: Mapping[int, str], timeout_s: float) -> str:
    """A new transaction's name. Every replica of an `inplace` deployment (`staging`: rank ->
    policy) is paused first, all its ranks together: live memory is overwritten from the first
    byte on."""
    paused = [(d.p, "ws_pause", ()) for d in dests if staging.get(d.rank) == "inplace"]
    if paused:
        call_each(paused, timeout_s)
    return f"txn-{secrets.token_hex(12)}"


def replicas_of(dests: Sequence[Dest]) -> dict[tuple[str, int], list[Dest]]:
    """Destination ranks grouped by (deployment, replica index), in rank order."""
    out: dict[tuple[str, int], list[Dest]] = {}
    for d in dests:
        out.setdefault((d.deployment, d.p.meta.coord.replica), []).append(d)
    return out


def engines_of(dests: Sequence[Dest]) -> list[list[list[Dest]]]:
    """Replicas (their ranks) grouped by the engine that serves them, in rank order: replicas
    whose ranks one multi-rank actor drives (a data-parallel vLLM server's proxy) are one
    engine; any other replica is one of its own."""
    out: dict[Any, list[list[Dest]]] = {}
    for key, members in replicas_of(dests).items():
        engine = engine_actor(members[0])
        out.setdefault(key if engine is None else engine, []).append(members)
    return list(out.values())


def engine_actor(d: Dest) -> Any:
    """The multi-rank actor behind a destination rank (a RankHandle's: an engine's proxy), or None
    for a rank that is an actor of its own."""
    return getattr(d.p.handle, "actor", None)


def call_each(calls: Sequence[tuple[Participant, str, tuple]], timeout_s: float) -> list[Any]:
    """Concurrent calls; per call its result or the WeightSyncError it failed with."""
    if not calls:
        return []
    refs = [getattr(p.handle, m).remote(*args) for p, m, args in calls]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    done, out = set(ready), []
    for (p, m, _), r in zip(calls, refs, strict=True):
        if r not in done:
            out.append(MixedVersions(f"{m} on {p.name}: no answer within {timeout_s:g}s"))
            continue
        try:
            out.append(ray.get(r))
        except ray.exceptions.RayError as e:
            out.append(remote_error(e, f"{m} on {p.name}"))
    return out


def two_phase_commit(
    dests: Sequence[Dest],
    version: str,
    record: CommitRecord,
    timeout_s: float,
    hooks: CommitHooks | None = None,
) -> tuple[list[ReplicaVersion], SyncFailure | None]:
    """Decide and apply `version` on every destination replica; (replica versions, failure)."""
    ranks = [d.rank for d in dests]
    prepared = record.prepared(ranks)
    ready = len(prepared) == len(ranks) and all(p.version == version for p in prepared.values())
    standing = record.decide(commit_decision(version) if ready else "abort")
    kind, decided = parse_decision(standing)
    if hooks is not None and hooks.after_decision is not None:
        hooks.after_decision()
    if kind != "commit" or decided != version:
        call_each([(d.p, "ws_abort", ()) for d in dests], timeout_s)
        missing = sorted(set(ranks) - set(prepared))
        failure = MixedVersions(
            f"decision {standing!r} for {version!r}: ranks {missing} did not prepare", step=SyncStep.COMMIT
        )
        return settle(dests, timeout_s), failure.to_failure()
    out: list[ReplicaVersion] = []
    for group in engines_of(dests):
        members = [d for replica in group for d in replica]
        call_each([(d.p, "ws_pause", ()) for d in members], timeout_s)
        results = call_each([(d.p, "ws_commit", (version,)) for d in members], timeout_s)
        for d, res in zip(members, results, strict=True):
            if isinstance(res, Exception):
                log.warning("commit of %s on rank %d (%s) failed: %s", version, d.rank, d.p.name, res)
        settled = settle(members, timeout_s)
        if hooks is not None and hooks.after_replica is not None:
            for i in range(len(out), len(out) + len(settled)):
                hooks.after_replica(i)
        out += settled
    return out, replica_failure(out)


def settle(
    dests: Sequence[Dest], timeout_s: float, unanswered: frozenset[int] = frozenset()
) -> list[ReplicaVersion]:
    """Each replica's state; resumes those whose ranks all hold one complete version (new, or
    old when none of its ranks could apply the new one); the others stay paused. The resumes go
    out together: an engine that serves several replicas (a data-parallel server) answers for
    all its ranks at once, and resumes only when every one holds the same version.
    `unanswered`: ranks not asked (still inside a failed transfer, which a call would queue
    behind); each counts as a rank that did not answer, so its replica is still reported (out
    of serving, its version unknown) rather than left out or judged by its other ranks."""
    asked = [d for d in dests if d.rank not in unanswered]
    states = call_each([(d.p, "ws_txn_state", ()) for d in asked], timeout_s)
    by_rank: dict[int, Any] = {d.rank: s for d, s in zip(asked, states, strict=True)}
    for d in dests:
        if d.rank in unanswered:
            by_rank[d.rank] = MixedVersions(f"{d.p.name}: still in the failed transfer, not asked")
    replicas = replicas_of(dests)
    got = {k: [by_rank[d.rank] for d in m] for k, m in replicas.items()}
    versions = {k: [None if isinstance(s, Exception) else s.version for s in g] for k, g in got.items()}
    poisoned = {k for k, g in got.items() if any(not isinstance(s, Exception) and s.poisoned for s in g)}
    held = [k for k, v in versions.items() if len(set(v)) == 1 and v[0] is not None and k not in poisoned]
    resumes = [(d, versions[k][0]) for k in held for d in replicas[k]]
    answers = call_each([(d.p, "ws_resume", (v,)) for d, v in resumes], timeout_s)
    resumed = {d.rank: a is True for (d, _), a in zip(resumes, answers, strict=True)}
    out = []
    for (deployment, replica), members in replicas.items():
        key = (deployment, replica)
        uniform = key in held and all(resumed[d.rank] for d in members)
        if uniform:
            state, reason = ReplicaState.SERVING, None
        elif key in poisoned:
            state, reason = ReplicaState.POISONED, ReplicaPoisoned.reason.value
        else:
            state, reason = ReplicaState.DEGRADED, MixedVersions.reason.value
        out.append(
            ReplicaVersion(
                deployment=deployment, replica=replica, version=versions[key][0] if uniform else None,
                state=state, reason=reason, rank_versions=versions[key],
                pause_seconds=replica_pause_seconds(members, timeout_s) if uniform else None,
            )
        )  # fmt: skip
    return out


def replica_pause_seconds(members: Sequence[Dest], timeout_s: float) -> float | None:
    """The pause a replica measured itself, read right after its resume: an engine's proxy
    (engines/vllm_ranks.py, all ranks of one engine behind one actor) has `ws_pause_seconds`;
    any other destination reports none."""
    proxy = engine_actor(members[0])
    method = getattr(proxy, "ws_pause_seconds", None) if proxy is not None else None
    if method is None:
        return None
    try:
        seconds = ray.get(method.remote(), timeout=timeout_s)
    except ray.exceptions.RayError as e:
        log.warning("pause seconds of %s: %s", members[0].p.name, e)
        return None
    return None if seconds is None else float(seconds)


def replica_failure(replicas: Sequence[ReplicaVersion]) -> SyncFailure | None:
    bad = [r for r in replicas if r.state is not ReplicaState.SERVING]
    if not bad:
        return None
    r = bad[0]
    kind = ReplicaPoisoned if r.state is ReplicaState.POISONED else MixedVersions
    text = ", ".join(f"{x.deployment} replica {x.replica}: {_ranks_state(x)}" for x in bad)
    return kind(f"{len(bad)} replica(s) out of serving until the next sync repairs them: {text}").to_failure()


def _ranks_state(r: ReplicaVersion) -> str:
    versions = r.rank_versions
    if r.state is ReplicaState.DEGRADED and len(set(versions)) == 1 and versions[0] is not None:
        # every rank holds one version, yet its engine stayed paused: a data-parallel server
        # whose other DP engine (another replica) is out of serving, or a resume that failed
        return f"ranks on {versions}, but their engine did not resume"
    return f"ranks on {versions}"


def recover(dests: Sequence[Dest], store: Any, timeout_s: float) -> tuple[list[ReplicaVersion], list[str]]:
    """Finish the transactions a previous coordinator (or sync) left open; (replicas, actions)."""
    states = call_each([(d.p, "ws_txn_state", ()) for d in dests], timeout_s)
    open_txns: dict[str, list[tuple[Dest, Any]]] = {}
    for ranked, s in zip(dests, states, strict=True):
        if not isinstance(s, Exception) and s.txn:
            open_txns.setdefault(s.txn, []).append((ranked, s))
    actions = []
    for txn, members in open_txns.items():
        if not any(s.phase == "prepared" for _, s in members):
            continue  # nothing staged waits for a decision
        version = next(s.pending_version for _, s in members)
        record = CommitRecord(store, txn)
        # One committed rank proves the decision was commit: commits only follow it.
        committed = any(s.phase == "committed" for _, s in members)
        standing = record.decide(commit_decision(version) if committed else "abort")
        kind, decided = parse_decision(standing)
        prepared = [ranked for ranked, s in members if s.phase == "prepared"]
        if kind == "commit" and decided == version:
            actions.append(f"{txn}: roll forward {version} on ranks {[d.rank for d in prepared]}")
            call_each([(d.p, "ws_pause", ()) for d in prepared], timeout_s)
            call_each([(d.p, "ws_commit", (version,)) for d in prepared], timeout_s)
        else:
            actions.append(f"{txn}: roll back {version} on ranks {[d.rank for d in prepared]}")
            call_each([(d.p, "ws_abort", ()) for d in prepared], timeout_s)
    return settle(dests, timeout_s), actions


def open_store(host: str, timeout_s: float, address: tuple[str, int] | None = None) -> Any:
    """The coordinator's TCPStore: the ranks' control plane and the commit record.

    With `address`, a client of a store hosted elsewhere (it outlives this coordinator, so a
    restarted one finds the record). Otherwise this process hosts it: TCPStore's master listens
    on every interface whatever `host` says; a socket bound to the advertised address (port 0:
    the OS picks) and handed over keeps it off the others.
    """
    import socket
    from datetime import timedelta

    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    if address is not None:
        return dist.TCPStore(address[0], address[1], is_master=False, timeout=timeout)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.create_server((host, 0), family=family, backlog=1024)
    port = listener.getsockname()[1]
    fd = listener.detach()  # the store owns the fd from here on
    return dist.TCPStore(
        host, port, is_master=True, wait_for_workers=False, timeout=timeout, master_listen_fd=fd
    )
