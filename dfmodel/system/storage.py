"""Storage of a training cluster: where input samples and checkpoints live (pydantic schema).

Two forms are accepted under a system's ``storage:`` key.

1. The one-block form of earlier releases (kept as is): every node reads at
   ``read_bandwidth_Bps`` and preprocesses ``preprocess_samples_per_s``::

       storage: {chips_per_node: 8, read_bandwidth_Bps: 2 GB/s, preprocess_samples_per_s: 5000}

2. A hierarchy of tiers, **outermost first** (the first tier holds the whole dataset and takes
   the checkpoints unless the workload names another tier)::

       storage:
         chips_per_node: 8
         node_network_Bps: 50 GB/s     # optional: one node's storage-NIC injection bandwidth,
                                       # shared by every cluster tier it reads or writes
         node_network_power_w: 50      # optional: power of those NICs per node (I/O energy)
         host_copy_Bps: 50 GB/s        # optional: device-to-host copy bandwidth per chip (PCIe),
                                       # the staging step of a checkpoint
         tiers:
           - name: lustre
             kind: parallel_fs         # object_store | parallel_fs | distributed_cache |
                                       # local_nvme | page_cache
             capacity_bytes: 10 PB
             aggregate_read_Bps: 500 GB/s     # the whole tier, divided among the nodes
             aggregate_write_Bps: 250 GB/s    # default: aggregate_read_Bps
             node_read_Bps: 40 GB/s           # one client node's ceiling (NIC share)
             node_write_Bps: 20 GB/s          # default: node_read_Bps
             latency_s: 1 ms                  # per request
             power_w: 40000                   # the whole tier
             price_usd: 5000000
           - name: nvme
             kind: local_nvme          # node-scope by default: capacity, bandwidth, power and
             capacity_bytes: 30 TB     # price are per node; no aggregate fields
             node_read_Bps: 25 GB/s
             latency_s: 100 us
             power_w: 200

A tier's ``scope`` is ``cluster`` (one shared service: its figures are for the whole tier) or
``node`` (one instance per node: its figures are per node); the default follows ``kind``
(``local_nvme`` and ``page_cache`` are node tiers). ``eviction`` says how a cache tier keeps
what it has read: ``pin`` keeps the first bytes it caches and never evicts (CoorDL's MinIO
cache, Mohan et al., VLDB 2021, sec. 4.1; Fluid/JindoCache datasets preloaded into the cache),
``lru`` evicts the least recently used (the Linux page cache). The models that use these
fields are in :mod:`dfmodel.inter_chip.input_pipeline` and :mod:`dfmodel.inter_chip.checkpoint`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, field_validator, model_validator

from dfmodel.system.units import Bytes, BytesPerSec, NonNegativeFloat, PositiveFloat, Seconds

TierKind = Literal["object_store", "parallel_fs", "distributed_cache", "local_nvme", "page_cache"]
NODE_KINDS = ("local_nvme", "page_cache")


class _Strict(BaseModel):
    # same configuration as dfmodel.system.schema.Strict (that module imports this one)
    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)


class StorageTier(_Strict):
    """One storage tier: capacity, bandwidth (aggregate and per node), latency, power, price."""

    name: str = Field(min_length=1)
    kind: TierKind
    scope: Literal["cluster", "node"] | None = None  # filled from kind
    capacity_bytes: Bytes
    aggregate_read_Bps: BytesPerSec | None = None
    aggregate_write_Bps: BytesPerSec | None = None
    node_read_Bps: BytesPerSec | None = None
    node_write_Bps: BytesPerSec | None = None
    latency_s: Seconds = 0.0
    power_w: NonNegativeFloat = 0.0
    price_usd: NonNegativeFloat = 0.0
    eviction: Literal["pin", "lru"] = "pin"

    @model_validator(mode="after")
    def _bandwidths(self) -> "StorageTier":
        if self.scope is None:
            # bypass validate_assignment recursion: set the private dict entry directly
            self.__dict__["scope"] = "node" if self.kind in NODE_KINDS else "cluster"
        if self.scope == "node":
            if self.node_read_Bps is None:
                raise ValueError(f"tier {self.name!r}: a node tier needs node_read_Bps (bandwidth of one node's device)")
            if self.aggregate_read_Bps is not None or self.aggregate_write_Bps is not None:
                raise ValueError(f"tier {self.name!r}: a node tier takes node_read_Bps / node_write_Bps, "
                                 "not aggregate_* (its aggregate is per node x nodes)")
        elif self.aggregate_read_Bps is None:
            raise ValueError(f"tier {self.name!r}: a cluster tier needs aggregate_read_Bps (the whole tier's read bandwidth)")
        return self

    # -- effective figures (defaults documented in the module doc) ------------------------------
    @property
    def is_node(self) -> bool:
        return self.scope == "node"

    def read_Bps_per_node(self, nodes: int) -> float:
        """Read bandwidth one of ``nodes`` concurrent readers gets: ``min(aggregate / nodes,
        per-node)`` for a cluster tier, the device's own for a node tier."""
        return self._share(self.aggregate_read_Bps, self.node_read_Bps, nodes)

    def write_Bps_per_node(self, nodes: int) -> float:
        agg = self.aggregate_write_Bps if self.aggregate_write_Bps is not None else self.aggregate_read_Bps
        node = self.node_write_Bps if self.node_write_Bps is not None else self.node_read_Bps
        return self._share(agg, node, nodes)

    def _share(self, aggregate: float | None, node: float | None, nodes: int) -> float:
        if self.is_node:
            return float(node)
        share = aggregate / max(1, nodes)
        return min(share, node) if node is not None else share

    def capacity_for(self, nodes: int) -> float:
        """Bytes the tier holds across ``nodes`` nodes (node tiers: per node x nodes)."""
        return self.capacity_bytes * (nodes if self.is_node else 1)

    def power_for(self, nodes: int) -> float:
        return self.power_w * (nodes if self.is_node else 1)

    def price_for(self, nodes: int) -> float:
        return self.price_usd * (nodes if self.is_node else 1)


