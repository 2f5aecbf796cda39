"""How the coordinator names a rank's transfer failure (runtime/drive.py `_named`): the rank's
participant, and the peer's when the failure names one, so that a dead server's pod (its proxy is
named after it) appears even when only the rank that talked to it could report the failure."""

from __future__ import annotations

from typing import Any, cast

import pytest

from sync_runtime.errors import ConnectError, SyncStep
from sync_runtime.runtime.discovery import Participant
from sync_runtime.runtime.drive import _named
from sync_runtime.transfer import RankResult

pytestmark = pytest.mark.unit

SOURCE = "trainer-src-0"
SERVER = "ws-dp-0000.vllm-head-7c9f.1a2b3c4d.0"


def _participants() -> list[Participant]:
    meta = cast(Any, None)  # _named reads names only
    return [Participant(handle=None, name=n, namespace="ns", meta=meta) for n in (SOURCE, SERVER)]


def _failed(rank: int, peer: int | None) -> RankResult:
    error = ConnectError("round 0: send failed: Connection reset by peer", rank=rank, peer=peer)
    return RankResult(rank, False, 0, 0, 0.0, failure=error.located(step=SyncStep.TRANSFER).to_failure())


def test_a_failure_caused_by_a_peer_names_the_peers_participant() -> None:
    failure = _named(_failed(0, peer=1), 0, _participants())
    assert failure.message.startswith(f"{SOURCE}: ")
    assert f"(peer: rank 1, {SERVER})" in failure.message
    assert (failure.rank, failure.peer) == (0, 1)


@pytest.mark.parametrize("peer", [None, 0, 7])
def test_without_a_known_other_peer_only_the_rank_is_named(peer: int | None) -> None:
    failure = _named(_failed(0, peer=peer), 0, _participants())
    assert failure.message.startswith(f"{SOURCE}: ")
    assert SERVER not in failure.message and "(peer:" not in failure.message
