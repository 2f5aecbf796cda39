"""A Megatron-Core trainer rank as a WeightSync source participant (design §4.2).

    source = MegatronSource(model, hf_config)      # collectively, on every trainer rank
    self.ws_init(**source.participant_args())      # inside the Ray actor that owns the model

`model` is Megatron's chunk list (one GPTModel per VPP stage, as `get_model` returns it, DDP /
Float16Module wrappers allowed); `parallel_state` must be initialised. Coordinates come from
Megatron's own getters, names from the live modules, tensors are the live storage (no copies),
each with its own dtype. The dtypes of every canonical tensor are gathered over the trainer's
world once, so every rank reports the same manifest (`weightsync_tensor_dtypes` in the model
config): a bf16 model's fp32 norms and router `expert_bias` travel as fp32.

Before any byte moves the rank checks itself against the layout and raises `LayoutError` naming
the tensor: a name no rule knows (for example a TE-only tensor in a local-spec layout), a shape
or dtype the layout does not expect, a vocabulary not padded to a multiple of 128·tp, layers
whose `layer_number` is not where the PP/VPP split puts them, experts not where EP puts them.
Families this source cannot serve (`MEGATRON_SOURCE_REFUSES`) are refused first, in one line.
gpt-oss's expert tensors are reported in the orientation the layout declares them in (the
checkpoint's, engines/megatron_reorient.py): linear_fc2 as transposed views, linear_fc1 (gate/up
interleaved) as copies made while a sync reads them, fenced against a step meanwhile.
A model built with MTP layers (`mtp_num_layers` = the checkpoint's num_nextn_predict_layers)
holds the manifest's MTP part under `mtp.layers.{i}.*` (layouts/megatron_mtp.py); discovery
then finds its last stage reporting them (runtime/mtp_side.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from sync_runtime.core.layouts import get_layout
from sync_runtime.core.layouts._rules import round_up
from sync_runtime.core.layouts.base import RankShard
from sync_runtime.core.layouts.megatron import NAME, TE_NAME, VOCAB_MULTIPLE_PER_TP, chunk_ranges
from sync_runtime.core.manifest import Manifest
from sync_runtime.core.models import TENSOR_DTYPES_KEY, model_dims, model_family
from sync_runtime.core.models.config import mtp_layer_count
from sync_runtime.core.plan import RankPlan
from sync_runtime.core.topology import ParallelSpec, RankCoord, Role
from sync_runtime.engines.megatron_names import LiveTensor, layer_numbers, live_tensors, unwrap
from sync_runtime.engines.megatron_reorient import ReorientedTensors
from sync_runtime.errors import LayoutError, SourceChanged
from sync_runtime.runtime.hf_manifest import build_manifest
from sync_runtime.runtime.participant import WeightSyncParticipant, dtype_name
from sync_runtime.transfer import RankResult, TransferConfig

LAYOUTS_BY_SPEC = (NAME, TE_NAME)
"""Megatron-Core's local spec first: on a tie (no stray names either way) it wins."""
_VOCAB_TENSORS = ("embedding.word_embeddings.weight", "output_layer.weight")

MEGATRON_SOURCE_REFUSES: dict[str, str] = {
    # Evidence (megatron-core 0.19.2): transformer/transformer_layer.py TransformerLayerSubmodules
    # has input_layernorm, pre_cross_attn_layernorm and pre_mlp_layernorm only; torch_norm.py
    # WrappedTorchNorm asserts not layernorm_zero_centered_gamma; LanguageModelEmbedding scales
    # only for MuP; GPTModel has one rotary_base for every layer.
    "gemma3_text": "Megatron-Core 0.19.2 has no Gemma 3 layer: TransformerLayer has no norm after "
    "attention or after the MLP (post_attention/pre_feedforward/post_feedforward sandwich norms), "
    "and the local spec's norm refuses (1+w) RMSNorm (layernorm_zero_centered_gamma)",
}
"""Family -> why a Megatron-Core source refuses it (one line; docs/design.md §4.2)."""


def refuse_unsupported_family(hf_config: Mapping[str, Any]) -> None:
    """LayoutError naming the family and what is missing, for a family the source cannot serve."""
    family = model_family(dict(hf_config))
    if family in MEGATRON_SOURCE_REFUSES:
        raise LayoutError(f"{NAME}: {family}: {MEGATRON_SOURCE_REFUSES[family]}")


