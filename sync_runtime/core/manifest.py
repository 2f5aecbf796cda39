"""Canonical model description: the tensors of the published Hugging Face checkpoint (design §3)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

MODEL_PART = "model"
MTP_PART = "mtp"
"""The checkpoint's parts: the model every destination gets, and the MTP (draft) layers
(DeepSeek-V3's `num_nextn_predict_layers`), sent only to destinations that serve them."""
DTYPE_BYTES: dict[str, int] = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1}
CASTABLE_DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")
"""Dtypes a destination may hold a tensor in when the wire carries another of them: the receiving
rank casts once (round to nearest even; widening is exact). FP8, integers and bool are never cast:
their values are scaled or exact codes, not numbers a rounding may change."""


def cast_defined(wire: str, destination: str) -> bool:
    """True when a destination holding `destination` may receive `wire` bytes (equal, or both castable)."""
    return wire == destination or (wire in CASTABLE_DTYPES and destination in CASTABLE_DTYPES)


@dataclass(frozen=True, slots=True)
class TensorMeta:
    """One canonical (HF-named) tensor: name, full shape, dtype name as in torch (e.g. "bfloat16")."""

    name: str
    shape: tuple[int, ...]
    dtype: str = "bfloat16"
    part: str = MODEL_PART
    """MODEL_PART, or MTP_PART for a tensor of an MTP layer (`model.layers.{L..L+n-1}.*`)."""

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_BYTES[self.dtype]


@dataclass(frozen=True, slots=True)
class Manifest:
    """The canonical tensors of a model, in checkpoint order, and the config they came from.

    `tensors` is what a plan moves to every destination; `mtp` is the MTP part (part MTP_PART),
    kept apart so that layouts, engines and plans that know nothing of MTP never see it. A plan
    with a destination that serves MTP plans `with_mtp()`, whose `tensors` hold both parts.
    """

    family: str
    tensors: tuple[TensorMeta, ...]
    config: dict = field(default_factory=dict, compare=False, hash=False)
    dtype: str = "bfloat16"
    mtp: tuple[TensorMeta, ...] = ()

    def by_name(self) -> dict[str, TensorMeta]:
        return {t.name: t for t in self.tensors}

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def part_nbytes(self, part: str) -> int:
        """Bytes of one part, wherever its tensors are listed (`tensors` or `mtp`)."""
        return sum(t.nbytes for t in (*self.tensors, *self.mtp) if t.part == part)

    def with_mtp(self) -> Manifest:
        """Both parts in `tensors` (model first, then MTP), `mtp` empty: what a destination that
        serves MTP shards, and what the plan's sources must hold."""
        return dataclasses.replace(self, tensors=self.tensors + self.mtp, mtp=())
