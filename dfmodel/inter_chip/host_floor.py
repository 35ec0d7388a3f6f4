"""A lower bound on the host DRAM an offloaded LLM mapping needs per chip, read from its degrees
and offload options only (no micro-batch, layer split or block solve).

What the evaluation charges (:meth:`dfmodel.inter_chip.offload.OffloadPlan.stage_memory`, per
pipeline stage, the worst stage counting): with optimizer offload, the stage's optimizer shard
(fp32 master + Adam moments, ``o`` bytes per parameter) plus its fp32 gradients (``g`` bytes per
parameter, ZeRO-Offload, Ren et al. ATC 2021 sec. 4.1); with weight offload, also the 16-bit
copy of the stage's layer shard (ZeRO-Infinity, Rajbhandari et al. SC 2021 sec. 5). Activation
offload adds bytes too (counted 0 here: a floor).

The worst stage holds at least the mean over the ``pp`` stages, and the stages together hold
every layer's and the embedding's / head's parameters, each split at most ``tp`` ways (TP
replicates only norms), the optimizer and gradients further over the ``dp x cp`` ranks (any
ZeRO stage >= 1; optimizer offload needs ZeRO >= 2 or dp x cp = 1), the weights over them under
ZeRO-3. MoE expert parameters are left out (they are split over ep as well, a floor must not
assume less), so for a dense model this is ``(o + g) P / N``: GPT-3 1T on 64 H100 needs >= 234.5
GiB of host per chip against a 216.8 GiB share of a DGX H100's 2 TB (``reserve_bytes`` 128 GiB,
8 GPUs), so no offloaded mapping fits -- proven without evaluating one.
"""

from __future__ import annotations

from dfmodel.inter_chip import offload as off
from dfmodel.inter_chip.memory import StateBytesPerParam


def dense_params_floor(model) -> float:
    """Parameters of the model without its MoE experts (embedding and head included)."""
    total, _, layer_experts, _ = model._param_counts
    if total is None:
        return 0.0
    return total - model.num_moe_layers * layer_experts


def host_floor_bytes(model, m) -> float:
    """Least host bytes per chip any mapping with ``m``'s degrees, ZeRO stage and offload
    options is charged (0 when it offloads no model state)."""
    opt = getattr(m, "offload_optimizer", "none") != "none"
    weights = getattr(m, "offload_weights", False)
    if not (opt or weights):
        return 0.0
    t = model.training
    state = StateBytesPerParam.of_training(t, linear=True)
    per_chip = dense_params_floor(model) / (m.tp * m.pp)  # a stage's mean, the worst is no less
    shard = m.dp_cp if m.zero_stage >= 1 else 1
    need = (state.optimizer + t.grad_bytes) * per_chip / shard if opt else 0.0
    if weights:  # the 16-bit layer shard streamed up; ZeRO-3 (or dp x cp = 1) shards it
        need += t.activation_bytes * per_chip / (m.dp_cp if m.zero_stage == 3 else 1) * layer_share(model)
    return need


def layer_share(model) -> float:
    """Fraction of the dense parameters in the layers (weight offload streams layers only)."""
    total = dense_params_floor(model)
    if total <= 0:
        return 0.0
    _, layer, experts, dense = model._param_counts
    layers = model.num_moe_layers * (layer - experts) + model.num_dense_layers * (dense or 0.0)
    return min(1.0, layers / total)


def host_share_bytes(system) -> float | None:
    """A chip's share of its host's usable DRAM (None without a host)."""
    host = system.host
    if host is None:
        return None
    return host.usable_bytes / host.sharing(system.num_chips)


def host_may_fit(model, m) -> bool:
    """False when :func:`host_floor_bytes` proves ``m``'s offloaded state exceeds its host share."""
    share = host_share_bytes(model.system)
    return share is None or not off.uses_offload(m) or host_floor_bytes(model, m) <= share


__all__ = ["host_floor_bytes", "host_share_bytes", "host_may_fit"]
