"""Ray actors of the `--source megatron-core` demo and tests: real Megatron-Core trainer ranks and
blank vLLM-layout destination ranks, plus the driver-side helpers that start and check them.

A trainer actor joins a gloo default group with its peers (Megatron's world), builds its chunks
with Megatron's seeded init and registers them through `MegatronSourceParticipant`. It can be
rebuilt with another model or parallelism (the process and its `import megatron` are the costly
part on a small machine, so tests reuse them).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import ray
import torch

from sync_runtime.core.layouts import get_layout
from sync_runtime.core.topology import ParallelSpec, RankCoord
from sync_runtime.engines import megatron_cpu
from sync_runtime.engines.megatron import MegatronSourceParticipant
from sync_runtime.engines.megatron_convert import ExportedShard, export_shards
from sync_runtime.runtime.hf_manifest import build_manifest
from sync_runtime.testing.actors import VllmDestinationActor
from sync_runtime.testing.gloo_world import hold_rendezvous, join_gloo_world


class MegatronTrainer(MegatronSourceParticipant):
    """One trainer rank: a Megatron model, an Adam optimizer, the WeightSync source mixin."""

    def __init__(self, rank: int, world_size: int, master: str) -> None:
        torch.set_num_threads(1)  # many ranks share few cores
        megatron_cpu.install()
        join_gloo_world(master, rank, world_size)
        self.chunks: list[torch.nn.Module] = []
        self.config: dict[str, Any] = {}

    def build(
        self,
        hf_config: Mapping[str, Any],
        spec: str,
        *,
        seed: int = 0,
        dtype: str = "float32",
        version: str = "v1",
        vocab_size: int | None = None,
        extra_parameter: str | None = None,
        init_std: float = 0.02,
        default_etp: bool = False,
    ) -> dict[str, Any]:
        """(Re)build the model and register it; returns the reported coordinate and layout.

        `vocab_size` / `extra_parameter` make deliberately bad setups (tests): an unpadded
        vocabulary, or a parameter registered under a name no layout rule knows. `default_etp`:
        Megatron's own expert TP size instead of the spec's (a trainer that does not set it)."""
        from sync_runtime.testing.megatron_models import build_chunks, init_parallel, megatron_config

        parsed = ParallelSpec.parse(spec)
        init_parallel(parsed, seed, default_etp=default_etp)
        tconfig = megatron_config(hf_config, parsed, getattr(torch, dtype), init_std, default_etp=default_etp)
        self.chunks = build_chunks(hf_config, tconfig, vocab_size=vocab_size)
        if extra_parameter:
            module_path, _, leaf = extra_parameter.rpartition(".")
            module = self.chunks[0].get_submodule(module_path)
            module.register_parameter(leaf, torch.nn.Parameter(torch.zeros(4)))
        self.config = dict(hf_config)
        self.optimizer = torch.optim.Adam([p for c in self.chunks for p in c.parameters()], lr=1e-2)
        if self._ws is not None:
            self.ws_leave()  # a rebuilt trainer starts without the previous model's sync group
        source = self.ws_megatron_init(
            self.chunks, hf_config, version=version, layer_counts=parsed.layer_counts
        )
        return {
            "coord": source.coord,
            "spec": source.spec,
            "layout": source.layout,
            "model_config": source.model_config,
        }

    def ready(self) -> bool:
        return True

    def export(self) -> list[ExportedShard]:
        """Copies of this rank's tensors with their split attributes (for the reference)."""
        assert self.ws_source is not None
        return export_shards(self.ws_source.live)

    def step(self, version: str, seed: int = 7) -> float | None:
        """One real optimizer step (collective over the trainer's world), then name its version."""
        from sync_runtime.core.models import model_dims
        from sync_runtime.testing.megatron_train import train_step

        d = model_dims(self.config)
        loss = train_step(self.chunks, self.optimizer, d.vocab, d.tie_embeddings, seed=seed)
        self.ws_set_source_version(version)
        return loss

    def randomize_norms(self, seed: int) -> None:
        """Norm weights start at 1, where a wrong norm mapping would not show: make them differ
        (the same values on every rank: one generator, same order)."""
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for chunk in self.chunks:
                for _, p in chunk.named_parameters():
                    if p.dim() == 1:
                        p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))

    def randomize_vectors(self, seed: int) -> None:
        """As `randomize_norms`, but a 1-D parameter split over TP (or expert TP) gets this rank's
        share of one full random vector: TP ranks differ, so a sync that took a split bias or
        the sinks from the wrong rank would show (replicas of a shard still agree)."""
        from megatron.core import parallel_state as ps

        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for chunk in self.chunks:
                for name, p in chunk.named_parameters():
                    if p.dim() != 1:
                        continue
                    split = getattr(p, "tensor_model_parallel", False) or name.endswith("softmax_offset")
                    rank, size = (0, 1)
                    if split and ".mlp.experts." in name:
                        rank, size = (
                            ps.get_expert_tensor_parallel_rank(),
                            ps.get_expert_tensor_parallel_world_size(),
                        )
                    elif split:  # the learnable softmax offset holds the rank's heads, unmarked
                        rank, size = (
                            ps.get_tensor_model_parallel_rank(),
                            ps.get_tensor_model_parallel_world_size(),
                        )
                    n = p.shape[0]
                    full = 1 + 0.3 * torch.randn(n * size, generator=g)
                    p.copy_(full[rank * n : (rank + 1) * n])

    def randomize_expert_bias(self, seed: int) -> int:
        """The router's fp32 `expert_bias` buffers start at 0, which every dtype holds exactly:
        give them values bf16 cannot hold, so a narrowed copy anywhere would show. Returns how
        many buffers were set (same values on every rank, as `randomize_norms`)."""
        g = torch.Generator().manual_seed(seed)
        count = 0
        with torch.no_grad():
            for chunk in self.chunks:
                for name, b in chunk.named_buffers():
                    if name.endswith("router.expert_bias"):
                        b.copy_(0.1 * torch.randn(b.shape, generator=g, dtype=torch.float32))
                        count += 1
        return count

    def scramble(self, name: str) -> None:
        """Negative control: reverse the rows of one live parameter in place (the model's own
        tensor: for gpt-oss's experts, not the reoriented form the rank reports)."""
        assert self.ws_source is not None
        live = {t.name: t.tensor for t in self.ws_source.live}
        with torch.no_grad():
            live[name].copy_(live[name].flip(0))

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """Forward of a TP1/PP1 model (equivalence tests), fp32 logits over the real vocabulary."""
        seq = tokens.shape[1]
        pos = torch.arange(seq)[None].expand_as(tokens)
        model = self.chunks[0].eval()
        with torch.no_grad(), megatron_cpu.sliding_window_mask_on_cpu():
            out = model(tokens, pos, megatron_cpu.causal_mask(seq))
        return out[..., : int(self.config["vocab_size"])].float()


