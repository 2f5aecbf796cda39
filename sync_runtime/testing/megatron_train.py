"""One real training step of a Megatron-Core model on CPU: loss, backward, gradient reduction, Adam.

Megatron's pipeline schedules and its optimizer allocate on "cuda" in 0.19.2, so the pipeline is
driven here by hand (block b = c*p + s runs on stage s, chunk c; activations and their gradients
go stage to stage over the PP group) and gradients are reduced as Megatron's DDP would (dense
over DP, experts over expert-DP, the tied embedding over the embedding group) before
`torch.optim.Adam` steps. MoE with TP > 1 runs in eval mode (dropout is 0: same maths) because
MoELayer refuses training mode without sequence parallelism, which the local spec cannot do.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from sync_runtime.engines import megatron_cpu


def batch(vocab: int, seq_len: int = 8, batch_size: int = 2, seed: int = 7) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (batch_size, seq_len + 1), generator=g)
    return {
        "tokens": tokens[:, :-1].contiguous(),
        "labels": tokens[:, 1:].contiguous(),
        "position_ids": torch.arange(seq_len)[None].expand(batch_size, seq_len).contiguous(),
        "attention_mask": megatron_cpu.causal_mask(seq_len),
    }


def forward_backward(chunks: Sequence[torch.nn.Module], data: dict[str, torch.Tensor]) -> float | None:
    """Forward and backward of one batch through the pipeline; the loss on the last stage."""
    from megatron.core import parallel_state as ps

    pp, stage = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    peers = dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group())
    blocks = pp * len(chunks)
    inputs: dict[int, torch.Tensor | None] = {}
    outputs: dict[int, torch.Tensor] = {}
    loss = None
    for b in range(stage, blocks, pp):
        model = chunks[b // pp]
        inp = None
        if b > 0:
            shape = (data["tokens"].shape[1], data["tokens"].shape[0], model.config.hidden_size)
            inp = torch.empty(shape, dtype=model.config.pipeline_dtype)
            dist.recv(inp, src=peers[(stage - 1) % pp])
            inp.requires_grad_(True)
            model.set_input_tensor(inp)
        last = b == blocks - 1
        out = model(
            data["tokens"],
            data["position_ids"],
            data["attention_mask"],
            labels=data["labels"] if last else None,
        )
        if last:
            out = out.float().mean()  # per-token cross entropy -> mean loss
            loss = float(out.detach())
        else:
            dist.send(out.detach().contiguous(), dst=peers[(stage + 1) % pp])
        inputs[b], outputs[b] = inp, out
    for b in reversed(range(stage, blocks, pp)):
        if b == blocks - 1:
            outputs[b].backward()
        else:
            grad = torch.empty_like(outputs[b])
            dist.recv(grad, src=peers[(stage + 1) % pp])
            outputs[b].backward(grad)
        inp = inputs[b]
        if inp is not None and inp.grad is not None:
            dist.send(inp.grad.contiguous(), dst=peers[(stage - 1) % pp])
    return loss


def reduce_grads(chunks: Sequence[torch.nn.Module], tied: bool) -> None:
    """What Megatron's DDP + finalize_model_grads do for plain modules (no router bias update)."""
    # (reduce over DP first, then over TP: the same order as finalize_model_grads)
    from megatron.core import parallel_state as ps

    for chunk in chunks:
        for name, p in chunk.named_parameters():
            if p.grad is None:
                continue
            expert = ".mlp.experts." in name
            group = ps.get_expert_data_parallel_group() if expert else ps.get_data_parallel_group()
            if dist.get_world_size(group) > 1:
                dist.all_reduce(p.grad, group=group)
                p.grad /= dist.get_world_size(group)
    _reduce_over_tp(chunks)
    if tied and ps.get_pipeline_model_parallel_world_size() > 1:
        group = ps.get_embedding_group()
        if dist.get_rank() in dist.get_process_group_ranks(group):
            first = ps.is_pipeline_first_stage(ignore_virtual=True)
            weight = (chunks[0] if first else chunks[-1]).shared_embedding_or_output_weight()
            dist.all_reduce(weight.grad, group=group)


def _reduce_over_tp(chunks: Sequence[torch.nn.Module]) -> None:
    """Megatron's `_allreduce_non_tensor_model_parallel_grads`: TP-replicated params whose grads
    are partial per TP rank (q/k_layernorm see only the rank's heads) are summed over TP, those
    marked `average_gradients_across_tp_domain` averaged; otherwise the TP copies drift apart."""
    from megatron.core import parallel_state as ps

    group = ps.get_tensor_model_parallel_group()
    if dist.get_world_size(group) <= 1:
        return
    for chunk in chunks:
        qk_norm = bool(getattr(chunk.config, "qk_layernorm", False))
        for name, p in chunk.named_parameters():
            if p.grad is None:
                continue
            if getattr(p, "average_gradients_across_tp_domain", False):
                dist.all_reduce(p.grad, op=dist.ReduceOp.AVG, group=group)
            elif qk_norm and ("q_layernorm" in name or "k_layernorm" in name):
                dist.all_reduce(p.grad, group=group)


def train_step(
    chunks: Sequence[torch.nn.Module], optimizer: torch.optim.Optimizer, vocab: int, tied: bool, seed: int = 7
) -> float | None:
    """One optimizer step on a seeded batch; every rank of the trainer calls it together."""
    from megatron.core import parallel_state as ps

    moe_tp = ps.get_tensor_model_parallel_world_size() > 1 and any(
        getattr(c.config, "num_moe_experts", None) for c in chunks
    )
    for chunk in chunks:
        chunk.eval() if moe_tp else chunk.train()
    optimizer.zero_grad(set_to_none=True)
    loss = forward_backward(chunks, batch(vocab, seed=seed))
    reduce_grads(chunks, tied)
    optimizer.step()
    return loss