class Storage(_Strict):
    """Input and checkpoint storage: the one-block form or a list of tiers (see module doc)."""

    chips_per_node: PositiveInt = 8
    read_bandwidth_Bps: BytesPerSec | None = None
    preprocess_samples_per_s: PositiveFloat | None = None
    tiers: list[StorageTier] = Field(default_factory=list)
    node_network_Bps: BytesPerSec | None = None
    node_network_power_w: NonNegativeFloat = 0.0  # storage NICs (and their optics) of one node
    host_copy_Bps: BytesPerSec | None = None

    @field_validator("tiers")
    @classmethod
    def _unique_names(cls, tiers: list[StorageTier]) -> list[StorageTier]:
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"tier names must be unique, got {names}")
        if tiers and tiers[0].is_node:
            raise ValueError(f"the first (outermost) tier holds the dataset and must be a cluster tier "
                             f"(object_store, parallel_fs or distributed_cache), got {tiers[0].kind}")
        return tiers

    @model_validator(mode="after")
    def _one_form(self) -> "Storage":
        if self.tiers:
            if self.read_bandwidth_Bps is not None:
                raise ValueError("read_bandwidth_Bps is the one-block form; with tiers give each tier's "
                                 "node_read_Bps / aggregate_read_Bps instead")
        elif self.read_bandwidth_Bps is None or self.preprocess_samples_per_s is None:
            raise ValueError("give either tiers (a storage hierarchy) or both read_bandwidth_Bps and "
                             "preprocess_samples_per_s (the one-block form)")
        return self

    @property
    def tiered(self) -> bool:
        return bool(self.tiers)

    def nodes(self, num_chips: int) -> int:
        """Nodes of a ``num_chips`` system (at least one)."""
        return max(1, num_chips // self.chips_per_node)

    def tier(self, name: str) -> StorageTier:
        for t in self.tiers:
            if t.name == name:
                return t
        raise KeyError(name)
