"""Trainer ranks of `weightsync demo --source megatron-core --steps N`: Megatron-Core models in bf16
with fp32 main weights, the mixed-precision scheme Megatron trains with.

Megatron's own `Float16OptimizerWithFloat16Params` cannot run here: in megatron-core 0.19.2 it
accepts only `torch.cuda.*` parameter types and allocates its overflow flags on "cuda". So
`MainWeightsAdam` does what it does, on CPU tensors: an fp32 main copy of every bf16 model
parameter (`param.detach().clone().float()`), main grads = model grads cast to fp32, Adam on the
main copies with the defaults of Megatron's `OptimizerConfig` (decoupled weight decay on
matrices only, as Megatron's default parameter groups), then each main copy cast back into its
bf16 model parameter in place (parameters the model keeps in fp32, its RMSNorm weights, go
through unchanged). Two differences remain: Megatron's DDP accumulates gradients in an fp32
buffer, here the backward pass leaves them in bf16 before the cast; and there is no gradient
clipping (Megatron's default clips at a global norm of 1.0, a norm reduced over the
model-parallel groups; Adam's update barely depends on the gradient's scale).

Why it matters for deltas: at an RL learning rate an Adam step moves a weight by far less than
one bf16 step, so the bf16 copy changes only where the fp32 main weight crosses a rounding
boundary; a bf16-only Adam would round every update away and change nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import ray
import torch

from sync_runtime.testing.gloo_world import hold_rendezvous
from sync_runtime.testing.megatron_actors import MegatronTrainer

__all__ = ["MainWeightsAdam", "MixedPrecisionTrainer", "start_mixed_trainers"]


class MainWeightsAdam:
    """Adam over fp32 main copies of bf16 model parameters (see the module docstring)."""

    def __init__(self, params: Iterable[torch.nn.Parameter], lr: float) -> None:
        from megatron.core.optimizer import OptimizerConfig

        defaults = OptimizerConfig()
        self.params = [p for p in params if p.requires_grad]
        self.main = [p.detach().clone().float() for p in self.params]
        decay = [m for m in self.main if m.dim() > 1]  # Megatron: no decay on biases and norms
        rest = [m for m in self.main if m.dim() <= 1]
        self.inner = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": defaults.weight_decay},
                {"params": rest, "weight_decay": 0.0},
            ],
            lr=lr,
            betas=(defaults.adam_beta1, defaults.adam_beta2),
            eps=defaults.adam_eps,
        )

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    def step(self) -> None:
        for p, m in zip(self.params, self.main, strict=True):
            m.grad = None if p.grad is None else p.grad.detach().float()
        self.inner.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.main, strict=True):
                p.copy_(m)  # round to nearest into the live bf16 tensor the source registered


class MixedPrecisionTrainer(MegatronTrainer):
    """A trainer rank whose model is bf16 and whose optimizer is `MainWeightsAdam`."""

    def build(
        self, hf_config: Mapping[str, Any], spec: str, *, lr: float = 1e-6, **kw: Any
    ) -> dict[str, Any]:
        out = super().build(hf_config, spec, **{"dtype": "bfloat16", "init_std": 0.02, **kw})
        self.optimizer = MainWeightsAdam((p for c in self.chunks for p in c.parameters()), lr)  # type: ignore[assignment]
        return out


def start_mixed_trainers(world_size: int, namespace: str, prefix: str) -> list[Any]:
    """`world_size` MixedPrecisionTrainer actors joined in one gloo world (as start_trainers)."""
    master = hold_rendezvous()
    cls = ray.remote(MixedPrecisionTrainer)
    handles = [
        cls.options(name=f"{prefix}src-{r}", namespace=namespace, num_cpus=0).remote(r, world_size, master)
        for r in range(world_size)
    ]
    ray.get([h.ready.remote() for h in handles])
    return handles
