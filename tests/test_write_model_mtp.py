"""The seeded checkpoint writer (`write_model`) writes a model's MTP layers when it has them, so a
vLLM serving MTP loads its drafter from the checkpoint (the oracle of test_vllm_mtp.py), and
writes exactly what it always wrote for a model without them."""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import load_file

from sync_runtime.runtime.hf_manifest import build_manifest
from sync_runtime.testing.vllm_models import CONFIGS, write_model
from sync_runtime.testing.weights import bits_to_torch, canonical_tensor

pytestmark = pytest.mark.unit

MTP_CONFIG = CONFIGS["deepseek_v3"] | {"num_nextn_predict_layers": 1}


def test_mtp_layers_are_written_seeded_like_the_rest(tmp_path: Path) -> None:
    manifest = build_manifest(MTP_CONFIG)
    assert manifest.mtp  # layer 2 (num_hidden_layers = 2): the checkpoint's MTP layer
    written = load_file(write_model(tmp_path / "mtp", MTP_CONFIG, manifest, 3, "v1") + "/model.safetensors")
    assert set(written) == {t.name for t in (*manifest.tensors, *manifest.mtp)}
    for t in manifest.mtp:
        assert t.name.startswith("model.layers.2.")
        assert written[t.name].equal(bits_to_torch(canonical_tensor(t, 3, "v1"))), t.name
    assert "model.layers.2.eh_proj.weight" in written and "model.layers.2.shared_head.head.weight" in written


def test_a_model_without_mtp_layers_gets_the_same_file_as_before(tmp_path: Path) -> None:
    plain = build_manifest(CONFIGS["deepseek_v3"])
    with_mtp = build_manifest(MTP_CONFIG)
    assert not plain.mtp
    a = load_file(
        write_model(tmp_path / "plain", CONFIGS["deepseek_v3"], plain, 3, "v1") + "/model.safetensors"
    )
    b = load_file(write_model(tmp_path / "mtp", MTP_CONFIG, with_mtp, 3, "v1") + "/model.safetensors")
    assert set(a) == {t.name for t in plain.tensors}  # no MTP name in a model without MTP layers
    assert set(b) - set(a) == {t.name for t in with_mtp.mtp}
    assert all(a[n].equal(b[n]) for n in a)  # the model part's bytes do not depend on MTP
    # Deterministic: the same arguments give the same bytes (the reference cache keys on them).
    again = write_model(tmp_path / "again", CONFIGS["deepseek_v3"], plain, 3, "v1") + "/model.safetensors"
    assert Path(again).read_bytes() == (tmp_path / "plain" / "model.safetensors").read_bytes()
