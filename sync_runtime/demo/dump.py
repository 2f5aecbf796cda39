"""`weightsync demo --dump DIR`: the files of design §4.4, written from what the actors really hold.

DIR/manifest.json, DIR/reference.safetensors (canonical HF names, bf16),
DIR/destination/replica-{k}/pp{s}-tp{r}.safetensors (vLLM names, read back from each
destination actor after the sync), DIR/report.json (the last sync's report, and `syncs`: every
sync of the run). The default demo and `--source megatron-core` write the same files.

With `--engine vllm` (demo/vllm_run.py) a rank's weights live in vLLM's kernel layouts and
cannot be read back as tensors: each rank writes `pp{s}-tp{r}.checksums.json` instead (the
checksums of the bytes it applied, and those of its layout shard of the reference), and each
replica `generation.json` (its greedy generation before and after the sync, and the reference
engine's).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import ray
import torch
from safetensors.torch import save_file

from sync_runtime.core.topology import ParallelSpec
from sync_runtime.runtime.discovery import Participant
from sync_runtime.schema.report import SyncReport


def _side(layout: str, spec: ParallelSpec, keys: Sequence[str]) -> dict[str, Any]:
    return {"layout": layout, **{k: getattr(spec, k) for k in keys}}


def write_dump(
    out: Path,
    *,
    model_config: Mapping[str, Any],
    src_layout: str,
    src: ParallelSpec,
    dst: ParallelSpec,
    reference: Mapping[str, np.ndarray],
    destinations: Sequence[Participant],
    report: SyncReport,
    syncs: Sequence[SyncReport] = (),
) -> None:
    write_manifest(out, model_config=model_config, src_layout=src_layout, src=src, dst=dst)
    write_reference(out, reference)
    write_destinations(out, destinations)
    write_report(out, report, syncs)


def write_manifest(
    out: Path, *, model_config: Mapping[str, Any], src_layout: str, src: ParallelSpec, dst: ParallelSpec
) -> None:
    out.mkdir(parents=True, exist_ok=True)
    manifest = {
        "model": dict(model_config),
        "source": _side(src_layout, src, ("tp", "pp", "dp", "ep", "etp")),
        "destination": _side("vllm", dst, ("tp", "pp", "ep", "replicas")),
        "dtype": "bfloat16",
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")


def write_reference(out: Path, reference: Mapping[str, np.ndarray]) -> Path:
    """DIR/reference.safetensors: the canonical HF-named tensors (uint16 bits as bf16, uint32 as F32)."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / "reference.safetensors"
    save_file(
        {
            name: torch.from_numpy(np.ascontiguousarray(a)).view(
                torch.float32 if a.itemsize == 4 else torch.bfloat16
            )
            for name, a in reference.items()
        },
        str(path),
    )
    return path


def write_destinations(out: Path, destinations: Sequence[Participant]) -> None:
    """DIR/destination/replica-{k}/pp{s}-tp{r}.safetensors, read back from each rank."""
    for p in destinations:
        c = p.meta.coord
        names = [t.name for t in p.meta.tensors]
        tensors = ray.get([p.handle.ws_tensor.remote(n) for n in names])
        path = out / "destination" / f"replica-{c.replica}" / f"pp{c.pp_rank}-tp{c.tp_rank}.safetensors"
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file({n: t.contiguous() for n, t in zip(names, tensors, strict=True)}, str(path))


SYNC_FIELDS = ("version", "result", "seconds", "encoding", "wire_bytes", "full_bytes", "changed_fraction")
"""What report.json's `syncs` gives of every sync of the run (camelCase, as the report)."""


def write_report(out: Path, report: SyncReport, syncs: Sequence[SyncReport] = ()) -> None:
    """DIR/report.json: the dumped (last) sync's report, and under `syncs` a summary of every sync
    of the run, in order (encoding, wire and full bytes, changed fraction)."""
    out.mkdir(parents=True, exist_ok=True)
    doc = report.model_dump(mode="json", by_alias=True)
    doc["syncs"] = [
        s.model_dump(mode="json", by_alias=True, include=set(SYNC_FIELDS)) for s in syncs or (report,)
    ]
    (out / "report.json").write_text(json.dumps(doc, indent=2) + "\n")