def megatron_coord() -> tuple[RankCoord, ParallelSpec]:
    """This rank's coordinate and its side's sizes, from Megatron's parallel_state getters."""
    from megatron.core import parallel_state as ps

    # Megatron's data-parallel getters exclude CP by default: dp and cp are separate axes here too.
    coord = RankCoord(
        role=Role.SOURCE,
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        dp_rank=ps.get_data_parallel_rank(),
        cp_rank=ps.get_context_parallel_rank(),
        ep_rank=ps.get_expert_model_parallel_rank(),
        etp_rank=ps.get_expert_tensor_parallel_rank(),
        edp_rank=ps.get_expert_data_parallel_rank(),
    )
    spec = ParallelSpec(
        tp=ps.get_tensor_model_parallel_world_size(),
        pp=ps.get_pipeline_model_parallel_world_size(),
        dp=ps.get_data_parallel_world_size(),
        cp=ps.get_context_parallel_world_size(),
        ep=ps.get_expert_model_parallel_world_size(),
        etp=ps.get_expert_tensor_parallel_world_size(),
        vpp=ps.get_virtual_pipeline_model_parallel_world_size() or 1,
    )
    return coord, spec


class MegatronSource:
    """One trainer rank's shards under the `megatron` (local spec) or `megatron-te` layout."""

    def __init__(
        self,
        model: torch.nn.Module | Sequence[torch.nn.Module],
        hf_config: Mapping[str, Any],
        *,
        layer_counts: tuple[int, ...] | None = None,
        gather_dtypes: bool = True,
    ) -> None:
        """`hf_config`: the config.json of the checkpoint this model trains (canonical names).
        `layer_counts`: per-stage layer counts when the PP split is uneven (Megatron's explicit
        first/last-stage sizes). `gather_dtypes=False` skips the collective (single rank tests)."""
        refuse_unsupported_family(hf_config)  # before any Megatron state is read
        self.chunks = unwrap(model)
        self.coord, spec = megatron_coord()
        self.spec = ParallelSpec(**{**_spec_fields(spec), "layer_counts": layer_counts})
        self.live: list[LiveTensor] = live_tensors(self.chunks)
        self.reoriented = ReorientedTensors(model_family(dict(hf_config)), self.live)
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.layout = NAME  # until _pick_layout has seen the names
        base = {k: v for k, v in hf_config.items() if k != TENSOR_DTYPES_KEY}
        self._check_vocab(base)
        self.mtp = _mtp_layers(self.chunks, base, self.spec.pp)
        self.layout, shard = self._pick_layout(self._held(build_manifest(base)))
        dtypes = self._canonical_dtypes(shard)
        if gather_dtypes and dist.is_initialized() and dist.get_world_size() > 1:
            dtypes = _all_union(dtypes)
        self.model_config: dict[str, Any] = {**base, TENSOR_DTYPES_KEY: dict(sorted(dtypes.items()))}
        self.manifest: Manifest = build_manifest(self.model_config)
        self.check()

    def _held(self, manifest: Manifest) -> Manifest:
        """What this model holds: with the MTP part when it was built with MTP layers."""
        return manifest.with_mtp() if self.mtp else manifest

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        """What the rank reports: its live tensors in the layout's orientation (see module doc)."""
        return self.reoriented.reported

    def participant_args(self) -> dict[str, Any]:
        """Keyword arguments of `WeightSyncParticipant.ws_init` for this rank."""
        return {
            "role": Role.SOURCE,
            "coord": self.coord,
            "layout": self.layout,
            "tensors": self.tensors,
            "model_config": self.model_config,
        }

    # ---- checks, before any byte moves -----------------------------------------------------

    def _pick_layout(self, manifest: Manifest) -> tuple[str, RankShard]:
        """The naming (local spec or TE) whose rules explain the most live names: the spec a model
        was built with decides its names; a stray name then fails the check by its own name."""
        names = {t.name for t in self.live}
        best: tuple[int, str, RankShard] | None = None
        error: LayoutError | None = None
        for layout in LAYOUTS_BY_SPEC:
            self.layout = layout
            try:
                shard = self._shard(manifest)
            except LayoutError as e:
                error = error or e
                continue
            unknown = len(names - {t.name for t in shard.tensors})
            if best is None or unknown < best[0]:
                best = (unknown, layout, shard)
        if best is None:
            assert error is not None
            raise error
        return best[1], best[2]

    def _shard(self, manifest: Manifest) -> RankShard:
        try:
            return get_layout(self.layout).shard(manifest, self.spec, self.coord)
        except LayoutError as e:
            raise LayoutError(f"rank {self.rank}: {e}", rank=self.rank, tensor=e.tensor) from e

    def _refuse(self, tensor: str, problem: str) -> LayoutError:
        return LayoutError(
            f"{self.layout}: rank {self.rank}: {tensor}: {problem}", rank=self.rank, tensor=tensor
        )

    def _check_vocab(self, config: Mapping[str, Any]) -> None:
        vocab, t = model_dims(dict(config)).vocab, self.spec.tp
        want = round_up(vocab, VOCAB_MULTIPLE_PER_TP * t)
        for lt in self.live:
            if _unprefixed(lt.name) in _VOCAB_TENSORS:
                got = lt.tensor.shape[0] * t
                if got != want:
                    raise self._refuse(
                        lt.name,
                        f"vocabulary padded to {got} rows, expected V={vocab} rounded up to a "
                        f"multiple of {VOCAB_MULTIPLE_PER_TP}*tp={VOCAB_MULTIPLE_PER_TP * t}: {want}",
                    )

    def _canonical_dtypes(self, shard: RankShard) -> dict[str, str]:
        """Canonical tensor -> dtype of the local tensor holding it (unknown names refused)."""
        live = self.tensors
        expected = {t.name for t in shard.tensors}
        for name in live:
            if name not in expected:
                raise self._refuse(name, f"no rule of the {self.layout} layout produces this tensor")
        return {p.tensor: dtype_name(live[p.local_name].dtype) for p in shard.pieces if p.local_name in live}

    def check(self) -> None:
        """Names, shapes and dtypes against the layout; layer and expert placement."""
        shard = self._shard(self._held(self.manifest))
        live = self.tensors
        for meta in shard.tensors:
            t = live.get(meta.name)
            if t is None:
                raise self._refuse(meta.name, "the layout expects this tensor, the model has none")
            if tuple(t.shape) != tuple(meta.shape):
                raise self._refuse(meta.name, f"shape {list(t.shape)}, the layout expects {list(meta.shape)}")
            if dtype_name(t.dtype) != meta.dtype:
                raise self._refuse(meta.name, f"dtype {dtype_name(t.dtype)}, the manifest says {meta.dtype}")
        self._check_layers()

    def _check_layers(self) -> None:
        d = model_dims(self.manifest.config)
        ranges = chunk_ranges(d.num_layers, self.spec)[self.coord.pp_rank]
        for c, (chunk, want) in enumerate(zip(self.chunks, ranges, strict=True)):
            got = layer_numbers(chunk)
            if got != list(want):
                raise self._refuse(
                    f"chunk {c} decoder.layers",
                    f"global layers {got} (layer_number - 1), the PP/VPP split puts {list(want)} here",
                )
        per_rank = d.num_experts // self.spec.ep if d.num_experts else 0
        first = self.coord.ep_rank * per_rank
        for lt in self.live:
            if lt.expert and lt.name.count("local_experts.") and per_rank:
                e = int(lt.global_name.split("local_experts.")[1].split(".")[0])
                if not first <= e < first + per_rank:
                    raise self._refuse(
                        lt.name,
                        f"global expert {e}, EP rank {self.coord.ep_rank} holds "
                        f"[{first}, {first + per_rank})",
                    )


