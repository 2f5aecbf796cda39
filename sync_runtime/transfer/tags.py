"""Message tags of one round (transfer/engine.py): both ends derive them from the plan."""

from __future__ import annotations

from sync_runtime.errors import PlanMismatchError

TAG_ROUND_SHIFT = 16  # up to 65536 messages per (pair, round); rounds wrap at 2^15, far beyond any plan


class Tags:
    """Message tags of one round: the round, and the message's index among those with the same peer.

    Both ends number a pair's messages in plan order (buckets, then messages in a bucket), so
    the n-th send to a peer matches the peer's n-th receive from this rank.
    """

    def __init__(self, round_index: int) -> None:
        self._round = round_index
        self._seen: dict[int, int] = {}

    def next(self, peer: int) -> int:
        k = self._seen.get(peer, 0)
        if k >= 1 << TAG_ROUND_SHIFT:
            raise PlanMismatchError(
                f"round {self._round}: more than {k} messages with rank {peer}", peer=peer
            )
        self._seen[peer] = k + 1
        return ((self._round << TAG_ROUND_SHIFT) | k) & 0x7FFFFFFF
