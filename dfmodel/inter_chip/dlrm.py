"""DLRM training on many chips: embedding tables sharded (model parallel), MLPs data parallel.

The hybrid parallelism of Naumov et al. 2019 (arXiv:1906.00091, sec. 4) and Mudigere et al.
2022 ("Software-hardware co-design for fast and scalable training of DLRM", ISCA, sec. 3-4),
as torchrec implements it, with torchrec's 2-D sparse parallelism as the ``dp`` knob:

- ``tp`` (the sharding group, ``g`` chips): the tables are sharded over ``g`` chips and every
  such group holds one full copy; ``dp = N / g`` groups (replicas). ``tp = N, dp = 1`` is the
  classic layout. The dense part (bottom/top MLP, interaction, loss) is data-parallel over all
  ``N`` chips in every case: each chip runs ``b = ceil(B / N)`` samples of the global batch
  ``B`` (``micro_batch`` is per chip; with ``m`` micro-batches, ``b = m * micro_batch``).
- Sharding plans (a scheme per table, tables ordered by size): ``table-wise`` (a whole table on
  one chip), ``row-wise`` (rows split over the group), ``column-wise:k`` (the embedding dim split
  into ``k`` column shards placed like tables), ``replicated`` (a copy on every chip, gradients
  all-reduced over all chips: torchrec's data-parallel sharding), and the hybrids ``hybrid:r,j``
  = the ``r`` largest tables row-wise, the ``j`` smallest replicated, the rest table-wise (this
  family contains table-wise ``0,0``, row-wise ``t,0`` and replicated ``0,t``), and HugeCTR's
  ``frequency-hybrid:t`` (NVIDIA's MLPerf DLRM: rows looked up at least ``t`` times per iteration
  replicated and all-reduced, the rest distributed by row with one vector per look-up in the
  all-to-all; see :func:`frequency_plans`). Whole tables and
  column shards are placed by LPT (largest lookup load first, onto the least-loaded chip with
  room), so a plan's placement is one fixed function of the plan.
- Time of one micro-batch: the intra-chip pass on the graph of the busiest chip (the builder's
  graph at ``micro_batch`` samples, its embedding kernels rescaled to the largest gathered
  rows, pooled outputs and ids of any chip of the group -- an upper envelope when different
  chips are busiest in different terms). The forward exchange (ids all-to-all + pooled
  all-to-all for table/column shards + reduce-scatter of partial sums for row-wise) is the
  network time of ``fwd.emb_a2a``; the backward (gradient all-to-all + all-gather) that of
  ``bwd.emb_a2a``; all over the sharding group. All-to-all message = each chip's whole send
  buffer, taking the busiest chip's send or receive volume, whichever is larger.
- Per step: ``m`` micro-batches, then the exposed gradient sync (dense MLP gradients
  all-reduced over all chips -- or reduce-scatter + all-gather with ``distributed_optimizer``
  -- plus the replicated tables' touched rows over all chips, plus, with ``dp > 1``, each shard's
  touched rows over its replicas), overlapped with the last micro-batch's backward as the
  system's ``dp_overlap`` says (:func:`~dfmodel.inter_chip.pipeline.dp_sync_time`) -- only its
  compute hides the sync: the backward's embedding exchange keeps the same links busy; then the
  optimizer step (DRAM traffic, see :func:`dense_optimizer_bytes`,
  :func:`embedding_state_bytes_per_row`) and the exposed input pipeline.
- Memory of the busiest chip: table shards + MLP weights (``weights``), MLP and replicated-table
  dense gradients plus one micro-batch's sparse gradient rows (``gradients``), optimizer state
  (``optimizer``: see the two functions above), and the graph's peak live DRAM tensors plus its
  inputs (``activations``).

With ``training.cuda_graphs`` (HugeCTR's holistic CUDA graph) each kernel costs the chip's
``graph_kernel_overhead_s`` instead of the eager launch (:func:`graph_launched`).

Breakdown keys: the embedding exchanges inside the step (model-parallel) under ``tp_comm`` when
they dominate a partition, the gradient/replica syncs under ``dp_comm``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from dfmodel.inter_chip.checkpoint import CheckpointState
from dfmodel.inter_chip.input_pipeline import input_exposed_s
from dfmodel.inter_chip.io import io_terms
from dfmodel.errors import InfeasibleError, InputError
from dfmodel.graph.build import build_graphs
from dfmodel.graph.builders.formulas import INDEX_BYTES
from dfmodel.graph.kernel import KernelKind, Phase
from dfmodel.inter_chip.config import Knobs, divisors
from dfmodel.inter_chip.config import Placed
from dfmodel.inter_chip.family_api import ModelFamily
from dfmodel.inter_chip.family_base import (
    FamilyEvaluation,
    FamilyMemory,
    FamilyModel,
    build_result,
    chip_time,
    empty_breakdown,
    floor_terms,
    input_bytes_by_kernel,
    io_bytes,
    reject_knobs,
    rescale_graph,
    run_search,
)
from dfmodel.inter_chip.pipeline import dp_sync_time
from dfmodel.netmodels import split_dims
from dfmodel.result import Parallelism
from dfmodel.system.processor import graph_launched, memory_time_s
from dfmodel.system.schema import System

FP32 = 4


def dense_optimizer_bytes(optimizer: str, bytes_per_element: int) -> tuple[float, float]:
    """(state bytes, DRAM traffic bytes of one step) per dense (MLP) parameter.

    State: Adam two fp32 moments (8), Adagrad one fp32 accumulator (4), SGD none; below fp32 an
    fp32 master copy (4) as in mixed-precision training (Micikevicius et al. 2018; with Adam and
    16-bit weights this is ZeRO's 12 bytes of optimizer state, Rajbhandari et al. 2020 sec. 3.1).
    Traffic: read weight and gradient, write weight (``3 p``), read and write state and master.

    >>> dense_optimizer_bytes("adam", 2), dense_optimizer_bytes("adagrad", 4)
    ((12, 30), (4, 20))
    """
    state = {"adam": 8, "adagrad": 4, "sgd": 0}[optimizer]
    master = FP32 if bytes_per_element < FP32 else 0
    return state + master, 3 * bytes_per_element + 2 * (state + master)


def embedding_state_bytes_per_row(optimizer: str, columns: int) -> float:
    """Optimizer state of one embedding row (or row shard of ``columns`` columns).

    Adagrad is the row-wise sparse Adagrad of FBGEMM/torchrec (``EXACT_ROWWISE_ADAGRAD``, the
    DLRM default: one fp32 accumulator per row); Adam keeps two fp32 moments per element; SGD
    none. Tables keep no master copy (low-precision tables use stochastic rounding).

    >>> embedding_state_bytes_per_row("adagrad", 128), embedding_state_bytes_per_row("adam", 128)
    (4, 1024)
    """
    return {"adagrad": FP32, "adam": 2 * FP32 * columns, "sgd": 0}[optimizer]


# --------------------------------------------------------------------------------------------
# Sharding plans
# --------------------------------------------------------------------------------------------

SCHEME_NAMES = {"tw": "table-wise", "rw": "row-wise", "dp": "replicated", "cw": "column-wise",
                "fh": "frequency-hybrid"}


@dataclass(frozen=True)
class Plan:
    """A scheme per table: ``tw``, ``rw``, ``dp`` (replicated), ``cw`` (with ``col_shards``) or
    ``fh`` (frequency-hybrid: ``frequent`` holds each table's (frequent rows, share of lookups))."""

    name: str
    schemes: tuple[str, ...]
    col_shards: int = 1
    frequent: tuple[tuple[int, float], ...] = ()


# -- frequency-hybrid embedding (HugeCTR) ------------------------------------------------------
#
# NVIDIA's MLPerf DLRM (HugeCTR ``HybridSparseEmbedding``, MLPerf Training v1.0-v2.0) splits every
# table by how often its rows are looked up: the *frequent* rows are replicated on every GPU
# (looked up locally, their gradients all-reduced over all GPUs: data-parallel), the *infrequent*
# rows are distributed over the GPUs by row (model-parallel) and each infrequent look-up travels
# as one vector in the all-to-all. HugeCTR calls a row frequent when its count over the
# calibration iterations passes a threshold (``calculate_threshold`` in HugeCTR
# src/embeddings/hybrid_embedding/calibration_data.cu: multi-node, per iteration
# ``t = nodes * (a2a_bw / ar_bw) * nodes / (nodes - 1)``, with MLPerf's 1.9e11 / 1.3e11 B/s
# about 13.4 at 8 nodes; single node, a duplicate-probability bound). Here the threshold ``t``
# (expected look-ups per iteration) is a search variable over powers of two, so the search
# finds the split that is best under this model's own collective costs rather than HugeCTR's
# two calibrated bandwidths. Expected counts follow the workload's access distribution
# (``embedding.zipf_exponent``: uniform when absent, then a table is frequent as a whole or not).

#: Euler-Maclaurin is used above this many terms of the generalized harmonic number.
_HARMONIC_EXACT = 4096


def harmonic(n: int, s: float) -> float:
    """Generalized harmonic number ``H(n, s) = sum_{k=1..n} k^-s`` (exact up to 4096 terms, then
    the Euler-Maclaurin tail: integral + half the end terms + the first derivative correction).

    >>> harmonic(3, 0.0), round(harmonic(4, 1.0), 6), abs(harmonic(10**6, 1.2) - 5.0) < 1.0
    (3.0, 2.083333, True)
    """
    if n <= 0:
        return 0.0
    m = min(n, _HARMONIC_EXACT)
    head = float(np.sum(np.arange(1, m + 1, dtype=float) ** -s))
    if n == m:
        return head
    a, b = float(m), float(n)
    integral = math.log(b / a) if s == 1.0 else (b ** (1 - s) - a ** (1 - s)) / (1 - s)
    # sum_{k=m+1..n} f(k) = int_m^n f + (f(n) - f(m))/2 + (f'(n) - f'(m))/12, f(k) = k^-s
    return head + integral + (b ** -s - a ** -s) / 2 + (-s * b ** (-s - 1) + s * a ** (-s - 1)) / 12


def frequent_split(rows: int, lookups_per_iteration: float, zipf: float, threshold: float) -> tuple[int, float]:
    """(frequent rows, their share of the table's look-ups) for rows looked up at least
    ``threshold`` times per iteration in expectation.

    Uniform access (``zipf`` 0): every row ``lookups / rows`` times, so all rows or none.
    Power law ``p(k) = k^-s / H(rows, s)``: the ``K`` most popular rows with
    ``lookups * K^-s / H >= threshold``, holding ``H(K, s) / H(rows, s)`` of the look-ups.

    >>> frequent_split(100, 1000, 0.0, 8), frequent_split(100, 1000, 0.0, 16)
    ((100, 1.0), (0, 0.0))
    >>> k, f = frequent_split(1000, 1000, 1.0, 10); k, round(f, 3)
    (13, 0.425)
    """
    if zipf == 0.0:
        return (rows, 1.0) if lookups_per_iteration / rows >= threshold else (0, 0.0)
    h = harmonic(rows, zipf)
    k = min(rows, int(math.floor((lookups_per_iteration / (threshold * h)) ** (1.0 / zipf) + 1e-9)))
    if k <= 0:
        return 0, 0.0
    return k, (1.0 if k == rows else harmonic(k, zipf) / h)


def frequency_thresholds(max_count: float) -> list[float]:
    """Thresholds searched: powers of two from 1 look-up per iteration up to the largest
    expected count of any row (beyond it nothing is frequent)."""
    return [2.0 ** k for k in range(int(math.floor(math.log2(max(max_count, 1.0)))) + 1)]


def frequency_plans(rows: list[int], lookups: list[int], batch: int, zipf: list[float]) -> list[Plan]:
    """One ``fh`` plan per distinct frequent split over :func:`frequency_thresholds`."""
    t = len(rows)
    counts = [batch * lookups[i] / (1.0 if zipf[i] else rows[i]) / (harmonic(rows[i], zipf[i]) if zipf[i] else 1.0)
              for i in range(t)]  # the most popular row's expected count per iteration
    out: dict[tuple, Plan] = {}
    for th in frequency_thresholds(max(counts)):
        split = tuple(frequent_split(rows[i], batch * lookups[i], zipf[i], th) for i in range(t))
        key = tuple(k for k, _ in split)
        if key not in out:
            out[key] = Plan(f"frequency-hybrid:{th:g}", ("fh",) * t, 1, split)
    return list(out.values())


def enumerate_plans(rows: list[int], dim: int, g: int, *, lookups: list[int] | None = None,
                    batch: int | None = None, zipf: list[float] | None = None) -> list[Plan]:
    """Every plan the search considers for a sharding group of ``g`` chips (see module doc);
    with ``lookups`` and ``batch`` also the frequency-hybrid plans (:func:`frequency_plans`).

    >>> [p.name for p in enumerate_plans([10, 20], 4, 2)][:4]
    ['hybrid:0,0', 'hybrid:0,1', 'hybrid:0,2', 'hybrid:1,0']
    >>> [p.name for p in enumerate_plans([10, 20], 4, 1)]
    ['replicated']
    >>> [p.name for p in enumerate_plans([10, 20], 4, 2, lookups=[1, 1], batch=40)][-3:]
    ['column-wise:2', 'frequency-hybrid:1', 'frequency-hybrid:4']
    """
    t = len(rows)
    if g == 1:
        return [Plan("replicated", ("dp",) * t)]
    order = sorted(range(t), key=lambda i: (-rows[i], i))  # largest first
    out: dict[tuple, Plan] = {}
    for r in range(t + 1):
        for j in range(t - r + 1):
            schemes = ["tw"] * t
            for i in order[:r]:
                schemes[i] = "rw"
            for i in order[t - j:]:
                schemes[i] = "dp"
            key = tuple(schemes)
            if key not in out:
                out[key] = Plan(f"hybrid:{r},{j}", key)
    plans = list(out.values())
    for k in divisors(dim):
        if 1 < k <= g:
            plans.append(Plan(f"column-wise:{k}", ("cw",) * t, k))
    if lookups is not None and batch is not None:
        plans.extend(frequency_plans(rows, lookups, batch, zipf or [0.0] * t))
    return plans


def plan_label(plan: Plan) -> str:
    """Readable name: the uniform schemes by their torchrec names, hybrids by their counts."""
    kinds = set(plan.schemes)
    if kinds == {"fh"}:
        k = sum(r for r, _ in plan.frequent)
        share = sum(f for _, f in plan.frequent) / len(plan.frequent)
        return (f"frequency-hybrid ({k:,} frequent rows replicated, {share:.0%} of look-ups on average; "
                f"the rest distributed by row)")
    if len(kinds) == 1:
        s = plan.schemes[0]
        return SCHEME_NAMES[s] + (f" ({plan.col_shards} column shards)" if s == "cw" else "")
    counts = {s: plan.schemes.count(s) for s in ("rw", "tw", "dp")}
    return "hybrid: " + ", ".join(f"{c} {SCHEME_NAMES[s]}" for s, c in counts.items() if c)


@dataclass
class PlanLoads:
    """Per-chip loads of one plan on a sharding group (arrays of length ``g``).

    ``*_S`` are per sample of the replica group's micro-batch (``S = g * micro_batch``), ``*_s``
    per sample of the chip's own micro-batch (replicated tables, same on every chip).
    """

    gather_S: np.ndarray  # embedding elements gathered
    gather_rows_S: np.ndarray  # rows gathered
    pooled_S: np.ndarray  # pooled elements produced (table/column shards + row-wise partials)
    pooled_twcw_S: np.ndarray  # of which sent by all-to-all
    ids_S: np.ndarray  # ids received
    opt_traffic_S: np.ndarray  # optimizer-state DRAM bytes of the fused sparse update
    gather_s: float
    gather_rows_s: float
    pooled_s: float
    ids_s: float
    opt_traffic_s: float
    ids_sent_s: float  # ids each chip ships out per own sample (sharded tables)
    cols_twcw: float  # columns delivered by the all-to-all per sample
    cols_rw: int  # columns of row-wise tables (reduce-scatter / all-gather per sample)
    weight_bytes: np.ndarray  # table shard bytes held
    state_bytes: np.ndarray  # their optimizer state
    sync_bytes: np.ndarray  # touched-row bytes synchronised over the replicas (dp > 1)
    sync_rows_bytes: np.ndarray  # DRAM bytes of applying that sync
    dp_weight_bytes: float  # replicated tables (every chip)
    dp_state_bytes: float
    dp_sync_bytes: float  # touched rows of replicated tables, all-reduced over all chips
    dp_update_bytes: float  # DRAM traffic of their dense update
    overflow: bool  # some shard did not fit on any chip


# --------------------------------------------------------------------------------------------
# The mapping
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, order=True)
class DLRMMapping(Placed):
    tp: int  # sharding group size
    dp: int  # table replicas (N / tp)
    micro_batch: int  # per chip
    num_micro_batches: int
    plan: str
    placement: tuple = ()
    distributed_optimizer: bool = False


    def dims_report(self, system: System) -> dict[str, list[str]]:
        out = {name: [f"{d}:{n}" for d, n in grp] for name, grp in self.placement}
        out["dense_dp"] = [f"{d.name}:{d.size}" for d in system.network if d.size > 1]
        return out


class DLRMModel(FamilyModel):
    """Cost model of DLRM training on one system: ``lower_bound_s`` and ``evaluate``."""

    family = "dlrm"

    def __init__(self, workload, system: System, **options):
        if workload.training.cuda_graphs:
            system = graph_launched(system)
        super().__init__(workload, system, **options)
        self.p = self.precision.bytes
        self.optimizer = workload.training.optimizer
        e = workload.embedding
        self.rows, self.lookups, self.dim = e.rows(), e.lookups(), e.dim
        self.zipf = e.zipf()
        self.t = e.num_tables
        self.N = system.num_chips
        self.B = workload.training.global_batch
        self.b = math.ceil(self.B / self.N)  # samples per chip
        self.all_group = tuple((d.name, d.size) for d in system.network if d.size > 1)
        base = build_graphs(workload, batch=1).layer
        self.mlp_params = float(sum(k.params for k in base.kernels if k.kind != KernelKind.embedding))
        self.dense_state, self.dense_traffic = dense_optimizer_bytes(self.optimizer, self.p)
        self.capacity = float(system.chip.memory.usable_bytes)  # capacity minus the reserve
        self._graphs: dict[int, object] = {}
        self._loads: dict[tuple, PlanLoads] = {}
        self._plans: dict[int, dict[str, Plan]] = {}
        self._chip: dict[tuple, object] = {}
        self._dense_floor: dict[int, object] = {}

    # -- plans ------------------------------------------------------------------------------
    def plans(self, g: int) -> dict[str, Plan]:
        if g not in self._plans:
            self._plans[g] = {p.name: p for p in enumerate_plans(self.rows, self.dim, g, lookups=self.lookups,
                                                                 batch=self.B, zipf=self.zipf)}
        return self._plans[g]

    def common_static_bytes(self, mapping: DLRMMapping) -> float:
        """Bytes every chip holds whatever the shard placement: MLP weights, gradients, state."""
        shard = self.N if mapping.distributed_optimizer else 1
        return self.mlp_params * (2 * self.p + self.dense_state / shard)

    def loads(self, g: int, plan: Plan) -> PlanLoads:
        """Per-chip loads of ``plan`` on ``g`` chips (cached); LPT placement of whole shards."""
        key = (g, plan.name)
        if key in self._loads:
            return self._loads[key]
        p, d, opt, B = self.p, self.dim, self.optimizer, self.B
        z = lambda: np.zeros(g)  # noqa: E731
        gather, grow, pooled, ptw, ids, otr = z(), z(), z(), z(), z(), z()
        wbytes, sbytes, sync, syncd = z(), z(), z(), z()
        gs = grs = ps = ids_s = ots = 0.0
        ids_sent = 0.0
        cols_twcw = cols_rw = 0
        dp_w = dp_st = dp_sync = dp_upd = 0.0
        items = []  # (table, columns) shards placed whole
        for i, scheme in enumerate(plan.schemes):
            R, L = self.rows[i], self.lookups[i]
            if scheme in ("dp", "fh"):  # replicated (dp: every row; fh: the frequent ones)
                K, phi = (R, 1.0) if scheme == "dp" else plan.frequent[i]
                st = embedding_state_bytes_per_row(opt, d)
                if K:  # replicated rows: looked up locally, gradients all-reduced
                    gs += L * phi * d
                    grs += L * phi
                    ps += phi * d
                    ids_s += L * phi
                    ots += 2 * L * phi * st
                    dp_w += K * d * p
                    dp_st += K * st
                    touched = min(K, B * L * phi)  # fh: = K (a frequent row is looked up >= t >= 1 times)
                    dp_sync += touched * d * p
                    dp_upd += touched * (3 * d * p + 2 * st)
                if K < R:  # infrequent rows: by row over the group, each look-up sent as one row
                    q = L * (1.0 - phi) / g  # per sample of the group, on every chip (id mod g)
                    held = math.ceil((R - K) / g)
                    gather += q * d
                    grow += q
                    pooled += q * d
                    ptw += q * d
                    ids += q
                    otr += 2 * q * st
                    wbytes += held * d * p
                    sbytes += held * st
                    touched = min(held, B * q)
                    sync += touched * d * p
                    syncd += touched * 2 * d * p
                    ids_sent += L * (1.0 - phi)
                    cols_twcw += L * (1.0 - phi) * d
            elif scheme == "rw":
                held = math.ceil(R / g)
                share = min(1.0, held / R)  # uniform ids: the fullest chip's share of the lookups
                st = embedding_state_bytes_per_row(opt, d)
                gather += L * share * d
                grow += L * share
                pooled += d  # partial sums for every sample of the group
                ids += L * share
                otr += 2 * L * share * st
                wbytes += held * d * p
                sbytes += held * st
                touched = min(held, B * L * share)
                sync += touched * d * p
                syncd += touched * 2 * d * p
                ids_sent += L
                cols_rw += d
            else:  # tw / cw: whole shards placed by LPT below
                k = plan.col_shards if scheme == "cw" else 1
                for _ in range(k):
                    items.append((i, d // k))
                ids_sent += L * k
                cols_twcw += d
        # LPT: largest gathered volume first onto the least-loaded chip that has room
        # room per chip: capacity minus what every chip holds anyway (MLP weights, gradients and
        # state; replicated tables, their dense gradients and state; the row-wise shares)
        room = self.capacity - (self.mlp_params * (2 * p + self.dense_state) + 2 * dp_w + dp_st + wbytes[0] + sbytes[0])
        overflow = False
        used = np.zeros(g)
        for i, cols in sorted(items, key=lambda it: (-self.lookups[it[0]] * it[1], -self.rows[it[0]] * it[1], it[0])):
            R, L = self.rows[i], self.lookups[i]
            st = embedding_state_bytes_per_row(opt, cols)
            need = R * cols * p + R * st
            fits = np.flatnonzero(used + need <= room)
            if len(fits):
                c = int(fits[np.argmin(gather[fits])])
            else:
                overflow = True
                c = int(np.argmin(used))
            used[c] += need
            gather[c] += L * cols
            grow[c] += L
            pooled[c] += cols
            ptw[c] += cols
            ids[c] += L
            otr[c] += 2 * L * st
            wbytes[c] += R * cols * p
            sbytes[c] += R * st
            touched = min(R, B * L)
            sync[c] += touched * cols * p
            syncd[c] += touched * 2 * cols * p
        out = PlanLoads(gather, grow, pooled, ptw, ids, otr, gs, grs, ps, ids_s, ots, ids_sent, cols_twcw, cols_rw,
                        wbytes, sbytes, sync, syncd, dp_w, dp_st, dp_sync, dp_upd, overflow)
        self._loads[key] = out
        return out

    # -- graphs -----------------------------------------------------------------------------
    def base_graph(self, mb: int):
        if mb not in self._graphs:
            g = build_graphs(self.workload, batch=mb).layer
            names = {}
            for k in g.kernels:
                if k.kind == KernelKind.embedding:
                    names["gather" if k.phase == Phase.forward else "scatter"] = k.name
                elif k.kind == KernelKind.comm and k.comm_group == "embedding":
                    names["a2a_fwd" if k.phase == Phase.forward else "a2a_bwd"] = k.name
            tnames = {}
            for t in g.tensors:
                if t.consumer == names["gather"] and t.producer is None:
                    tnames["indices"] = t.name
                elif t.producer == names["gather"] and t.consumer == names["a2a_fwd"]:
                    tnames["pooled"] = t.name
                elif t.producer == names["a2a_bwd"] and t.consumer == names["scatter"]:
                    tnames["d_pooled"] = t.name
                elif t.producer == names["scatter"] and t.consumer is None:
                    tnames["dW"] = t.name
            emb = set(names.values())
            dense = [k for k in g.kernels if k.name not in emb]
            self._graphs[mb] = (g, names, tnames, dense, input_bytes_by_kernel(g))
        return self._graphs[mb]

    def per_chip(self, m: DLRMMapping):
        """(kernel updates, tensor bytes, network seconds, volumes) of the busiest chip per micro-batch."""
        L = self.loads(m.tp, self.plans(m.tp)[m.plan])
        s, S = m.micro_batch, m.micro_batch * m.tp
        p = self.p
        g, names, tn, _, _ = self.base_graph(s)
        E = float(L.gather_S.max() * S + L.gather_s * s)
        P = float(L.pooled_S.max() * S + L.pooled_s * s)
        I = float(L.ids_S.max() * S + L.ids_s * s)
        E0 = s * sum(self.lookups) * self.dim
        f = E / E0
        kg, ks = g.kernel(names["gather"]), g.kernel(names["scatter"])
        kernels = {
            names["gather"]: {"flop": kg.flop * f, "extra_memory_bytes": kg.extra_memory_bytes * f, "output_bytes": P * p},
            names["scatter"]: {"flop": ks.flop * f, "extra_memory_bytes": ks.extra_memory_bytes * f,
                               "output_bytes": ks.output_bytes * f},
            names["a2a_bwd"]: {"output_bytes": P * p},
        }
        tensors = {tn["indices"]: I * INDEX_BYTES, tn["pooled"]: P * p, tn["d_pooled"]: P * p, tn["dW"]: ks.output_bytes * f}
        grp = m.group("tp")
        ids_msg = max(float(L.ids_S.max()) * S, L.ids_sent_s * s) * INDEX_BYTES
        a2a_msg = max(float(L.pooled_twcw_S.max()) * S, L.cols_twcw * s) * p
        rw_msg = L.cols_rw * S * p
        fwd = bwd = 0.0
        if grp:
            if ids_msg > 0:
                fwd += self.costs.time_s("all_to_all", ids_msg, grp)
            if a2a_msg > 0:
                fwd += self.costs.time_s("all_to_all", a2a_msg, grp)
                bwd += self.costs.time_s("all_to_all", a2a_msg, grp)
            if rw_msg > 0:
                fwd += self.costs.time_s("reduce_scatter", rw_msg, grp)
                bwd += self.costs.time_s("all_gather", rw_msg, grp)
        network = {names["a2a_fwd"]: fwd, names["a2a_bwd"]: bwd}
        vol = {"gathered_elements": E, "pooled_elements": P, "ids": I, "ids_msg": ids_msg, "a2a_msg": a2a_msg,
               "rw_msg": rw_msg, "gathered_rows": float(L.gather_rows_S.max() * S + L.gather_rows_s * s)}
        return kernels, tensors, network, vol

    # -- memory, optimizer, sync ------------------------------------------------------------
    def static_memory(self, m: DLRMMapping, L: PlanLoads, gathered_elements: float) -> tuple[FamilyMemory, int]:
        """Memory of the busiest chip without activations, and that chip's index."""
        shard = self.N if m.distributed_optimizer else 1
        per_chip = L.weight_bytes + L.state_bytes
        c = int(np.argmax(per_chip))
        weights = self.mlp_params * self.p + L.dp_weight_bytes + float(L.weight_bytes[c])
        grads = self.mlp_params * self.p + L.dp_weight_bytes + gathered_elements * self.p
        opt = self.mlp_params * self.dense_state / shard + L.dp_state_bytes + float(L.state_bytes[c])
        return FamilyMemory(weights, grads, opt, 0.0, self.capacity), c

    def optimizer_s(self, m: DLRMMapping, L: PlanLoads) -> float:
        """DRAM time of the optimizer per step: dense MLP update (sharded with a distributed
        optimizer), fused sparse state update of every gathered row, replicated tables' dense
        update of their touched rows, and applying the replica sync of shard rows."""
        shard = self.N if m.distributed_optimizer else 1
        s, S = m.micro_batch, m.micro_batch * m.tp
        sparse = m.num_micro_batches * (float(L.opt_traffic_S.max()) * S + L.opt_traffic_s * s)
        sync = float(L.sync_rows_bytes.max()) if m.dp > 1 else 0.0
        traffic = self.mlp_params * self.dense_traffic / shard + sparse + L.dp_update_bytes + sync
        return memory_time_s(self.system.chip, traffic)

    def sync_s(self, m: DLRMMapping, L: PlanLoads) -> tuple[float, float]:
        """(bytes, seconds) of the per-step gradient synchronisation (all collectives in turn)."""
        grad = self.mlp_params * self.p
        t = 0.0
        if self.all_group:
            if m.distributed_optimizer:
                t += self.costs.time_s("reduce_scatter", grad, self.all_group)
                t += self.costs.time_s("all_gather", grad, self.all_group)
            else:
                t += self.costs.time_s("all_reduce", grad, self.all_group)
            if L.dp_sync_bytes > 0:
                t += self.costs.time_s("all_reduce", L.dp_sync_bytes, self.all_group)
        total = grad + L.dp_sync_bytes
        rep = m.group("dp")
        if m.dp > 1 and rep:
            sb = float(L.sync_bytes.max())
            if sb > 0:
                t += self.costs.time_s("all_reduce", sb, rep)
                total += sb
        return total, t

    def input_exposed_s(self, step_s: float) -> float:
        t = self.workload.training
        return input_exposed_s(self.system, self.B, t.input_bytes_per_sample or 0.0, step_s, data=t.data)

    def checkpoint_state(self) -> CheckpointState | None:
        """Saved bytes with this module's memory accounting: MLP weights and dense optimizer
        state (:func:`dense_optimizer_bytes`), every table row's weights and row state
        (:func:`embedding_state_bytes_per_row`), gradients on request. Tables are sharded over
        every chip, so every chip writes its slice and a restart reads the state once."""
        ckpt = self.workload.training.checkpoint
        if ckpt is None:
            return None
        rows = float(sum(self.rows))
        saved = self.mlp_params * (self.p + self.dense_state)
        saved += rows * (self.dim * self.p + embedding_state_bytes_per_row(self.optimizer, self.dim))
        if ckpt.include_gradients:
            saved += (self.mlp_params + rows * self.dim) * self.p
        return CheckpointState(saved, self.N, saved)

    # -- search interface -------------------------------------------------------------------
    def memory_floor_bytes(self, m: DLRMMapping) -> float:
        """Valid floor of the busiest chip's memory: everything but activations (exact)."""
        L = self.loads(m.tp, self.plans(m.tp)[m.plan])
        s, S = m.micro_batch, m.micro_batch * m.tp
        gathered = float(L.gather_S.max() * S + L.gather_s * s)
        return self.static_memory(m, L, gathered)[0].total_bytes

    def refined_bound_s(self, m: DLRMMapping) -> float | None:
        """No tighter bound than :meth:`lower_bound_s` (exact on kernel-by-kernel chips)."""
        return None

    def lower_bound_s(self, m: DLRMMapping) -> float:
        """``m`` micro-batches of the busiest chip's kernel floor (the exact closed form on
        kernel-by-kernel chips), the exact optimizer step, the sync exposure with the largest
        backward the floor allows (exact on kernel-by-kernel chips, none on dataflow chips unless
        ``dp_overlap`` is 0) and the input rule ``total = max(step, input load)``."""
        kernels, tensors, network, _ = self.per_chip(m)
        g, names, tn, dense, inputs = self.base_graph(m.micro_batch)
        if m.micro_batch not in self._dense_floor:
            self._dense_floor[m.micro_batch] = floor_terms(dense, self.system, self.precision, {}, inputs)
        emb = [replace(g.kernel(n), **kernels.get(n, {})) for n in names.values()]
        tb = {t.name: t.bytes for t in g.tensors}
        tb.update(tensors)
        emb_inputs: dict[str, float] = {}
        seen = set()
        for t in g.tensors:
            if t.consumer in names.values() and (t.name, t.consumer) not in seen:
                seen.add((t.name, t.consumer))
                emb_inputs[t.consumer] = emb_inputs.get(t.consumer, 0.0) + tb[t.name]
        terms = self._dense_floor[m.micro_batch] + floor_terms(emb, self.system, self.precision, network, emb_inputs)
        terms.io_bytes = io_bytes(g.kernels, g.tensors, tensors)
        L = self.loads(m.tp, self.plans(m.tp)[m.plan])
        sync_bytes, sync_s = self.sync_s(m, L)
        back = max(0.0, terms.backward_upper_s(self.system) - network[self.base_graph(m.micro_batch)[1]['a2a_bwd']])
        exposed = dp_sync_time(sync_bytes, sync_s, back, self.system.dp_overlap) if sync_s > 0 and back < math.inf \
            else (sync_s if self.system.dp_overlap == 0 else 0.0)
        step = m.num_micro_batches * terms.bound_s(self.system) + exposed + self.optimizer_s(m, L)
        return step + self.input_exposed_s(step)

    def evaluate(self, m: DLRMMapping) -> FamilyEvaluation:
        L = self.loads(m.tp, self.plans(m.tp)[m.plan])
        kernels, tensors, network, vol = self.per_chip(m)
        mem, _ = self.static_memory(m, L, vol["gathered_elements"])
        if not mem.fits:
            return self._misfit(m, mem, "tables and model state")
        key = (m.micro_batch, tuple(sorted((k, tuple(sorted(v.items()))) for k, v in kernels.items())),
               tuple(sorted(tensors.items())), tuple(sorted(network.items())))
        if key not in self._chip:
            g = self.base_graph(m.micro_batch)[0]
            graph = rescale_graph(g, kernels, tensors, name=f"{g.name}.chip")
            try:
                self._chip[key] = (chip_time(graph, self.system, network, solver=self.solver,
                                             time_limit_s=self.time_limit_s), graph)
            except InfeasibleError as e:
                self._chip[key] = (str(e), graph)
        ct, graph = self._chip[key]
        if isinstance(ct, str):
            return self._misfit(m, mem, f"intra-chip: {ct}", force=True)
        inputs = sum({t.name: t.bytes for t in graph.inputs()}.values())
        mem.activations_bytes = ct.peak_live_bytes + inputs
        if not mem.fits:
            return self._misfit(m, mem, "with activations")
        sync_bytes, sync_s = self.sync_s(m, L)
        # the gradient sync hides behind the backward's compute, not behind its embedding
        # exchange: both are bandwidth-bound on the same links (the chip's NVLink/NIC ports)
        window = max(0.0, ct.backward_s - network[self.base_graph(m.micro_batch)[1]["a2a_bwd"]])
        dp_exposed = dp_sync_time(sync_bytes, sync_s, window, self.system.dp_overlap) if sync_s > 0 else 0.0
        opt_s = self.optimizer_s(m, L)
        step = m.num_micro_batches * ct.time_s + dp_exposed + opt_s
        io = io_terms(self.system, self.workload.training, self.B, step, self.checkpoint_state(),
                      source=self.workload.source)
        inp = io.input_s
        br = empty_breakdown()
        for k, v in ct.parts_s.items():
            br[k] += m.num_micro_batches * v
        br.update(dp_comm=dp_exposed, optimizer=opt_s, input=inp, checkpoint=io.checkpoint_s)
        detail = {"loads": L, "volumes": vol, "sync_s": sync_s, "network_s": network, "io": io}
        return FamilyEvaluation(m, step + inp + io.checkpoint_s, br, mem, True, ct.proven_optimal, ct, detail,
                                notes=list(io.notes))

    def _misfit(self, m: DLRMMapping, mem: FamilyMemory, what: str, force: bool = False) -> FamilyEvaluation:
        label = f"tp {m.tp} x dp {m.dp}, plan {m.plan}: {what}"
        if force:
            return self.misfit(m, label, mem, math.inf)
        return self.misfit(m, f"{label}: {mem.summary()}", mem)


# --------------------------------------------------------------------------------------------
# Candidates and entry point
# --------------------------------------------------------------------------------------------

_WHY = {
    "pp": "DLRM is not pipelined (pp must be 1)",
    "recompute": "DLRM keeps its few activations (recompute must be 'none')",
    "sequence_parallel": "DLRM has no sequence dimension",
    "interleave": "DLRM is not pipelined (interleave must be 1)",
}


def candidates(model: DLRMModel, knobs: Knobs):
    N, b = model.N, model.b
    w = model.workload
    if knobs.tp is not None and knobs.dp is not None and knobs.tp * knobs.dp != N:
        raise InputError(f"tp x dp = {knobs.tp * knobs.dp} but the system has {N} chips (DLRM: tp = tables' "
                         "sharding group, dp = its replicas)", field="tp/dp")
    for name in ("tp", "dp"):
        v = getattr(knobs, name)
        if v is not None and N % v:
            raise InputError(f"must divide the {N} chips, got {v}", field=name)
    mb = knobs.micro_batch or w.training.micro_batch
    if mb is not None and b % mb:
        field = "micro_batch" if knobs.micro_batch else "training.micro_batch"
        raise InputError(f"DLRM's micro-batch is per chip and must divide the {b} samples each chip runs "
                         f"(global batch {model.B} over {N} chips), got {mb}", field=field)
    mb = mb or b
    dist = [knobs.distributed_optimizer] if knobs.distributed_optimizer is not None else [False]
    for g in divisors(N):
        if knobs.tp is not None and g != knobs.tp:
            continue
        r = N // g
        if knobs.dp is not None and r != knobs.dp:
            continue
        layouts = split_dims(model.system, {"tp": g, "dp": r})
        for plan in model.plans(g).values():
            for lay in layouts:
                for d in dist:
                    yield DLRMMapping(g, r, mb, b // mb, plan.name, (("tp", lay["tp"]), ("dp", lay["dp"])), bool(d))


def solve_dlrm(workload, system: System, knobs: Knobs, *, solver: str = "auto", time_limit_s: float | None = None,
               exhaustive: bool = False):
    reject_knobs(knobs, "DLRM", ("tp", "dp", "micro_batch", "distributed_optimizer"), _WHY)
    model = DLRMModel(workload, system, solver=solver, time_limit_s=time_limit_s)
    best, stats = run_search(model, candidates(model, knobs), exhaustive=exhaustive)
    return to_result(model, best, stats)


def useful_flop(model: DLRMModel) -> float:
    """Training FLOP of one step: the builder's graph count per sample times the global batch."""
    return build_graphs(model.workload, batch=1).layer.total_flop() * model.B


def to_result(model: DLRMModel, ev: FamilyEvaluation, stats):
    m: DLRMMapping = ev.mapping
    w, system = model.workload, model.system
    plan = model.plans(m.tp)[m.plan]
    L: PlanLoads = ev.detail["loads"]
    vol = ev.detail["volumes"]
    sharding = {}
    for i, s in enumerate(plan.schemes):
        label = SCHEME_NAMES[s]
        if s == "fh":
            k, f = plan.frequent[i]
            label += f" ({k:,} frequent rows replicated, {f:.0%} of look-ups; the rest by row over {m.tp} chips)"
        elif s == "cw":
            label += f" ({plan.col_shards} shards)"
        elif s == "rw":
            label += f" (over {m.tp} chips)"
        sharding[f"table{i}"] = label
    g = model.base_graph(m.micro_batch)[0]
    names = model.base_graph(m.micro_batch)[1]
    for k in g.kernels:
        if k.name in (names["gather"], names["scatter"]):
            sharding[k.name] = f"tables {plan_label(plan)} over {m.tp} chips, {m.dp} replicas"
        elif k.name in (names["a2a_fwd"], names["a2a_bwd"]):
            sharding[k.name] = f"exchange over the sharding group ({m.tp} chips)"
        else:
            sharding[k.name] = f"data-parallel over {model.N} chips"
    flop = useful_flop(model)
    notes = [
        f"DLRM: tp = {m.tp} chips share one copy of the tables ({plan_label(plan)}), dp = {m.dp} replicas of it; "
        f"the MLPs are data-parallel over all {model.N} chips, micro_batch {m.micro_batch} per chip x "
        f"{m.num_micro_batches}",
        "breakdown: embedding all-to-all / reduce-scatter / all-gather inside the step -> tp_comm (when they "
        "dominate a partition); MLP gradient all-reduce, replicated-table and replica syncs -> dp_comm "
        f"(exposed part, dp_overlap {system.dp_overlap})",
        f"optimizer {model.optimizer}: MLP state {model.dense_state:g} B/param"
        + (", sharded over all chips" if m.distributed_optimizer else "")
        + f"; tables: {'row-wise sparse Adagrad, 4 B per row' if model.optimizer == 'adagrad' else model.optimizer}"
        + " state, updated in the backward (fused) for the rows gathered",
        f"per micro-batch the busiest chip gathers {vol['gathered_elements'] * model.p / 2**20:.1f} MiB of rows; "
        f"all-to-all {vol['a2a_msg'] / 2**20:.2f} MiB, row-wise reduce-scatter {vol['rw_msg'] / 2**20:.2f} MiB, "
        f"ids {vol['ids_msg'] / 2**20:.2f} MiB per chip",
        "tokens_per_s = samples_per_s (no tokens in DLRM)",
    ]
    if L.overflow:
        notes.append("LPT could not place every shard within capacity")
    if model.B % model.N:
        notes.append(f"global batch {model.B} is not a multiple of {model.N} chips: the busiest chip runs {model.b}")
    par = Parallelism(tp=m.tp, pp=1, dp=m.dp, micro_batch=m.micro_batch, num_micro_batches=m.num_micro_batches,
                      distributed_optimizer=m.distributed_optimizer, dims=m.dims_report(system))
    return build_result(workload=w, system=system, ev=ev, stats=stats, useful_flop=flop, samples=model.B,
                        parallelism=par, sharding=sharding, intra_per="micro-batch (busiest chip)", notes=notes,
                        pipeline={"plan": m.plan, "plan_label": plan_label(plan),
                                  "sync_s": ev.detail["sync_s"], "exchange_s": ev.detail["network_s"]})



class DLRMFamily(ModelFamily):
    """``kind: dlrm`` behind the common family interface (:mod:`dfmodel.inter_chip.family_api`)."""

    kind = "dlrm"
    model_class = DLRMModel
    candidates_fn = staticmethod(candidates)
    result_fn = staticmethod(to_result)
    solve_fn = staticmethod(solve_dlrm)
