"""Real Megatron-Core trainer ranks as a sync's source (used by `weightsync demo --source
megatron-core`, the engine tests and the source benchmark).

Trainer actors build a seeded Megatron model (local spec, gloo), blank vLLM-layout destinations
wait, the coordinator syncs (the manifest comes from what the sources report, per-tensor dtypes
included), and every destination rank is checked bit for bit against reference.safetensors:
canonical HF tensors converted from the Megatron shards by their own split attributes. Then one
real optimizer step and a second sync, checked the same way.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import ray
import torch

from sync_runtime.core.layouts import get_layout
from sync_runtime.core.layouts.materialize import materialize
from sync_runtime.core.topology import ParallelSpec, RankCoord, Role, enumerate_ranks
from sync_runtime.engines.megatron_convert import gather_full, to_hf
from sync_runtime.runtime.coordinator import Coordinator
from sync_runtime.runtime.hf_manifest import build_manifest
from sync_runtime.schema.crd import Transport
from sync_runtime.schema.report import SyncReport, SyncResult
from sync_runtime.testing.cluster import (
    DemoSetup,
    destination_name,
    verify_destinations,
    weightsync_spec,
)
from sync_runtime.testing.megatron_actors import BlankDestination, build_all, start_trainers

_UNPLACED = RankCoord(role=Role.DESTINATION)


class QuietReporter:
    def __init__(self) -> None:
        self.reports: list[SyncReport] = []

    def progress(self, event: Any) -> None:
        pass

    def finished(self, report: SyncReport) -> None:
        self.reports.append(report)


@dataclass
class MegatronDeployment:
    """Trainer actors (reusable across models) and the destinations of the current model."""

    namespace: str
    trainers: list[Any]
    src_prefix: str = "mtrainer-"
    dst_prefix: str = "minfer-"
    setup: DemoSetup | None = None
    destinations: list[Any] = field(default_factory=list)

    @classmethod
    def start(cls, world_size: int, namespace: str, src_prefix: str = "mtrainer-") -> MegatronDeployment:
        return cls(namespace, start_trainers(world_size, namespace, src_prefix), src_prefix)

    def build(
        self,
        hf_config: Mapping[str, Any],
        src: str,
        dst: str,
        dst_dtypes: Mapping[str, str] | None = None,
        **kw: Any,
    ) -> list[dict[str, Any]]:
        """(Re)build every trainer on `hf_config` at `src`, and fresh blank destinations at `dst`
        (`dst_dtypes`: destination tensors held in another dtype than the source's, tests)."""
        self.kill_destinations()
        built = build_all(self.trainers, hf_config, src, **kw)
        config = built[0]["model_config"]  # every rank reports the same (dtypes gathered)
        self.setup = DemoSetup(
            model="megatron-core",
            config=config,
            manifest=build_manifest(config),
            src=built[0]["spec"],
            dst=ParallelSpec.parse(dst),
            namespace=self.namespace,
            src_prefix=self.src_prefix,
            dst_prefix=self.dst_prefix,
        )
        cls = ray.remote(BlankDestination)
        for c in enumerate_ranks(self.setup.dst, Role.DESTINATION):
            c = dataclasses.replace(c, node=_UNPLACED.node, device=_UNPLACED.device)  # actors report theirs
            name = destination_name(self.dst_prefix, c)
            opts = {"name": name, "namespace": self.namespace, "num_cpus": 0}
            self.destinations.append(cls.options(**opts).remote(config, self.setup.dst, c, dst_dtypes))
        ray.get([h.ws_version.remote() for h in self.destinations])
        return built

    def reference(self) -> dict[str, torch.Tensor]:
        """Canonical HF tensors converted from every trainer's shards."""
        assert self.setup is not None
        exports = ray.get([h.export.remote() for h in self.trainers])
        return to_hf(gather_full(exports), self.setup.config)

    def sync(self, version: str, address: str, timeout_s: int = 120) -> SyncReport:
        """One sync through the coordinator; the manifest comes from the sources' reports."""
        assert self.setup is not None
        spec = weightsync_spec(
            self.setup, version, address=address, transport=Transport(transfer_timeout_seconds=timeout_s)
        ).model_copy(update={"model": None})
        coordinator = Coordinator(spec, QuietReporter())
        try:
            return coordinator.sync(version)
        finally:
            coordinator.close()

    def verify(self, reference: Mapping[str, torch.Tensor], version: str) -> list[str]:
        """Problems (empty: every destination rank holds `reference` under the vllm layout, bit for bit)."""
        assert self.setup is not None
        setup = self.setup
        canon = {n: _bits(t) for n, t in reference.items()}
        # Expected local tensors in the reference's dtypes (a test's reference may be cast to what
        # the destinations hold), so each element's bits keep their width.
        dtypes = {n: str(t.dtype).removeprefix("torch.") for n, t in reference.items()}
        tensors = tuple(
            dataclasses.replace(t, dtype=dtypes.get(t.name, t.dtype)) for t in setup.manifest.tensors
        )
        manifest = dataclasses.replace(setup.manifest, tensors=tensors)

        def want_for(coord: RankCoord) -> dict[str, str]:
            shard = get_layout("vllm").shard(manifest, setup.dst, coord)
            return {n: hashlib.sha256(a.tobytes()).hexdigest() for n, a in materialize(shard, canon).items()}

        return verify_destinations(setup, version, want_for)

    def sync_and_verify(self, version: str, address: str) -> dict[str, torch.Tensor]:
        """Sync `version` and check every destination holds its shard of the trainers' weights
        (the converter covers every canonical tensor); returns those weights."""
        reference = self.reference()
        assert set(reference) == {t.name for t in self.setup.manifest.tensors}  # the converter covers all
        report = self.sync(version, address)
        assert report.result is SyncResult.SUCCEEDED, report.model_dump_json()
        assert self.verify(reference, version) == []
        return reference

    def kill_destinations(self) -> None:
        for h in self.destinations:
            ray.kill(h, no_restart=True)
        self.destinations.clear()

    def close(self) -> None:
        self.kill_destinations()
        for h in self.trainers:
            ray.kill(h, no_restart=True)
        self.trainers.clear()


def _bits(t: torch.Tensor) -> np.ndarray:
    """A tensor's elements as unsigned-integer bit patterns (what layouts.materialize copies)."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()]
    return t.detach().contiguous().view(ints).numpy().view(f"u{t.element_size()}")


def save_reference(reference: Mapping[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({n: t.contiguous() for n, t in reference.items()}, str(path))


def load_reference(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


__all__ = ["MegatronDeployment", "QuietReporter", "load_reference", "save_reference"]
