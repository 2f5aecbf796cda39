"""A continuous checker of serving replicas. Every destination rank is read back to back (tens
of readings a second per rank) while a trial runs: (version, serving, poisoned, checksums, when),
taken atomically by `ws_observe` under the participant's lock, `when` on the host's monotonic
clock (all ranks of these tests share one host). Violations:

- a *mix*: at some instant, ranks of one replica hold different committed versions while one
  of them serves. A rank's state at the instant of another rank's reading is known when its
  readings just before and just after that instant agree (versions only move forward inside a
  trial, so the state did not change in between); a rank that does not answer (killed)
  reports no version;
- a *misnamed* reading: a serving rank whose checksums are not those of the version it names,
  or a version the trial never made;
- a serving rank that is poisoned.

Expected checksums come from the seeded weights (`demo.weights`), never from the participants.
"""

from __future__ import annotations

import bisect
import threading
import time
from dataclasses import dataclass, field

import ray

from sync_runtime.core.topology import RankCoord
from sync_runtime.testing.cluster import DemoSetup, destination_name
from sync_runtime.testing.weights import bits_to_torch, shard_arrays
from sync_runtime.transfer import checksum_tensor, hex_digest

Reading = tuple  # (version, serving, poisoned, checksums, when)


@dataclass
class ServingChecker:
    setup: DemoSetup
    coords: list[RankCoord]
    versions: set[str]
    """Every version a trial may show (their checksums are precomputed)."""
    violations: list[str] = field(default_factory=list)
    answers: dict[str, int] = field(default_factory=dict)
    """Readings per rank (a rank that was dead or starting for a while has fewer)."""
    elapsed: float = 0.0
    _readings: dict[str, list[Reading]] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _expected: dict[tuple[str, str], dict[str, str]] = field(default_factory=dict)
    _handles: dict[str, object] = field(default_factory=dict)
    _looked: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for c in self.coords:
            for v in self.versions:
                arrays = shard_arrays(self.setup.manifest, "vllm", self.setup.dst, c, self.setup.seed, v)
                sums = {n: hex_digest(checksum_tensor(bits_to_torch(a))) for n, a in arrays.items()}
                self._expected[(self._name(c), v)] = sums

    def _name(self, c: RankCoord) -> str:
        return destination_name(self.setup.dst_prefix, c)

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

    def _misnamed(self, name: str, r: Reading) -> list[str]:
        version, serving, poisoned, sums, _ = r
        if not serving:
            return []
        if poisoned:
            return [f"{name} serves while poisoned"]
        want = self._expected.get((name, version))
        if want is None:
            return [f"{name} serves {version!r}, a version this trial never made"]
        return [f"{name} serves as {version!r} with other bytes"] if sums != want else []

    def _run(self) -> None:
        """Each rank's next call goes out as soon as its previous one answered."""
        pending: dict[object, str] = {}
        while not self._stop.is_set():
            busy = set(pending.values())
            for c in self.coords:
                name = self._name(c)
                handle = None if name in busy else self._handles.get(name) or self._lookup(name)
                if handle is not None:
                    pending[handle.ws_observe.remote()] = name
            if not pending:
                self._stop.wait(0.05)
                continue
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=0.1)
            for ref in ready:
                name = pending.pop(ref)
                try:
                    reading = ray.get(ref)
                except ray.exceptions.RayError:
                    self._handles.pop(name, None)  # killed: look the name up again (it may come back)
                    self._readings.setdefault(name, []).append((None, False, False, {}, time.monotonic()))
                    continue
                self._readings.setdefault(name, []).append(reading)
                self.answers[name] = self.answers.get(name, 0) + 1
                self.violations += self._misnamed(name, reading)

    def _state_at(self, name: str, when: float, times: dict[str, list[float]]) -> Reading | None:
        """The rank's reading at `when` if its readings around `when` agree, else None."""
        rs = self._readings.get(name, [])
        i = bisect.bisect_right(times[name], when)
        if i == 0 or i == len(rs):
            return None
        before, after = rs[i - 1], rs[i]
        return before if before[:2] == after[:2] else None

    def mixes(self) -> list[str]:
        out = []
        replicas: dict[int, list[str]] = {}
        for c in self.coords:
            replicas.setdefault(c.replica, []).append(self._name(c))
        times = {n: [r[4] for r in self._readings.get(n, [])] for ns in replicas.values() for n in ns}
        for replica, names in replicas.items():
            for x in names:
                for r in self._readings.get(x, []):
                    for y in names:
                        s = self._state_at(y, r[4], times) if y != x else None
                        if s is None or r[0] is None or s[0] is None or r[0] == s[0]:
                            continue
                        if r[1] or s[1]:
                            out.append(f"replica {replica}: {x} {r[0]!r} (serving={r[1]}) while {y} "
                                       f"{s[0]!r} (serving={s[1]}) at t={r[4]:.3f}")  # fmt: skip
        return out

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
        self.violations += self.mixes()

    def final(self) -> dict[int, str | None]:
        """Per replica, the one version all its ranks hold and serve (None: not so)."""
        out: dict[int, str | None] = {}
        for c in self.coords:
            try:
                handle = ray.get_actor(self._name(c), namespace=self.setup.namespace)
                g = ray.get(handle.ws_observe.remote(), timeout=30)
            except (ValueError, ray.exceptions.RayError):
                g = None
            key = g[0] if g is not None and g[1] and not self._misnamed(self._name(c), g) else None
            out[c.replica] = key if out.get(c.replica, key) == key else None
        return out
