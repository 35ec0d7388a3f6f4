"""Input pipeline: reading and preprocessing the global batch overlaps the training step.

Two models, chosen by the system's ``storage`` block (:mod:`dfmodel.system.storage`):

- **one block** (``read_bandwidth_Bps`` + ``preprocess_samples_per_s``): every node reads its
  ``global_batch / nodes`` samples at its read bandwidth and preprocesses them at its sample
  rate; the slower of the two is the load (:func:`input_exposed_s`, unchanged);
- **tiers** (:func:`input_time`): per node and step,

  1. *where the bytes come from.* Tiers are listed outermost first; the outermost holds the
     dataset, every tier inside it is a cache. A cache tier's hit ratio ``h`` on the stream of
     misses of the tiers inside it follows from its capacity ``C`` against the working set
     ``W`` it sees (:func:`hit_ratio`): ``W`` is the dataset for a cluster tier and for a node
     tier under shuffled access (a global shuffle sends every node a random slice of the whole
     dataset each epoch), and the node's own shard ``D / nodes`` for a node tier under
     sequential access (each node re-reads the same shard). Tier ``j`` serves the fraction
     ``h_j * prod_{i inside j} (1 - h_i)`` of the bytes and the outermost tier the rest
     (misses of independent caches multiply). In the **first epoch** every cache is cold
     (``h = 0``): every byte comes from the outermost tier.
  2. *how long each tier takes.* A tier serving ``B`` bytes in ``R`` requests of ``s`` bytes
     to a node gets ``bw = min(aggregate / nodes, per-node)`` (node tiers: the device's own
     bandwidth). With ``d`` requests in flight (the prefetch depth), Little's law bounds the
     throughput by ``d s / (latency + s / bw)``, so

        ``t = max(B / bw, R (latency + s / bw) / d)``

     bandwidth-bound when ``d s / bw >= latency`` and latency-bound otherwise. EMLIO (Jamil,
     Nine, Kosar, SC'25 Sustainable Supercomputing workshop, arXiv:2508.11035) measures this
     regime change: at 10-30 ms RTT a loader with few outstanding requests is latency-bound
     and deep out-of-order prefetching restores the bandwidth-bound time.
  3. *the storage NIC.* Bytes from cluster tiers share the node's ``node_network_Bps`` (if
     given): ``t_net = B_remote / node_network_Bps``.
  4. *the CPU.* ``samples * preprocess_core_s_per_sample / cpu_cores_per_node`` (or the one-
     block ``preprocess_samples_per_s`` rate, if the storage block gives one).

  Tiers, the NIC and the CPU work concurrently on different batches (the loaders prefetch),
  so the load of one step is the slowest of them: the **binding** stage. Loading the next
  batch overlaps the current step, so only ``max(0, load - step)`` is exposed
  (``breakdown_s.input``, steady state; the first epoch is reported separately).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dfmodel.system.schema import System


def input_exposed_s(system: System, global_batch: int, input_bytes_per_sample: float, step_s: float,
                    data=None) -> float:
    """Seconds the step waits for its input (steady state).

    One-block storage: each node reads ``global_batch / nodes`` samples at
    ``storage.read_bandwidth_Bps`` and preprocesses them at ``storage.preprocess_samples_per_s``;
    loading the next batch overlaps the current step, so only ``max(0, load - step)`` is exposed.
    Tiered storage: :func:`input_time`. No ``storage`` block, or no input bytes, means the input
    pipeline is not modelled (0).

    >>> from dfmodel.system import load_system
    >>> s = load_system({"name": "t", "chip": {"name": "c", "peak_flops": 1e12, "sram_bytes": 1e6,
    ...     "memory": {"kind": "DDR", "capacity_bytes": 1e9, "bandwidth_Bps": 1e10}},
    ...     "network": [{"name": "r", "topology": "ring", "size": 8, "link_bandwidth_Bps": 1e9}],
    ...     "storage": {"chips_per_node": 8, "read_bandwidth_Bps": 1e9, "preprocess_samples_per_s": 1e3}})
    >>> input_exposed_s(s, 4000, 1e6, 1.0)   # 4 GB at 1 GB/s = 4 s; preprocessing 4 s: 3 s exposed
    3.0
    """
    storage = system.storage
    if storage is None or input_bytes_per_sample <= 0:
        return 0.0
    if storage.tiered:
        return input_time(system, global_batch, input_bytes_per_sample, data, step_s).exposed_s
    nodes = max(1, system.num_chips // storage.chips_per_node)
    samples_per_node = global_batch / nodes
    load_s = max(samples_per_node * input_bytes_per_sample / storage.read_bandwidth_Bps,
                 samples_per_node / storage.preprocess_samples_per_s)
    return max(0.0, load_s - step_s)


# --------------------------------------------------------------------------------------------
# Tiered model
# --------------------------------------------------------------------------------------------


def hit_ratio(capacity_bytes: float, working_set_bytes: float | None, *, eviction: str, access: str) -> float:
    """Steady-state fraction of requests a cache of ``capacity_bytes`` serves.

    - working set unknown (no dataset size given): 0, nothing can be assumed to fit;
    - working set fits: 1 (every sample was cached in the first epoch);
    - ``pin`` (cache the first bytes, never evict; CoorDL's MinIO, Mohan et al., "Analyzing and
      Mitigating Data Stalls in DNN Training", VLDB 2021, sec. 4.1): ``C / W`` whatever the
      order, since each epoch reads every sample once;
    - ``lru`` under shuffled access: every sample is equally likely next, and under uniform
      independent references every replacement policy serves ``C / W`` (the independent
      reference model; Mohan et al. observe LRU page caches do no better under shuffling);
    - ``lru`` under sequential access with ``W > C``: 0. A loop over more blocks than the cache
      holds evicts every block before it is read again (LRU's sequential-flooding case; the page
      cache thrashing of Mohan et al., sec. 3.2).

    >>> hit_ratio(1e12, 4e12, eviction="pin", access="sequential")
    0.25
    >>> hit_ratio(1e12, 4e12, eviction="lru", access="sequential"), hit_ratio(5e12, 4e12, eviction="lru", access="sequential")
    (0.0, 1.0)
    """
    if working_set_bytes is None or capacity_bytes <= 0:
        return 0.0
    if working_set_bytes <= capacity_bytes:
        return 1.0
    if eviction == "lru" and access == "sequential":
        return 0.0
    return capacity_bytes / working_set_bytes


def fetch_time_s(bytes_: float, requests: float, bandwidth_Bps: float, latency_s: float, depth: int) -> float:
    """Time to fetch ``bytes_`` in ``requests`` requests with ``depth`` in flight (module doc, 2).

    >>> fetch_time_s(1e9, 10, 1e9, 0.0, 1)          # bandwidth-bound: 1 GB at 1 GB/s
    1.0
    >>> fetch_time_s(1e6, 1000, 1e9, 1e-3, 4)       # latency-bound: 1000 x (1 ms + 1 us) / 4
    0.25025
    """
    if bytes_ <= 0 or requests <= 0:
        return 0.0
    size = bytes_ / requests
    return max(bytes_ / bandwidth_Bps, requests * (latency_s + size / bandwidth_Bps) / depth)


@dataclass
class StageLoad:
    """One stage of the input pipeline for one node and step: a tier, the NIC or the CPU."""

    name: str
    kind: str  # tier kind, "network" or "cpu"
    time_s: float
    bytes: float = 0.0
    requests: float = 0.0
    share: float = 0.0  # fraction of the step's bytes this tier serves
    hit_ratio: float = 0.0  # the tier's own hit ratio on the misses of the tiers inside it
    bound: str = ""  # bandwidth | latency | cpu


@dataclass
class InputTime:
    """Input load of one step on one node, by stage; the slowest stage binds."""

    load_s: float
    exposed_s: float
    binding: str
    stages: list[StageLoad] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {
            "load_s": self.load_s,
            "exposed_s": self.exposed_s,
            "binding": self.binding,
            "stages": {s.name: {"kind": s.kind, "time_s": s.time_s, "bytes_per_node": s.bytes,
                                "requests_per_node": s.requests, "share": s.share,
                                "hit_ratio": s.hit_ratio, "bound": s.bound} for s in self.stages},
        }


def served_shares(hits_inner_first: list[float]) -> list[float]:
    """Fractions of the bytes each tier serves, innermost first, the last being the outermost
    tier (which takes every remaining miss).

    >>> served_shares([0.5, 0.5, 0.0])   # node cache, distributed cache, file system
    [0.5, 0.25, 0.25]
    """
    shares, miss = [], 1.0
    for h in hits_inner_first[:-1]:
        shares.append(miss * h)
        miss *= 1.0 - h
    return shares + [miss]


def input_time(system: System, global_batch: int, sample_bytes: float, data, step_s: float, *,
               cold: bool = False) -> InputTime:
    """Load and exposed time of one step's input on tiered storage (module doc); ``cold`` is
    the first epoch (every cache empty). ``data`` is the workload's
    :class:`~dfmodel.graph.data_pipeline.DataPipeline` (None: defaults, dataset size unknown)."""
    from dfmodel.graph.data_pipeline import DataPipeline

    storage = system.storage
    data = data if data is not None else DataPipeline()
    nodes = storage.nodes(system.num_chips)
    samples = global_batch / nodes
    bytes_node = samples * sample_bytes
    requests_node = samples / data.samples_per_request_for(sample_bytes)
    dataset = data.dataset_size_bytes(sample_bytes)

    tiers_inner_first = list(reversed(storage.tiers))
    hits = []
    for i, tier in enumerate(tiers_inner_first):
        if i == len(tiers_inner_first) - 1:
            hits.append(1.0)  # the outermost tier holds the dataset
            continue
        if cold:
            hits.append(0.0)
            continue
        working = dataset
        if tier.is_node and dataset is not None and data.access == "sequential":
            working = dataset / nodes  # each node re-reads its own shard
        hits.append(hit_ratio(tier.capacity_bytes, working, eviction=tier.eviction, access=data.access))
    shares = served_shares(hits)

    stages: list[StageLoad] = []
    remote_bytes = 0.0
    for tier, h, share in zip(tiers_inner_first, hits, shares):
        b, r = share * bytes_node, share * requests_node
        bw = tier.read_Bps_per_node(nodes)
        t = fetch_time_s(b, r, bw, tier.latency_s, data.prefetch_depth)
        bound = "bandwidth" if b <= 0 or t <= b / bw * (1 + 1e-12) else "latency"
        stages.append(StageLoad(tier.name, tier.kind, t, b, r, share, h, bound))
        if not tier.is_node:
            remote_bytes += b
    if storage.node_network_Bps is not None:
        stages.append(StageLoad("network", "network", remote_bytes / storage.node_network_Bps, remote_bytes,
                                bound="bandwidth"))
    cpu_s = samples * data.preprocess_core_s_per_sample / data.cpu_cores_per_node if data.cpu_cores_per_node else 0.0
    if storage.preprocess_samples_per_s is not None:
        cpu_s = max(cpu_s, samples / storage.preprocess_samples_per_s)
    stages.append(StageLoad("cpu", "cpu", cpu_s, bound="cpu"))

    binding = max(stages, key=lambda s: s.time_s)
    load = binding.time_s
    return InputTime(load, max(0.0, load - step_s), binding.name if load > 0 else "none", stages)
