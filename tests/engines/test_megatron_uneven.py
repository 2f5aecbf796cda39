"""Uneven pipeline stages on real Megatron-Core ranks: a 5-layer model at tp=2, pp=2, layers=3+2.

Megatron-Core builds the split with its own settings (num_layers_in_first/last_pipeline_stage);
the sync from those ranks is bit-exact, with a scrambled-weight control.
"""

from __future__ import annotations

import pytest
import ray

from sync_runtime.core.models import load_model_config
from sync_runtime.core.topology import ParallelSpec
from sync_runtime.errors import TopologyError
from sync_runtime.schema.report import SyncResult
from sync_runtime.testing.megatron_deploy import MegatronDeployment
from sync_runtime.testing.megatron_models import stage_sizes

pytestmark = pytest.mark.engines


def test_stage_sizes_are_megatrons_first_and_last() -> None:
    assert stage_sizes(ParallelSpec.parse("tp=2,pp=2,layers=3+2")) == {
        "num_layers_in_first_pipeline_stage": 3,
        "num_layers_in_last_pipeline_stage": 2,
    }
    assert stage_sizes(ParallelSpec.parse("pp=2")) == {}
    assert stage_sizes(ParallelSpec.parse("pp=4,layers=2+3+3+1"))["num_layers_in_last_pipeline_stage"] == 1
    with pytest.raises(TopologyError, match="stages between"):
        stage_sizes(ParallelSpec.parse("pp=4,layers=2+3+2+2"))


def test_uneven_3_plus_2_syncs_bit_exact(ray_address: str) -> None:
    dep = MegatronDeployment.start(4, "ws-megatron-uneven")
    try:
        config = load_model_config("tiny-llama") | {"num_hidden_layers": 5}
        built = dep.build(config, "tp=2,pp=2,layers=3+2", dst="tp=2")
        # The sources report the split; their live tensors (3 local layers on stage 0, 2 on
        # stage 1) are checked against the megatron layout before any byte moves.
        assert built[0]["spec"].layer_counts == (3, 2)
        reference = dep.reference()
        report = dep.sync("v1", ray_address)
        assert report.result is SyncResult.SUCCEEDED, report.model_dump_json()
        assert dep.verify(reference, "v1") == []
        ray.get(dep.trainers[3].scramble.remote("decoder.layers.1.mlp.linear_fc2.weight"))
        assert dep.sync("v2", ray_address).result is SyncResult.SUCCEEDED
        problems = dep.verify(reference, "v2")
        assert problems and all("differ from the reference" in p for p in problems), problems
    finally:
        dep.close()
