"""A Megatron-Core rank's live parameters in the orientation its layout declares (gpt-oss's experts).

The `megatron` layout declares gpt-oss's local expert tensors as boxes of the checkpoint's fused
tensors, in the checkpoint's orientation (layouts/megatron_gpt_oss.py `REORIENTED`). This module
turns a live parameter into that tensor (`to_sent`) and back (`to_live`): a view, a permutation and
a reshape, so every element keeps its bits. Where the result is a strided view of the live storage
(linear_fc2: a transpose) the rank reports the view itself; where it is not (linear_fc1: Megatron's
[gate; up] halves become the checkpoint's interleaved pairs, which no strides express) the rank
reports a stand-in of the right shape and dtype, and `ReorientedTensors.materialized` puts a fresh
copy in its place while a sync (or a checksum) reads it, then drops it: a trainer does not hold its
fc1 bytes twice between syncs. The live parameters the copies came from are fenced like the
engine fences its sources (transfer/fence.py: a step that wrote them meanwhile is reported).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, MutableMapping, Sequence
from dataclasses import dataclass

import torch

from sync_runtime.core.layouts.megatron_gpt_oss import (
    EXPERT_PREFIX,
    REORIENTED_BY_FAMILY,
    Reorient,
    grouped_shape,
    permuted_shape,
    sent_shape,
)
from sync_runtime.engines.megatron_names import LiveTensor


def to_sent(r: Reorient, live: torch.Tensor) -> torch.Tensor:
    """The layout's tensor of `live`: a view where strides express it, else a copy."""
    permuted = live.reshape(grouped_shape(r, tuple(live.shape))).permute(*r.perm)
    return permuted.reshape(sent_shape(r, tuple(live.shape)))


def to_live(r: Reorient, sent: torch.Tensor, live_shape: tuple[int, ...]) -> torch.Tensor:
    """The inverse of `to_sent`: the live parameter's elements from the layout's tensor."""
    inverse = tuple(r.perm.index(i) for i in range(len(r.perm)))
    permuted = sent.reshape(permuted_shape(r, live_shape))
    return permuted.permute(*inverse).reshape(live_shape)


def is_view(r: Reorient) -> bool:
    """Whether `to_sent` is a strided view of the live storage (no gate/up interleaving)."""
    return not r.halves


def reorientation(family: str, name: str) -> Reorient | None:
    """The reorientation of live tensor `name` (a layout name), None for a tensor held as is."""
    table = REORIENTED_BY_FAMILY.get(family)
    _, sep, tail = name.rpartition(EXPERT_PREFIX)
    if table is None or not sep:
        return None
    _, _, suffix = tail.partition(".")
    return table.get(suffix)


@dataclass(frozen=True, slots=True)
class _Copied:
    name: str
    live: torch.Tensor
    r: Reorient


class ReorientedTensors:
    """A rank's tensors as its layout declares them: live tensors as they are, reoriented ones as
    views, and those needing a copy as stand-ins until `materialized`."""

    def __init__(self, family: str, live: Sequence[LiveTensor]) -> None:
        self.reported: dict[str, torch.Tensor] = {}
        self._copied: list[_Copied] = []
        for lt in live:
            r = reorientation(family, lt.name)
            if r is None:
                self.reported[lt.name] = lt.tensor
            elif is_view(r):
                self.reported[lt.name] = to_sent(r, lt.tensor)
            else:
                self._copied.append(_Copied(lt.name, lt.tensor, r))
                self.reported[lt.name] = _stand_in(lt.tensor, sent_shape(r, tuple(lt.tensor.shape)))

    @property
    def copies(self) -> bool:
        return bool(self._copied)

    @contextlib.contextmanager
    def materialized(self, tensors: MutableMapping[str, torch.Tensor]) -> Iterator[Callable[[], str | None]]:
        """Fresh copies in `tensors` (a participant's registered dict) while the block runs, stand-ins
        again after. Yields a check: the first live parameter written since the copy, or None."""
        before = {c.name: (c.live.data_ptr(), c.live._version) for c in self._copied}
        for c in self._copied:
            tensors[c.name] = to_sent(c.r, c.live.detach()).contiguous()

        def moved() -> str | None:
            for c in self._copied:
                if (c.live.data_ptr(), c.live._version) != before[c.name]:
                    return c.name
            return None

        try:
            yield moved
        finally:
            for c in self._copied:
                tensors[c.name] = self.reported[c.name]


def _stand_in(like: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor of `shape`, `like`'s dtype and device, holding one element (stride 0): enough for
    what a participant reports between syncs (names, shapes, dtypes, device)."""
    return torch.zeros((), dtype=like.dtype, device=like.device).expand(shape)
