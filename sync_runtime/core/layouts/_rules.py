"""Shared machinery of the layouts: a parsed view of a manifest, range arithmetic, a shard builder.

Layouts run `shard()` for every rank of models with ~70k tensors, so the per-manifest parsing
(names -> layers, experts) happens once and is cached by manifest identity, and per-rank results
are cached by the coordinates that determine them (see `RankCache`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import TypeVar, cast

from sync_runtime.core.gc_pause import gc_paused
from sync_runtime.core.layouts.base import Box, LocalTensorMeta, Piece, Range, RankShard
from sync_runtime.core.manifest import MTP_PART, Manifest, TensorMeta
from sync_runtime.core.models.config import MOE_CHECKPOINT_NAMES, ModelDims, model_dims, mtp_layer_count
from sync_runtime.core.topology import ParallelSpec, RankCoord, stage_layer_ranges
from sync_runtime.errors import LayoutError, ModelConfigError, TopologyError

EMBED = "model.embed_tokens.weight"
LM_HEAD = "lm_head.weight"
FINAL_NORM = "model.norm.weight"
TOP_LEVEL = frozenset({EMBED, LM_HEAD, FINAL_NORM})
EXPERT_SUFFIXES = frozenset({"gate_proj.weight", "up_proj.weight", "down_proj.weight"})


def part(n: int, t: int, r: int) -> Range:
    """The r-th of t contiguous parts of range(n) (design §4: `[r*n/t, (r+1)*n/t)`)."""
    return (r * n // t, (r + 1) * n // t)


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def kv_head_range(nkv: int, t: int, r: int) -> Range:
    """KV heads of TP rank r (design §4.1): r-th of t when t <= nkv, else the single head r // (t // nkv)."""
    if t <= nkv:
        return part(nkv, t, r)
    head = r // (t // nkv)
    return (head, head + 1)


def require(ok: bool, layout: str, subject: str, constraint: str) -> None:
    """Raise the LayoutError format every layout uses: "<layout>: <tensor or field>: <constraint>"."""
    if not ok:
        raise LayoutError(f"{layout}: {subject}: {constraint}")


def require_stage_split(num_layers: int, spec: ParallelSpec, layout: str) -> None:
    """The layout's PP split exists (even, or the explicit layer counts add up)."""
    try:
        stage_layer_ranges(num_layers, spec.pp, spec.layer_counts)
    except TopologyError as e:
        raise LayoutError(f"{layout}: pp: {e}") from e


@dataclass(frozen=True, slots=True)
class LayerView:
    """The canonical tensors of one decoder layer, keyed by name suffix after `model.layers.{i}.`."""

    index: int
    prefix: str
    """`model.layers.{i}.`"""
    dense: dict[str, TensorMeta]
    """Every non-routed-expert tensor of the layer."""
    experts: tuple[dict[str, TensorMeta], ...]
    """Per routed expert e: {"gate_proj.weight", "up_proj.weight", "down_proj.weight"}."""


@dataclass(frozen=True, slots=True)
class ModelView:
    manifest: Manifest
    dims: ModelDims
    top: dict[str, TensorMeta]
    layers: tuple[LayerView, ...]
    mtp: tuple[LayerView, ...] = ()
    """The MTP layers (part "mtp", indices >= num_layers) of a `Manifest.with_mtp()`; their dense
    dict also holds the MTP-only tensors (`enorm.weight`, ..., see layouts/mtp.py)."""


_VIEWS: OrderedDict[int, ModelView] = OrderedDict()
_MAX_CACHED = 8


def _parse(manifest: Manifest) -> ModelView:
    try:
        dims = model_dims(manifest.config)
    except ModelConfigError as e:
        raise LayoutError(f"manifest of family {manifest.family!r}: {e}") from e
    top: dict[str, TensorMeta] = {}
    n_layers = dims.num_layers + mtp_layer_count(manifest.config)
    dense: list[dict[str, TensorMeta]] = [{} for _ in range(dims.num_layers)]
    experts: list[list[dict[str, TensorMeta]]] = [[] for _ in range(dims.num_layers)]
    block, expert_names = MOE_CHECKPOINT_NAMES.get(dims.family, ("mlp.", {}))
    for t in manifest.tensors:
        # str.split, not a regex: this loop runs over ~70k names for Kimi-K2.
        head, _, rest = t.name.partition("model.layers.")
        index, _, rest = rest.partition(".")
        if head or not index.isdigit() or not rest:
            top[t.name] = t
            continue
        i = int(index)
        if expert_names and rest.startswith(block):  # the family's own MoE names -> mlp.*
            rest = "mlp." + rest[len(block) :]
        if i >= dims.num_layers and (t.part != MTP_PART or i >= n_layers):
            raise LayoutError(
                f"{t.name}: layer {i} >= num_hidden_layers={dims.num_layers} and not of the MTP part"
            )
        while len(dense) <= i:  # an MTP layer
            dense.append({})
            experts.append([])
        if not rest.startswith("mlp.experts."):
            dense[i][rest] = t
            continue
        expert, _, suffix = rest[len("mlp.experts.") :].partition(".")
        if not expert.isdigit():
            dense[i][rest] = t
            continue
        e = int(expert)
        suffix = expert_names.get(suffix, suffix)
        per_layer = experts[i]
        while len(per_layer) <= e:
            per_layer.append({})
        per_layer[e][suffix] = t
    every = [LayerView(i, f"model.layers.{i}.", dense[i], tuple(experts[i])) for i in range(len(dense))]
    layers, mtp = tuple(every[: dims.num_layers]), tuple(every[dims.num_layers :])
    for layer in every:
        for e, tensors in enumerate(layer.experts):
            if set(tensors) != EXPERT_SUFFIXES:
                raise LayoutError(
                    f"{layer.prefix}mlp.experts.{e}: has {sorted(tensors)}, "
                    f"expected {sorted(EXPERT_SUFFIXES)}"
                )
    for name in top:
        if name not in TOP_LEVEL:
            raise LayoutError(f"{name}: not a tensor any layout knows (top level: {sorted(TOP_LEVEL)})")
    return ModelView(manifest, dims, top, layers, mtp)