class BlankDestination(VllmDestinationActor):
    """A vLLM-layout destination rank holding zeros (in the manifest's dtypes) until a sync."""

    def __init__(
        self,
        model_config: Mapping[str, Any],
        spec: ParallelSpec,
        coord: RankCoord,
        dtypes: Mapping[str, str] | None = None,
    ) -> None:
        """`dtypes`: local tensors held in another dtype than the manifest's (tests)."""
        torch.set_num_threads(1)
        shard = get_layout("vllm").shard(build_manifest(dict(model_config)), spec, coord)
        dtype = {t.name: (dtypes or {}).get(t.name, t.dtype) for t in shard.tensors}
        tensors = {t.name: torch.zeros(t.shape, dtype=getattr(torch, dtype[t.name])) for t in shard.tensors}
        super().__init__(coord, tensors, version="v0")


def start_trainers(world_size: int, namespace: str, prefix: str) -> list[Any]:
    master = hold_rendezvous()
    cls = ray.remote(MegatronTrainer)
    handles = [
        cls.options(name=f"{prefix}src-{r}", namespace=namespace, num_cpus=0).remote(r, world_size, master)
        for r in range(world_size)
    ]
    ray.get([h.ready.remote() for h in handles])
    return handles


def build_all(
    handles: Sequence[Any], hf_config: Mapping[str, Any], spec: str, **kw: Any
) -> list[dict[str, Any]]:
    """Every trainer (re)builds together (Megatron's init is collective)."""
    return ray.get([h.build.remote(hf_config, spec, **kw) for h in handles])