def _mtp_layers(chunks: Sequence[torch.nn.Module], hf_config: Mapping[str, Any], pp: int) -> int:
    """Megatron's `mtp_num_layers` (the same in every chunk's config), checked against the
    checkpoint's `num_nextn_predict_layers`: the HF names of MTP layers come from the latter."""
    config = getattr(chunks[0], "config", None) if chunks else None
    n = int(getattr(config, "mtp_num_layers", None) or 0)
    if not n:
        return 0
    want = mtp_layer_count(dict(hf_config))
    if n != want:
        raise LayoutError(
            f"{NAME}: mtp.layers: Megatron-Core mtp_num_layers={n}, the checkpoint's "
            f"num_nextn_predict_layers={want}: its MTP layers have no checkpoint names"
        )
    if n > 1 and getattr(config, "mtp_use_repeated_layer", False):
        raise LayoutError(
            f"{NAME}: mtp.layers: mtp_use_repeated_layer holds one MTP layer for {n} checkpoint layers"
        )
    if model_dims(dict(hf_config)).tie_embeddings and len(chunks) * pp > 1:
        # The MTP stage projects with its embedding copy; its tied output_layer.weight is never
        # used, so a plan without the MTP part (which sees no MTP stage) must not send from it.
        raise LayoutError(
            f"{NAME}: output_layer.weight: tied embeddings with MTP layers on a later stage than the "
            "embedding (pp*vpp > 1): that stage's output layer is unused by Megatron-Core"
        )
    return n


