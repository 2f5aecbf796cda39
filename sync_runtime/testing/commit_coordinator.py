"""A coordinator in its own process, killed by its own hook after the first replica committed.

`python -m sync_runtime.testing.commit_coordinator SETUP_JSON`: joins the Ray cluster and the store
named in the JSON, runs one sync of `version`, and `os._exit(KILLED)` right after replica
`kill_after_replica` was settled (its ranks committed), before the next replica commits: what a
runtime pod killed half way through the commit phase leaves behind.
"""

from __future__ import annotations

import json
import os
import sys

import ray

from sync_runtime.runtime.commit import CommitHooks
from sync_runtime.runtime.coordinator import Coordinator
from sync_runtime.schema.crd import Transport
from sync_runtime.schema.report import NullReporter
from sync_runtime.testing.cluster import DemoSetup, weightsync_spec

KILLED = 9


def main(arg: str) -> int:
    cfg = json.loads(arg)
    ray.init(address=cfg["address"], namespace=cfg["namespace"], log_to_driver=False)
    setup = DemoSetup.create(
        cfg["model"], cfg["src"], cfg["dst"], namespace=cfg["namespace"], seed=cfg["seed"]
    )
    transport = Transport(transfer_timeout_seconds=cfg["timeout"], connect_timeout_seconds=30)
    spec = weightsync_spec(setup, cfg["version"], address=cfg["address"], transport=transport)

    def die(replica: int) -> None:
        if replica == cfg["kill_after_replica"]:
            os._exit(KILLED)

    coordinator = Coordinator(
        spec,
        NullReporter(),
        manifest=setup.manifest,
        advertise_host="127.0.0.1",
        store_address=(cfg["store_host"], cfg["store_port"]),
        commit_hooks=CommitHooks(after_replica=die),
    )
    report = coordinator.sync(cfg["version"])
    print(report.model_dump_json(by_alias=True))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
