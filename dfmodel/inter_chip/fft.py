"""Distributed FFT: pencil (``P1 x P2``) or slab (``P``) decomposition, batch over ``dp`` groups.

The chips form ``dp`` groups of ``G = N / dp`` (``tp = G``); each group transforms
``ceil(batch / dp)`` of the arrays (in chunks of ``micro_batch`` transforms), every array
distributed over its group (Pekurovsky 2012, "P3DFFT", SIAM J. Sci. Comput. 34(4), sec. 2;
heFFTe, Ayala et al. 2020). Decompositions (the builder's plans,
:func:`~dfmodel.graph.builders.fft.fft_plan`):

- 3-D pencil, ``G = P1 x P2``: FFT along x, all-to-all within process rows (``P1``), FFT along
  y, all-to-all within process columns (``P2``), FFT along z; valid when ``P1 <= min(nx, ny)``
  and ``P2 <= min(ny, nz)``;
- 3-D slab, ``G = P``: 2-D FFT of x-y planes, one all-to-all over all ``P``, FFT along z; valid
  when ``P <= min(ny, nz)``;
- 2-D (``P <= min(nx, ny)``) and 1-D four-step ``n = n1 n2`` (``P <= min(n1, n2)``): one
  all-to-all over all ``P``.

Both 3-D decompositions are always searched: the workload's ``decomposition`` field is read as
the user's expectation, not a constraint, and the notes compare the optimum with the best
mapping of the stated decomposition.

Per chip (the busiest: the largest local piece over the stages, ceil of each split), the
builder's graph is rescaled to the local share: FFT stages do their share of the nominal
``5 n log2 n`` FLOP on the vector units and are memory-bound: each pass over the local data
reads and writes it once, and a stage needs more than one pass when its transform does not fit
in SRAM (:func:`stage_passes`); each transpose is an all-to-all over its sub-group with message
= the chip's local data (each member's whole buffer), plus the local pack/unpack traffic the
intra-chip pass charges to the comm kernel. Memory: local data plus a transpose buffer of the
same size (``activations``).

Breakdown: transposes under ``tp_comm`` (model-parallel communication) when they dominate their
partition; there is no ``dp_comm`` (the ``dp`` groups never communicate).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from dfmodel.errors import InfeasibleError, InputError
from dfmodel.graph.build import build_graphs
from dfmodel.graph.builders.fft import four_step_split, fft_plan
from dfmodel.graph.kernel import KernelKind
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
    io_bytes,
    reject_knobs,
    rescale_graph,
    run_search,
)
from dfmodel.netmodels import split_dims
from dfmodel.result import Parallelism
from dfmodel.system.schema import System


def stage_passes(lengths: tuple[int, ...], sram_points: float) -> int:
    """Passes over the local data of one FFT stage transforming ``lengths`` axes.

    One pass when a whole transform of the stage (``prod(lengths)`` points) fits in SRAM;
    otherwise each axis separately, and an axis of length ``n`` longer than SRAM's ``M`` points
    takes ``ceil(log2 n / log2 M)`` passes (the out-of-core / four-step FFT of Bailey 1990,
    "FFTs in external or hierarchical memory", J. Supercomputing 4).

    >>> stage_passes((4096,), 2**20), stage_passes((4096, 4096), 2**20), stage_passes((2**30,), 2**20)
    (1, 2, 2)
    """
    if math.prod(lengths) <= sram_points:
        return 1
    m = max(2.0, sram_points)
    return sum(1 if n <= m else math.ceil(math.log2(n) / math.log2(m)) for n in lengths)


@dataclass(frozen=True, order=True)
class FFTMapping(Placed):
    dp: int
    decomposition: str  # pencil | slab | transpose (2-D) | four-step (1-D) | local (1-D prime)
    p1: int
    p2: int
    micro_batch: int  # transforms per chunk in a group
    num_micro_batches: int
    placement: tuple = ()

    @property
    def tp(self) -> int:
        return self.p1 * self.p2



class FFTModel(FamilyModel):
    family = "fft"

    def __init__(self, workload, system: System, **options):
        super().__init__(workload, system, **options)
        self.dims = list(workload.dims)
        self.points = math.prod(self.dims)
        self.pb = workload.point_bytes
        self.N = system.num_chips
        self.capacity = float(system.chip.memory.usable_bytes)  # capacity minus the reserve
        self.sram_points = system.chip.sram_bytes / (2 * self.pb)  # double-buffered
        self._graphs: dict[tuple, object] = {}

    # -- decompositions -------------------------------------------------------------------------
    def builder_decomposition(self, decomposition: str) -> str:
        return decomposition if decomposition in ("pencil", "slab") else "pencil"

    def grids(self, G: int):
        """(decomposition, p1, p2) of ``G`` chips valid for the transform's dims."""
        d = self.dims
        if len(d) == 3:
            nx, ny, nz = d
            for p1 in divisors(G):
                p2 = G // p1
                if p1 <= min(nx, ny) and p2 <= min(ny, nz):
                    yield "pencil", p1, p2
            if G <= min(ny, nz):
                yield "slab", G, 1
        elif len(d) == 2:
            if G <= min(d):
                yield "transpose", G, 1
        else:
            n1, n2 = four_step_split(d[0])
            if n1 == 1:
                if G == 1:
                    yield "local", 1, 1
            elif G <= min(n1, n2):
                yield "four-step", G, 1

    def local_points(self, m: FFTMapping) -> int:
        """Points of one transform on the busiest chip (the largest piece over the stages)."""
        c = math.ceil
        d = self.dims
        if m.decomposition == "pencil":
            nx, ny, nz = d
            return max(nx * c(ny / m.p1) * c(nz / m.p2), c(nx / m.p1) * ny * c(nz / m.p2),
                       c(nx / m.p1) * c(ny / m.p2) * nz)
        if m.decomposition == "slab":
            nx, ny, nz = d
            return max(nx * ny * c(nz / m.p1), nx * c(ny / m.p1) * nz)
        if m.decomposition == "transpose":
            nx, ny = d
            return max(c(nx / m.p1) * ny, nx * c(ny / m.p1))
        if m.decomposition == "four-step":
            n1, n2 = four_step_split(d[0])
            return max(n1 * c(n2 / m.p1), c(n1 / m.p1) * n2)
        return self.points

    def comm_group(self, m: FFTMapping, name: str):
        if m.decomposition == "pencil":
            return {"row": m.group("P1"), "col": m.group("P2")}.get(name, m.group("P1") + m.group("P2"))
        return m.group("P")

    # -- the per-chip graph ---------------------------------------------------------------------
    def base(self, decomposition: str, transforms: int):
        key = (decomposition, transforms)
        if key not in self._graphs:
            w = self.workload.model_copy(update={"decomposition": self.builder_decomposition(decomposition)})
            g = build_graphs(w, batch=transforms).layer
            plan = fft_plan(self.dims, self.builder_decomposition(decomposition))
            lengths = [arg for step, arg in plan if step == "fft"]
            self._graphs[key] = (g, lengths)
        return self._graphs[key]

    def per_chip(self, m: FFTMapping):
        g, lengths = self.base(m.decomposition, m.micro_batch)
        local = self.local_points(m)
        f = local / self.points
        local_bytes = local * m.micro_batch * self.pb
        kernels, net = {}, {}
        ffts = [k for k in g.kernels if k.kind == KernelKind.fft]
        for k, lens in zip(ffts, lengths):
            passes = stage_passes(tuple(lens), self.sram_points)
            kernels[k.name] = {"flop": k.flop * f, "output_bytes": k.output_bytes * f,
                               "extra_memory_bytes": 2.0 * (passes - 1) * local_bytes,
                               "dims": {**k.dims, "batch": max(1, math.ceil(k.dims.get("batch", 1) * f))}}
        for k in g.kernels:
            if k.kind == KernelKind.comm:
                kernels[k.name] = {"output_bytes": k.output_bytes * f, "comm_bytes": k.comm_bytes * f}
                grp = self.comm_group(m, k.comm_group or "all")
                net[k.name] = self.costs.time_s(k.collective or "all_to_all", local_bytes, grp) if grp else 0.0
        tensors = {t.name: t.bytes * f for t in g.tensors}
        return g, kernels, tensors, net, local_bytes

    def memory(self, m: FFTMapping) -> FamilyMemory:
        local_bytes = self.local_points(m) * m.micro_batch * self.pb
        return FamilyMemory(0.0, 0.0, 0.0, 2.0 * local_bytes, self.capacity,
                            labels={"activations": "local data + transpose buffer"})

    def memory_floor_bytes(self, m: FFTMapping) -> float:
        return self.memory(m).total_bytes

    # -- search interface ---------------------------------------------------------------------
    def lower_bound_s(self, m: FFTMapping) -> float:
        """Kernel floors of one chunk (the exact closed form on kernel-by-kernel chips), x chunks."""
        g, kernels, tensors, net, _ = self.per_chip(m)
        ks = [replace(k, **kernels.get(k.name, {})) for k in g.kernels]
        inputs = {}
        seen = set()
        for t in g.tensors:
            if t.consumer is not None and (t.name, t.consumer) not in seen:
                seen.add((t.name, t.consumer))
                inputs[t.consumer] = inputs.get(t.consumer, 0.0) + tensors[t.name]
        terms = floor_terms(ks, self.system, self.precision, net, inputs)
        terms.io_bytes = io_bytes(ks, g.tensors, tensors)
        return m.num_micro_batches * terms.bound_s(self.system)

    def refined_bound_s(self, m: FFTMapping) -> float | None:
        return None

    def evaluate(self, m: FFTMapping) -> FamilyEvaluation:
        mem = self.memory(m)
        if not mem.fits:
            return self.misfit(m, f"{self.describe(m)}: {mem.summary()}", mem)
        g, kernels, tensors, net, local_bytes = self.per_chip(m)
        graph = rescale_graph(g, kernels, tensors, name=f"{g.name}.chip")
        try:
            ct = chip_time(graph, self.system, net, solver=self.solver, time_limit_s=self.time_limit_s)
        except InfeasibleError as e:
            return self.misfit(m, f"{self.describe(m)}: intra-chip: {e}", mem, math.inf)
        br = empty_breakdown()
        for k, v in ct.parts_s.items():
            br[k] += m.num_micro_batches * v
        detail = {"local_bytes": local_bytes, "network_s": net}
        return FamilyEvaluation(m, m.num_micro_batches * ct.time_s, br, mem, True, ct.proven_optimal, ct, detail)

    def describe(self, m: FFTMapping) -> str:
        grid = f"{m.p1} x {m.p2}" if m.decomposition == "pencil" else f"{m.p1}"
        return f"{m.decomposition} {grid}, dp {m.dp}"