def model_view(manifest: Manifest) -> ModelView:
    """The parsed view of a manifest, cached by identity (manifests are immutable)."""
    view = _VIEWS.get(id(manifest))
    if view is not None and view.manifest is manifest:
        _VIEWS.move_to_end(id(manifest))
        return view
    view = _parse(manifest)
    _VIEWS[id(manifest)] = view  # the entry keeps the manifest alive, so its id is not reused
    while len(_VIEWS) > _MAX_CACHED:
        _VIEWS.popitem(last=False)
    return view


class TrackingDict(dict):
    """A dict that records which keys were read: to prove a layout rule consumed every tensor."""

    def __init__(self, data: dict[str, TensorMeta]) -> None:
        super().__init__(data)
        self.read: set[str] = set()

    def __getitem__(self, key: str) -> TensorMeta:
        self.read.add(key)
        return super().__getitem__(key)


def check_coverage(
    view: ModelView, layout: str, place: Callable[[ShardBuilder, LayerView, dict[str, TensorMeta]], None]
) -> None:
    """Run a layout's per-layer rule once per layer and fail on any tensor it did not read.

    A layer rule reads the same tensors whatever the rank, so one pass proves that no canonical
    tensor is silently dropped by this layout.
    """
    for layer in view.layers:
        tracked = TrackingDict(layer.dense)
        place(ShardBuilder(), layer, tracked)
        for name in sorted(set(layer.dense) - tracked.read):
            raise LayoutError(f"{layout}: {layer.prefix}{name}: no rule of this layout covers the tensor")


class ShardBuilder:
    """Accumulates a rank's local tensors and pieces."""

    __slots__ = ("pieces", "tensors")

    def __init__(self) -> None:
        self.tensors: list[LocalTensorMeta] = []
        self.pieces: list[Piece] = []

    def local(self, name: str, shape: tuple[int, ...], dtype: str) -> None:
        self.tensors.append(LocalTensorMeta(name, shape, dtype))

    def piece(self, tensor: str, canon_box: Box, local_name: str, local_box: Box) -> None:
        self.pieces.append(Piece(tensor, canon_box, local_name, local_box))

    def full(self, t: TensorMeta, local_name: str) -> None:
        """A full copy of `t` under `local_name`."""
        box = tuple((0, s) for s in t.shape)
        self.tensors.append(LocalTensorMeta(local_name, t.shape, t.dtype))
        self.pieces.append(Piece(t.name, box, local_name, box))

    def split(self, t: TensorMeta, local_name: str, dim: int, parts: int, index: int) -> None:
        """Part `index` of `parts` of `t` along `dim` (0: column-parallel rows, 1: row-parallel columns)."""
        if parts == 1:
            self.full(t, local_name)
            return
        lo, hi = part(t.shape[dim], parts, index)
        canon = tuple((lo, hi) if d == dim else (0, s) for d, s in enumerate(t.shape))
        shape = tuple(hi - lo if d == dim else s for d, s in enumerate(t.shape))
        self.tensors.append(LocalTensorMeta(local_name, shape, t.dtype))
        self.pieces.append(Piece(t.name, canon, local_name, tuple((0, s) for s in shape)))

    def vocab_rows(self, t: TensorMeta, local_name: str, padded: int, parts: int, index: int) -> None:
        """Rows `index`-th of `parts` over the vocab padded to `padded` rows; padding rows are uncovered."""
        vocab, hidden = t.shape
        lo, hi = part(padded, parts, index)
        self.tensors.append(LocalTensorMeta(local_name, (hi - lo, hidden), t.dtype))
        top = min(hi, vocab)
        if top > lo:
            self.pieces.append(
                Piece(t.name, ((lo, top), (0, hidden)), local_name, ((0, top - lo), (0, hidden)))
            )

    def rows_into(self, t: TensorMeta, lo: int, hi: int, local_name: str, at: int, lead: Box = ()) -> None:
        """Rows [lo, hi) of `t` at rows [at, ...) of `local_name`, under leading unit dims `lead`."""
        rest = tuple((0, s) for s in t.shape[1:])
        self.pieces.append(Piece(t.name, ((lo, hi), *rest), local_name, (*lead, (at, at + hi - lo), *rest)))

    def cols_into(self, t: TensorMeta, lo: int, hi: int, local_name: str, lead: Box = ()) -> None:
        """Columns [lo, hi) of 2-D `t` as the whole of `local_name` (under leading unit dims `lead`)."""
        rows = (0, t.shape[0])
        self.pieces.append(Piece(t.name, (rows, (lo, hi)), local_name, (*lead, rows, (0, hi - lo))))

    def concat_rows(self, local_name: str, segments: list[tuple[TensorMeta, int, int]]) -> None:
        """A local tensor made of row ranges of several tensors, concatenated on dim 0 in order."""
        first = segments[0][0]
        at = 0
        for t, lo, hi in segments:
            self.rows_into(t, lo, hi, local_name, at)
            at += hi - lo
        self.tensors.append(LocalTensorMeta(local_name, (at, *first.shape[1:]), first.dtype))

    def done(self, coord: RankCoord) -> RankShard:
        return RankShard(coord, tuple(self.tensors), tuple(self.pieces))


