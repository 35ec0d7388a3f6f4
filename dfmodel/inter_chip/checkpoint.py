"""Checkpoints: bytes saved, the stall they cost per step, and the restart time.

**Bytes.** What a checkpoint saves is the model state of the memory model
(:func:`dfmodel.inter_chip.memory.model_state_bytes`) for all parameters of one model replica:
16-bit weights (2 bytes/param) and the optimizer state -- for mixed-precision Adam the fp32
master weights, momentum and variance (12 bytes/param; Rajbhandari et al., ZeRO, SC 2020,
sec. 3.1) -- so 14 bytes/param; gradients (2) only with ``include_gradients``. Data-parallel
replicas hold the same state, so it is saved once per model replica.

**Writers.** With ``fully_parallel`` (Megatron-Core's distributed checkpointing, the "fully
parallel save" strategy that splits a replica's shards over the data-parallel ranks) every chip
writes ``bytes / chips``; without it the ``tp x pp`` chips of one replica write their shards.
The writing nodes share the tier: ``bandwidth = min(aggregate_write, writer_nodes x
node_write)`` (node tiers: ``writer_nodes x node_write``), and the storage NIC of each writing
node if the system gives ``node_network_Bps``.

**Stall per checkpoint.**

- staging copy (device to host, ``storage.host_copy_Bps`` per chip, all chips at once):
  ``copy = bytes_per_writer_chip / host_copy_Bps`` (0 when the system does not give it);
- ``sync``: training waits for the copy and the write: ``copy + write``;
- ``async`` (PyTorch DCP ``async_save``; Megatron-Core async checkpointing): training waits for
  the copy only, the write drains in the background while the next ``interval`` steps run; if
  the drain outlasts the interval the next checkpoint waits for it:
  ``copy + max(0, write - interval_steps x step)``. Never more than ``sync``.

**Per step.** ``stall / interval_steps`` (``breakdown_s.checkpoint``); with ``interval_s`` the
interval in steps is ``interval_s / step``.

**Restart.** Every replica needs the state back: ``bytes`` once with ``fully_parallel`` (ranks
read disjoint slices and exchange them), ``dp x bytes`` otherwise, read by all nodes. The read
comes from the innermost cluster tier inside the checkpoint tier that can hold a checkpoint
(a write-through distributed cache such as Fluid with JindoCache, which keeps the latest
checkpoint hot for the reload), else from the checkpoint tier itself; the cold figure (from
the checkpoint tier) is reported too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dfmodel.errors import InputError
from dfmodel.inter_chip.memory import model_state_bytes
from dfmodel.system.schema import System


@dataclass(frozen=True)
class CheckpointState:
    """What one checkpoint saves and who writes it, from the mapping and the memory model."""

    bytes_total: float  # one model replica's saved state
    writer_chips: int
    restart_bytes_total: float


def checkpoint_state(params_total: float, *, num_chips: int, tp: int, pp: int, dp: int, checkpoint) -> CheckpointState:
    """Saved bytes (memory model, module doc) and the chips that write them.

    >>> from dfmodel.graph.data_pipeline import Checkpointing
    >>> s = checkpoint_state(1e9, num_chips=64, tp=8, pp=2, dp=4, checkpoint=Checkpointing(interval_steps=100))
    >>> s.bytes_total / 1e9, s.writer_chips   # 2 + 12 bytes/param, every chip writes
    (14.0, 64)
    """
    state = model_state_bytes(params_total, dp=1, distributed_optimizer=False)
    saved = state.weights_bytes + state.optimizer_bytes
    if checkpoint.include_gradients:
        saved += state.gradients_bytes
    writers = num_chips if checkpoint.fully_parallel else max(1, tp * pp)
    restart = saved if checkpoint.fully_parallel else saved * dp
    return CheckpointState(saved, writers, restart)


@dataclass
class CheckpointCost:
    """Per-checkpoint and per-step cost of checkpointing, and the restart time."""

    tier: str
    bytes_total: float
    copy_s: float
    write_s: float
    stall_s: float
    interval_steps: float
    per_step_s: float
    restart_s: float
    restart_tier: str
    restart_cold_s: float
    mode: str

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def _tier_for(system: System, checkpoint, source: str | None):
    storage = system.storage
    if checkpoint.tier is None:
        return storage.tiers[0]
    try:
        return storage.tier(checkpoint.tier)
    except KeyError:
        names = ", ".join(t.name for t in storage.tiers)
        raise InputError(f"no storage tier {checkpoint.tier!r} in system {system.name} (tiers: {names})",
                         source=source, field="training.checkpoint.tier") from None


def _write_Bps(system: System, tier, writer_nodes: int) -> float:
    storage = system.storage
    bw = tier.write_Bps_per_node(writer_nodes) * writer_nodes
    if not tier.is_node and storage.node_network_Bps is not None:
        bw = min(bw, storage.node_network_Bps * writer_nodes)
    return bw


def _read_s(system: System, tier, bytes_total: float, nodes: int) -> float:
    storage = system.storage
    bw = tier.read_Bps_per_node(nodes)
    if not tier.is_node and storage.node_network_Bps is not None:
        bw = min(bw, storage.node_network_Bps)
    return bytes_total / nodes / bw + tier.latency_s


def checkpoint_cost(system: System, checkpoint, state: CheckpointState, step_s: float, *,
                    source: str | None = None) -> CheckpointCost:
    """The model of the module doc for one mapping whose step (without checkpoints) is ``step_s``.

    >>> from dfmodel.graph.data_pipeline import Checkpointing
    >>> from dfmodel.system import load_system
    >>> s = load_system({"name": "t", "chip": {"name": "c", "peak_flops": 1e12, "sram_bytes": 1e6,
    ...     "memory": {"kind": "DDR", "capacity_bytes": 1e9, "bandwidth_Bps": 1e10}},
    ...     "network": [{"name": "r", "topology": "ring", "size": 16, "link_bandwidth_Bps": 1e9}],
    ...     "storage": {"chips_per_node": 8, "tiers": [{"name": "fs", "kind": "parallel_fs",
    ...         "capacity_bytes": 1e15, "aggregate_read_Bps": 2e9, "aggregate_write_Bps": 1e9}]}})
    >>> st = CheckpointState(10e9, 16, 10e9)
    >>> c = checkpoint_cost(s, Checkpointing(interval_steps=10), st, 1.0)
    >>> c.write_s, c.per_step_s    # 10 GB at 1 GB/s every 10 steps
    (10.0, 1.0)
    >>> checkpoint_cost(s, Checkpointing(interval_steps=10, mode="async"), st, 1.0).per_step_s  # hidden
    0.0
    """
    storage = system.storage
    tier = _tier_for(system, checkpoint, source)
    writer_nodes = max(1, min(storage.nodes(system.num_chips), math.ceil(state.writer_chips / storage.chips_per_node)))
    write_s = state.bytes_total / _write_Bps(system, tier, writer_nodes) + tier.latency_s
    copy_s = state.bytes_total / state.writer_chips / storage.host_copy_Bps if storage.host_copy_Bps else 0.0
    if checkpoint.interval_steps is not None:
        interval = float(checkpoint.interval_steps)
    else:
        interval = max(1.0, checkpoint.interval_s / step_s) if step_s > 0 else 1.0
    if checkpoint.mode == "sync":
        stall = copy_s + write_s
    else:
        stall = copy_s + max(0.0, write_s - interval * step_s)

    nodes = storage.nodes(system.num_chips)
    cold_s = _read_s(system, tier, state.restart_bytes_total, nodes)
    restart_tier, restart_s = tier.name, cold_s
    idx = storage.tiers.index(tier)
    for inner in reversed(storage.tiers[idx + 1:]):  # innermost first
        if not inner.is_node and inner.capacity_bytes >= state.bytes_total:
            cached_s = _read_s(system, inner, state.restart_bytes_total, nodes)
            if cached_s < cold_s:  # a cache slower than the tier behind it would not be read
                restart_tier, restart_s = inner.name, cached_s
            break
    return CheckpointCost(tier.name, state.bytes_total, copy_s, write_s, stall, interval, stall / interval,
                          restart_s, restart_tier, cold_s, checkpoint.mode)
