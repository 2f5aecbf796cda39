"""Real vLLM destination, DeepSeek-V3 (MLA, noaux_tc router, shared experts) at TP 2.

vLLM's CPU MLA path is not repeat-deterministic, and this tiny model's next-token distribution
is nearly flat (chosen-token logprobs about -6.89 over a 1024-token vocabulary), so the noise
flips greedy tokens: one engine's generate calls of the same prompts disagree with each other
(the reference's 2nd and 3rd calls agreed with its 1st on 0 to 4 of 4 rows), and in CI the synced
engine's outputs matched none of the reference's three. Generation equality is therefore not
asserted for MLA; it is printed. What is asserted, deterministically:
- bit-exact weights: every rank's committed bytes (`ws_checksums`) equal the layout's shard of
  the seeded v1 weights for every tensor (negative control: the v0 weights' checksums differ);
- the derived tensors (`W_UV`, `W_UK_T`) are never synced: vLLM re-derives them at commit;
- dummy weights generate otherwise than the reference (0 of 4 rows equal).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import ray

from sync_runtime.core.layouts import get_layout
from sync_runtime.core.topology import ParallelSpec
from sync_runtime.demo.weights import bits_to_torch, shard_arrays
from sync_runtime.runtime.coordinator import Coordinator
from sync_runtime.schema.report import NullReporter, SyncResult
from sync_runtime.transfer.checksum import checksum_tensor, hex_digest
from tests.support.vllm_deploy import deploy, destination_ref, generations, rows_equal, sync_spec

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]
NS = "vllm-deepseek"
DST = ParallelSpec.parse("tp=2")


@pytest.fixture(scope="module")
def deployment(ray_address: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    with deploy(
        "deepseek_v3",
        tmp_path_factory.mktemp("dsv3") / "v1",
        src="tp=2",
        dst=DST,
        namespace=NS,
        engines={"ds": ("ds-r0", {"tp": 2})},
        references={"ref": ("ds-ref", {"tp": 2})},
        reference_calls=3,
    ) as d:
        spec = sync_spec(d.setup.model, NS, d.setup.src, [destination_ref("ds", NS, "ds-", DST)], "v1")
        yield {
            "setup": d.setup,
            "engine": d.engines["ds"],
            "ref": [c["ref"] for c in d.reference_calls],
            "spec": spec,
            "manifest": d.manifest,
        }


def test_engine_reports_the_mla_layout(deployment: dict[str, Any]) -> None:
    for meta in ray.get(deployment["engine"].ws_meta.remote()):
        got = {t.name: (tuple(t.shape), t.dtype) for t in meta.tensors}
        shard = get_layout("vllm").shard(deployment["manifest"], DST, meta.coord)
        assert got == {t.name: (tuple(t.shape), t.dtype) for t in shard.tensors}
        assert got["model.layers.1.self_attn.fused_qkv_a_proj.weight"] == ((704, 256), "bfloat16")
        # fp32 in vLLM; accepted in the checkpoint dtype and widened exactly at commit
        assert got["model.layers.1.mlp.gate.e_score_correction_bias"] == ((8,), "bfloat16")
        assert not any("W_UV" in n or "W_UK_T" in n for n in got)  # derived, never synced


SYNCED_CALLS = 2
"""Generate calls on the synced engine, printed against the reference's (not asserted)."""
BIAS = "e_score_correction_bias"  # staged and committed in vLLM's fp32 (widened from bf16 exactly)


def test_mla_sync_commits_the_exact_bytes_and_vllm_rederives_the_rest(deployment: dict[str, Any]) -> None:
    engine, ref = deployment["engine"], deployment["ref"]
    dummy = generations([engine])[0]
    coordinator = Coordinator(deployment["spec"], NullReporter(), manifest=deployment["manifest"])
    try:
        report = coordinator.sync("v1")
    finally:
        coordinator.close()
    assert report.result is SyncResult.SUCCEEDED, report.failure
    synced = [generations([engine])[0] for _ in range(SYNCED_CALLS)]
    metas = ray.get(engine.ws_meta.remote())
    applied = [ray.get(engine.ws_rank_call.remote(i, "ws_checksums", ())) for i in range(len(metas))]
    for meta, got in zip(metas, applied, strict=True):
        want = shard_arrays(deployment["manifest"], "vllm", DST, meta.coord, deployment["setup"].seed, "v1")
        tensors = {n: bits_to_torch(a) for n, a in want.items()}
        tensors = {n: t.float() if n.endswith(BIAS) else t for n, t in tensors.items()}
        assert got == {n: hex_digest(checksum_tensor(t)) for n, t in tensors.items()}, meta.coord
        other = shard_arrays(deployment["manifest"], "vllm", DST, meta.coord, deployment["setup"].seed, "v0")
        assert got != {n: hex_digest(checksum_tensor(bits_to_torch(a))) for n, a in other.items()}
    assert ray.get(engine.weight_version.remote()) == "v1"
    # Printed, not asserted (module docstring): how the synced calls compare with the reference's.
    print("deepseek reference repeat-determinism:", [rows_equal(ref[0], r) for r in ref])
    print("deepseek synced calls vs reference calls:", [[rows_equal(x, r) for r in ref] for x in synced])
    assert all(len(row["token_ids"]) == len(row["logprobs"]) > 0 for x in synced for row in x)
    assert all(rows_equal(dummy, r) == 0 for r in ref)  # negative control: dummy weights differ