_WHY = {
    "pp": "an FFT is not pipelined (pp must be 1)",
    "recompute": "an FFT does not train (recompute must be 'none')",
    "sequence_parallel": "an FFT has no sequence dimension",
    "interleave": "an FFT is not pipelined (interleave must be 1)",
    "distributed_optimizer": "an FFT has no optimizer",
}


def candidates(model: FFTModel, knobs: Knobs):
    N, batch = model.N, model.workload.batch
    if knobs.tp is not None and knobs.dp is not None and knobs.tp * knobs.dp != N:
        raise InputError(f"tp x dp = {knobs.tp * knobs.dp} but the system has {N} chips (FFT: tp = chips per "
                         "transform, dp = groups sharing the batch)", field="tp/dp")
    for name in ("tp", "dp"):
        v = getattr(knobs, name)
        if v is not None and N % v:
            raise InputError(f"must divide the {N} chips, got {v}", field=name)
    if knobs.dp is not None and knobs.dp > batch:
        raise InputError(f"the {batch} transforms of the batch cannot feed {knobs.dp} groups", field="dp")
    found = False
    bad_mb = []
    for dp in divisors(N):
        G = N // dp
        if dp > batch or (knobs.dp is not None and dp != knobs.dp) or (knobs.tp is not None and G != knobs.tp):
            continue
        per_group = math.ceil(batch / dp)
        mb = knobs.micro_batch or per_group
        if per_group % mb:
            bad_mb.append(per_group)
            continue
        for dec, p1, p2 in model.grids(G):
            degrees = {"P1": p1, "P2": p2, "dp": dp} if dec == "pencil" else {"P": p1, "dp": dp}
            for lay in split_dims(model.system, degrees):
                found = True
                yield FFTMapping(dp, dec, p1, p2, mb, per_group // mb, tuple((k, lay[k]) for k in degrees))
    if not found and bad_mb:
        raise InputError(f"must divide the transforms each group runs (ceil(batch / dp): "
                         f"{', '.join(map(str, sorted(set(bad_mb))))}), got {knobs.micro_batch}", field="micro_batch")
    if not found:
        raise InfeasibleError(f"fft: no decomposition of {model.dims} over {N} chips fits the network "
                              f"(a transform splits over at most min(dims) chips per axis; batch {batch})")


def solve_fft(workload, system: System, knobs: Knobs, *, solver: str = "auto", time_limit_s: float | None = None,
              exhaustive: bool = False):
    reject_knobs(knobs, "FFT", ("tp", "dp", "micro_batch"), _WHY)
    model = FFTModel(workload, system, solver=solver, time_limit_s=time_limit_s)
    best, stats = run_search(model, candidates(model, knobs), exhaustive=exhaustive)
    notes = []
    stated = workload.decomposition
    if len(model.dims) == 3 and best.mapping.decomposition != stated:
        same = [c for c in candidates(model, knobs) if c.decomposition == stated]
        if same:
            try:
                alt, _ = run_search(model, same, exhaustive=False, alternatives=0)
                notes.append(f"the workload says {stated}: its best ({model.describe(alt.mapping)}) takes "
                             f"{alt.iteration_time_s:.4g} s, {alt.iteration_time_s / best.iteration_time_s:.3f}x "
                             "the optimum")
            except InfeasibleError:
                notes.append(f"the workload says {stated}, but no {stated} mapping fits")
    return to_result(model, best, stats, notes)


def to_result(model: FFTModel, ev: FamilyEvaluation, stats, extra_notes: list[str]):
    m: FFTMapping = ev.mapping
    w, system = model.workload, model.system
    flop = build_graphs(w, batch=1).layer.total_flop() * w.batch
    t = ev.iteration_time_s
    notes = [
        f"FFT: {model.describe(m)} ({m.tp} chips per transform, {m.dp} groups share the batch of {w.batch}; "
        f"{m.num_micro_batches} chunk(s) of {m.micro_batch} transform(s) per group); "
        f"{flop / t / 1e9:,.0f} Gflop/s nominal (5 N log2 N)",
        "breakdown: transposes (all-to-all) -> tp_comm when they dominate; local FFT stages -> memory or compute",
        f"memory: local data {ev.detail['local_bytes'] / 2**30:.2f} GiB per chip + a transpose buffer of the same size",
        "samples_per_s = tokens_per_s = transforms per second (batch / iteration)",
        "the workload's decomposition is read as a preference: pencil and slab are both searched",
    ] + extra_notes
    g = model.base(m.decomposition, m.micro_batch)[0]
    sharding = {}
    for k in g.kernels:
        if k.kind == KernelKind.comm:
            grp = model.comm_group(m, k.comm_group or "all")
            sharding[k.name] = f"all-to-all over {' x '.join(f'{d}:{n}' for d, n in grp) or 'one chip'}"
        else:
            sharding[k.name] = f"local ({m.decomposition}, 1/{m.tp} of the points per chip)"
    par = Parallelism(tp=m.tp, pp=1, dp=m.dp, micro_batch=m.micro_batch, num_micro_batches=m.num_micro_batches,
                      dims=m.dims_report())
    return build_result(workload=w, system=system, ev=ev, stats=stats, useful_flop=flop, samples=w.batch,
                        parallelism=par, sharding=sharding, intra_per="chunk of micro_batch transforms",
                        notes=notes, pipeline={"decomposition": m.decomposition, "grid": [m.p1, m.p2],
                                               "transpose_s": ev.detail["network_s"]})


class FFTFamily(ModelFamily):
    """``kind: fft`` behind the common family interface (:mod:`dfmodel.inter_chip.family_api`)."""

    kind = "fft"
    model_class = FFTModel
    candidates_fn = staticmethod(candidates)
    result_fn = staticmethod(lambda model, best, stats: to_result(model, best, stats, []))
    solve_fn = staticmethod(solve_fft)