def _unprefixed(name: str) -> str:
    """A layout name without our `chunk{c}.` prefix."""
    head, _, rest = name.partition(".")
    return rest if head.startswith("chunk") and head[5:].isdigit() else name


def _spec_fields(spec: ParallelSpec) -> dict[str, Any]:
    return {k: getattr(spec, k) for k in ("tp", "pp", "dp", "ep", "etp", "vpp")}


def _all_union(dtypes: dict[str, str]) -> dict[str, str]:
    """Union of every rank's canonical dtypes (the trainer's default group); a tensor two ranks
    hold in different dtypes is refused: the wire carries one dtype per canonical tensor."""
    gathered: list[dict[str, str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, dtypes)
    out: dict[str, str] = {}
    for rank, part in enumerate(gathered):
        for name, dtype in (part or {}).items():
            if out.setdefault(name, dtype) != dtype:
                raise LayoutError(
                    f"megatron: {name}: rank {rank} holds it as {dtype}, another rank as {out[name]}",
                    rank=rank,
                    tensor=name,
                )
    return out


class MegatronSourceParticipant(WeightSyncParticipant):
    """Mixin for the Ray actor that owns a Megatron model: `self.ws_megatron_init(model, hf_config)`."""

    ws_source: MegatronSource | None = None

    def ws_megatron_init(
        self,
        model: torch.nn.Module | Sequence[torch.nn.Module],
        hf_config: Mapping[str, Any],
        *,
        version: str | None = None,
        layer_counts: tuple[int, ...] | None = None,
    ) -> MegatronSource:
        source = MegatronSource(model, hf_config, layer_counts=layer_counts)
        self.ws_init(**source.participant_args(), version=version)
        self.ws_source = source
        return source

    def ws_run(
        self,
        plan: RankPlan | str,
        digest: str,
        version: str,
        config: TransferConfig,
        txn: str | None = None,
    ) -> RankResult:
        """A sync reads the reoriented copies, made now; a step that wrote their live parameters
        meanwhile fails this rank as a write to any source tensor would (transfer/fence.py)."""
        source, st = self.ws_source, self._ws_state()
        if source is None or not source.reoriented.copies:
            return super().ws_run(plan, digest, version, config, txn)
        with source.reoriented.materialized(st.tensors) as moved:
            result = super().ws_run(plan, digest, version, config, txn)
        name = moved()
        if name is None or not result.ok:
            return result
        st.kept = None  # the kept bits (delta base) are not what the destinations will commit
        failure = SourceChanged(
            f"rank {result.rank}: source tensor {name!r} was written during the sync (a training "
            "step ran while its shards were read); no destination commits these bytes",
            rank=result.rank,
            tensor=name,
        ).to_failure()
        return dataclasses.replace(result, ok=False, failure=failure)

    def ws_checksums(self) -> dict[str, str]:
        with self._ws_materialized():
            return super().ws_checksums()

    def ws_sha256(self) -> dict[str, str]:
        with self._ws_materialized():
            return super().ws_sha256()

    def ws_tensor(self, name: str) -> torch.Tensor:
        with self._ws_materialized():
            return super().ws_tensor(name)

    def _ws_materialized(self) -> contextlib.AbstractContextManager[object]:
        source = self.ws_source
        if source is None or not source.reoriented.copies:
            return contextlib.nullcontext()
        return source.reoriented.materialized(self._ws_state().tensors)

    def ws_set_source_version(self, version: str) -> None:
        """The trainer stepped: the live tensors already hold the new weights, name their version."""
        self._ws_state().version = version