Part = TypeVar("Part")


class RankCache:
    """Per-layout cache of (tensors, pieces) by (manifest, spec, coordinates that matter).

    The planner calls shard() for every rank, often several times; identical shards (DP copies)
    are computed once. Bounded: entries of the least recently used manifests are dropped.
    """

    def __init__(self) -> None:
        self._by_model: OrderedDict[
            tuple[int, ParallelSpec], tuple[ModelView, dict[Hashable, RankShard], dict[Hashable, object]]
        ] = OrderedDict()

    def get(
        self,
        view: ModelView,
        spec: ParallelSpec,
        key: Hashable,
        coord: RankCoord,
        build: Callable[[], RankShard],
        check: Callable[[], None],
    ) -> RankShard:
        """The shard of `key`, built once; `check` (the layout's validation) runs once per model and spec."""
        model_key = (id(view), spec)
        entry = self._by_model.get(model_key)
        if entry is None or entry[0] is not view:
            with gc_paused():
                check()
            # The entry holds the view, so its id cannot be reused while the entry lives.
            entry = self._by_model[model_key] = (view, {}, {})
            while len(self._by_model) > _MAX_CACHED:
                self._by_model.popitem(last=False)
        shards = entry[1]
        shard = shards.get(key)
        if shard is None:
            with gc_paused():
                shard = shards[key] = build()
        if shard.coord == coord:
            return shard
        return RankShard(coord, shard.tensors, shard.pieces)

    def part(self, view: ModelView, spec: ParallelSpec, key: Hashable, build: Callable[[], Part]) -> Part:
        """A value several shards of `view` and `spec` share (what all EP ranks of one stage and TP
        rank hold, say): built once while those shards are cached, dropped with them."""
        entry = self._by_model.get((id(view), spec))
        if entry is None or entry[0] is not view:  # a build outside `get`: nothing to share with
            return build()
        parts = entry[2]
        if key not in parts:
            parts[key] = build()
        return cast(Part, parts[key])  # one key, one kind of part: the caller's


class RuleLayout:
    """Plumbing shared by the table-driven layouts: validation once per model and spec, shards
    cached by the coordinates that matter. Subclasses supply the rules (check, build, shard_key)."""

    name: str
    places_mtp = False
    """Whether this layout places MTP layers (layouts/mtp.py); a plan with them refuses it else."""
    mtp_shared: tuple[str, ...] = ()
    """MTP-only suffixes the layout holds no copy of: the engine uses the target model's tensors."""

    def __init__(self) -> None:
        self._cache = RankCache()

    def validate(self, manifest: Manifest, spec: ParallelSpec) -> None:
        self._check(model_view(manifest), spec)

    def _check(self, view: ModelView, spec: ParallelSpec) -> None:
        if view.mtp and not self.places_mtp:
            raise LayoutError(
                f"{self.name}: {view.mtp[0].prefix}* (MTP): this layout has no rule for MTP layers; "
                "an MTP destination needs a source layout that places them (hf or megatron)"
            )
        self.check(view, spec)

    def shard(self, manifest: Manifest, spec: ParallelSpec, coord: RankCoord) -> RankShard:
        view = model_view(manifest)
        return self._cache.get(
            view,
            spec,
            self.shard_key(view, spec, coord),
            coord,
            lambda: self.build(view, spec, coord),
            lambda: self._check(view, spec),
        )

    def check(self, view: ModelView, spec: ParallelSpec) -> None:
        raise NotImplementedError

    def build(self, view: ModelView, spec: ParallelSpec, coord: RankCoord) -> RankShard:
        raise NotImplementedError

    def shard_key(self, view: ModelView, spec: ParallelSpec, coord: RankCoord) -> Hashable:
        """The coordinates that decide what the rank holds (DP copies share one cached shard):
        stage, TP rank, and EP rank where experts are split by EP (the inference layouts)."""
        return (coord.pp_rank, coord.tp_rank, coord.ep_rank if spec.ep > 1 else 0)
