"""A continuous checker of serving replicas: reads every destination rank's (version, serving,
poisoned, checksums) at >= 20 Hz while a trial runs, and records every violation:

- a *mix*: ranks of one replica report different committed versions while any of them serves
  (ranks that do not answer report nothing);
- a *misnamed* replica: a serving rank whose checksums are not those of the version it names;
- a serving rank that is poisoned.

Expected checksums come from the seeded weights (`demo.weights`), so a check never trusts what
a participant says about itself. Ranks that do not answer (killed) count as not serving.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import ray

from sync_runtime.core.topology import RankCoord
from sync_runtime.demo.cluster import DemoSetup, destination_name
from sync_runtime.demo.weights import bits_to_torch, shard_arrays
from sync_runtime.transfer import checksum_tensor, hex_digest

HZ = 50.0
"""Target rate; a reading costs a few ms per rank, so the loop mostly runs back to back."""


@dataclass
class ServingChecker:
    setup: DemoSetup
    coords: list[RankCoord]
    versions: set[str]
    """Every version a trial may show (their checksums are precomputed)."""
    violations: list[str] = field(default_factory=list)
    samples: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _expected: dict[tuple[str, str], dict[str, str]] = field(default_factory=dict)
    _handles: dict[str, object] = field(default_factory=dict)
    _looked: dict[str, float] = field(default_factory=dict)
    _pending: dict[str, object] = field(default_factory=dict)
    answers: dict[str, int] = field(default_factory=dict)
    """Readings per rank (a rank that was dead or starting for a while has fewer)."""

    def __post_init__(self) -> None:
        for c in self.coords:
            for v in self.versions:
                arrays = shard_arrays(self.setup.manifest, "vllm", self.setup.dst, c, self.setup.seed, v)
                sums = {n: hex_digest(checksum_tensor(bits_to_torch(a))) for n, a in arrays.items()}
                self._expected[(self._name(c), v)] = sums

    def _name(self, c: RankCoord) -> str:
        return destination_name(self.setup.dst_prefix, c)

    def observe(self, wait_s: float = 2.0) -> dict[str, tuple | None]:
        """One reading of every rank: name -> (version, serving, poisoned, checksums), or None
        for a rank that did not answer within `wait_s` (dead, or still being constructed).

        A call still pending from an earlier tick is waited for instead of stacking another: a
        reading is never older than the tick it is used in, so stale readings of two ranks
        are never compared (that could only invent mixes, never hide one).
        """
        for c in self.coords:
            name = self._name(c)
            if name not in self._pending:
                handle = self._handles.get(name) or self._lookup(name)
                if handle is not None:
                    self._pending[name] = handle.ws_observe.remote()
        refs = list(self._pending.values())
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=wait_s) if refs else ([], [])
        done = set(ready)
        out: dict[str, tuple | None] = {self._name(c): None for c in self.coords}
        for name, ref in list(self._pending.items()):
            if ref not in done:
                continue
            del self._pending[name]
            try:
                out[name] = ray.get(ref)
                self.answers[name] = self.answers.get(name, 0) + 1
            except ray.exceptions.RayError:
                self._handles.pop(name, None)  # killed: look the name up again (it may come back)
        return out

    def _lookup(self, name: str):
        """Name lookups go to Ray's GCS (tens of ms on a loaded machine): cached, and a missing
        name is asked for again at most every 0.5 s so the reading rate holds."""
        now = time.monotonic()
        if now - self._looked.get(name, 0.0) < 0.5:
            return None
        self._looked[name] = now
        try:
            self._handles[name] = ray.get_actor(name, namespace=self.setup.namespace)
        except ValueError:
            return None
        return self._handles[name]

    def check(self, reading: dict[str, tuple | None]) -> list[str]:
        problems = []
        replicas: dict[int, list[RankCoord]] = {}
        for c in self.coords:
            replicas.setdefault(c.replica, []).append(c)
        for replica, members in replicas.items():
            got = [reading.get(self._name(c)) for c in members]
            if not any(g is not None and g[1] for g in got):
                continue  # not serving: anything goes while it is paused
            # A rank that does not answer reports no committed version (it died: its replica
            # cannot serve anyway, and the coordinator pauses the survivors before any commit).
            versions = {g[0] for g in got if g is not None}
            if len(versions) != 1:
                problems.append(f"replica {replica} serves with ranks on {sorted(map(str, versions))}")
            for c, g in zip(members, got, strict=True):
                if g is None or not g[1]:
                    continue
                if g[2]:
                    problems.append(f"{self._name(c)} serves while poisoned")
                want = self._expected.get((self._name(c), g[0]))
                if want is None:
                    problems.append(f"{self._name(c)} serves {g[0]!r}, a version this trial never made")
                elif g[3] != want:
                    problems.append(f"{self._name(c)} serves as {g[0]!r} with other bytes")
        return problems

    def _run(self) -> None:
        period = 1.0 / HZ
        while not self._stop.is_set():
            started = time.monotonic()
            self.violations += self.check(self.observe(wait_s=period))
            self.samples += 1
            self._stop.wait(max(0.0, period - (time.monotonic() - started)))

    def __enter__(self) -> ServingChecker:
        self._started = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="serving-checker", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join(10)
        self.elapsed = time.monotonic() - self._started

    @property
    def rate_hz(self) -> float:
        """Readings per second of the rank read least often (alive the whole trial)."""
        return min(self.answers.values(), default=0) / self.elapsed if self.elapsed else 0.0

    def final(self) -> dict[int, str | None]:
        """Per replica, the one version all its ranks hold and serve (None: not so)."""
        reading = {}  # its own calls: the checker thread may still be running its ticks
        for c in self.coords:
            try:
                handle = ray.get_actor(self._name(c), namespace=self.setup.namespace)
                reading[self._name(c)] = ray.get(handle.ws_observe.remote(), timeout=30)
            except (ValueError, ray.exceptions.RayError):
                reading[self._name(c)] = None
        out: dict[int, str | None] = {}
        for c in self.coords:
            g = reading.get(self._name(c))
            key = g[0] if g is not None and g[1] and not g[2] else None
            if key is not None and g[3] != self._expected.get((self._name(c), key)):
                key = None
            out[c.replica] = key if out.get(c.replica, key) == key else None
        return out
