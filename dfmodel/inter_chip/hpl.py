"""HPL on many chips: a ``P x Q`` process grid, every factorisation ``P * Q = N`` and placement.

The matrix is distributed 2-D block-cyclically (``nb x nb`` blocks) over the grid (Petitet et
al., HPL 2.x: ``HPL_pdgesv``; Dongarra, Luszczek, Petitet 2003, "The LINPACK benchmark: past,
present and future", sec. 4). The N/NB steps are the builder's step groups
(:func:`~dfmodel.graph.builders.hpl.hpl_groups`); a group's FLOP and bytes are the exact sums
over its steps. Per group, one chip does:

- ``panel`` (on the ``P`` chips of the owning process column): ``lu_panel`` FLOP / ``P``, reading
  and writing its ``r/P x w`` rows of the panel; its network time is the pivot search, one
  all-reduce per column over the ``P`` group of HPL_pdmxswp's ``(2 w + 4)`` doubles;
- ``bcast``: the local panel ``r w / P`` bytes broadcast along the process row (``Q`` group);
- ``swap``: the pivot rows of U, ``w (r - w) / Q`` bytes per chip, exchanged over the process
  column (``P`` group) with the builder's collective (all-to-all: HPL's spread-roll);
- ``update``: the triangular solve and trailing update, ``FLOP / (P Q)`` at the matrix peak, the
  dims ``(r-w)/P x (r-w)/Q x w`` (padding), reading and writing the local trailing matrix.

Then ``solve`` (forward and back substitution): ``FLOP / (P Q)``, reading the local factors
(its own communication, ``n / nb`` small broadcasts, is not modelled). Collective costs of a
group are ``steps x cost(mean per-step message)`` from the system's cost table (each algorithm
is affine in the size, so this overestimates by at most the gap between algorithms).

The per-chip graph chains the groups by small completion tokens (the matrix itself stays in
place: it is counted as memory, not as a tensor). The intra-chip pass prices every kernel; on
kernel-by-kernel chips (one kernel per partition) the schedule is HPL's look-ahead of depth 1
(HPL.dat ``DEPTH = 1``): the factorisation and broadcast of the next panel run concurrently with
the trailing update of the current one (on a separate stream or the host, as NVIDIA's and AMD's
GPU ports of HPL do), while the row swap must precede the update:
``T_group = swap + max(update + panel_work, panel + bcast)`` (``panel_work``: the panel's own
compute/memory time, which shares the GPU with the update, see :func:`panel_chip_s`), plus the very first panel and broadcast, which
nothing hides, and the solve. On dataflow chips the fused partitions already overlap their
terms; the run is the sum of partition times.

Memory per chip: the local block-cyclic matrix (``ceil(ceil(n/nb)/P) nb x ceil(ceil(n/nb)/Q) nb``
elements) as ``weights``, and work buffers (two local panels for the look-ahead, one U block)
as ``activations``. Useful FLOP: HPL's own count ``2/3 n^3 + 3/2 n^2`` (HPL_pdtest), reported as
Gflop/s in the notes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dfmodel.errors import InfeasibleError
from dfmodel.graph.build import build_graphs
from dfmodel.graph.builders.hpl import hpl_groups, hpl_steps
from dfmodel.graph.graph import DataflowGraph
from dfmodel.graph.kernel import Kernel, KernelKind, Tensor
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
    reject_knobs,
    run_search,
)
from dfmodel.netmodels import split_dims
from dfmodel.result import Parallelism
from dfmodel.system.schema import System

#: Bytes of the completion token chaining step groups in the per-chip graph.
TOKEN_BYTES = 8.0
#: Look-ahead depth of the modelled schedule (HPL.dat's DEPTH).
LOOKAHEAD = 1


def hpl_useful_flop(n: int) -> float:
    """HPL's reported operation count ``2/3 n^3 + 3/2 n^2`` (HPL_pdtest).

    >>> round(hpl_useful_flop(3000) / 1e9, 4)
    18.0135
    """
    return 2.0 / 3.0 * n**3 + 1.5 * n**2


def pivot_message_bytes(width: int, bytes_per_element: int) -> float:
    """HPL_pdmxswp's all-reduce buffer per panel column: ``2 w + 4`` elements (the max, its
    index and the candidate pivot row) in the matrix precision."""
    return (2 * width + 4) * bytes_per_element


@dataclass(frozen=True, order=True)
class HPLMapping(Placed):
    P: int
    Q: int
    placement: tuple = ()



@dataclass
class GroupInfo:
    """One step group of the builder's graph: its kernels' names and exact sums."""

    tag: str
    steps: int
    columns: int
    width: int  # representative panel width (the middle step's)
    rows: int  # representative trailing order r
    panel_flop: float
    update_flop: float
    l_bytes: float  # sum over steps of r w p
    u_bytes: float  # sum over steps of w (r - w) p
    a_bytes: float  # sum over steps of (r - w)^2 p


class HPLModel(FamilyModel):
    family = "hpl"

    def __init__(self, workload, system: System, **options):
        super().__init__(workload, system, **options)
        self.p = self.precision.bytes
        self.n, self.nb = workload.n, workload.nb
        self.N = system.num_chips
        self.capacity = float(system.chip.memory.usable_bytes)  # capacity minus the reserve
        self.graph = build_graphs(workload).layer
        self.groups = self._groups()
        solve = next(k for k in self.graph.kernels if k.kind == KernelKind.matmul and k.name == "solve")
        self.solve_flop, self.solve_bytes = solve.flop, solve.extra_memory_bytes
        self._chip: dict[HPLMapping, object] = {}

    def _groups(self) -> list[GroupInfo]:
        """Group sums read from the builder's graph (FLOP exactly as the builder counts them)."""
        steps = hpl_steps(self.n, self.nb)
        spans = hpl_groups(len(steps), self.workload.max_steps)
        panels = [k for k in self.graph.kernels if k.kind == KernelKind.lu_panel]
        out = []
        for k, (first, count) in zip(panels, spans):
            tag = k.name.rsplit(".", 1)[0]
            members = steps[first:first + count]
            upd = f"{tag}.update"
            update_flop = self.graph.kernel(upd).flop if upd in self.graph.nx else 0.0
            p = self.p
            out.append(GroupInfo(
                tag=tag, steps=count, columns=sum(w for _, w in members), width=k.dims["n"], rows=k.dims["m"],
                panel_flop=k.flop, update_flop=update_flop,
                l_bytes=sum(r * w * p for r, w in members), u_bytes=sum(w * (r - w) * p for r, w in members),
                a_bytes=sum((r - w) ** 2 * p for r, w in members),
            ))
        return out

    # -- memory -------------------------------------------------------------------------------
    def local_dims(self, m: HPLMapping) -> tuple[int, int]:
        """Rows and columns of the largest local block-cyclic piece of the matrix."""
        blocks = math.ceil(self.n / self.nb)
        return min(self.n, math.ceil(blocks / m.P) * self.nb), min(self.n, math.ceil(blocks / m.Q) * self.nb)

    def memory(self, m: HPLMapping) -> FamilyMemory:
        rows, cols = self.local_dims(m)
        matrix = rows * cols * self.p
        buffers = ((1 + LOOKAHEAD) * rows * self.nb + self.nb * cols) * self.p
        return FamilyMemory(matrix, 0.0, 0.0, buffers, self.capacity,
                            labels={"weights": "local matrix", "activations": "panel and U buffers"})

    def memory_floor_bytes(self, m: HPLMapping) -> float:
        return self.memory(m).total_bytes

    # -- the per-chip graph ---------------------------------------------------------------------
    def chip_graph(self, m: HPLMapping):
        """(kernels, tensors, network seconds) of one chip (see module doc)."""
        P, Q, p = m.P, m.Q, self.p
        colg, rowg = m.group("P"), m.group("Q")
        kernels, tensors, net = [], [], {}
        prev = None
        for gi in self.groups:
            t = gi.tag
            # Tensors between kernels carry one step's bytes (what is live in DRAM at a time: one
            # panel, one U block); the other steps' traffic is extra traffic of the producer and
            # the consumer, so the DRAM-capacity check sees the live buffers, not a group's sum.
            l_all, l_step = gi.l_bytes / P, gi.l_bytes / P / gi.steps
            u_all, u_step = gi.u_bytes / Q, gi.u_bytes / Q / gi.steps
            panel = Kernel(f"{t}.panel", KernelKind.lu_panel, {"m": max(1, math.ceil(gi.rows / P)), "n": gi.width},
                           flop=gi.panel_flop / P, output_bytes=l_step,
                           extra_memory_bytes=l_all + (l_all - l_step), group="panel")
            kernels.append(panel)
            if colg:
                net[panel.name] = gi.columns * self.costs.time_s("all_reduce", pivot_message_bytes(gi.width, p), colg)
            if prev is not None:
                tensors.append(Tensor(f"{prev}.done>{t}.panel", prev, panel.name, TOKEN_BYTES))
            if gi.update_flop <= 0:  # the last step alone: nothing to its right
                prev = panel.name
                continue
            bcast = Kernel(f"{t}.bcast", KernelKind.comm, {"m": max(1, math.ceil(gi.rows / P)), "n": gi.width}, flop=0,
                           output_bytes=l_step, extra_memory_bytes=2 * (l_all - l_step), collective="broadcast",
                           comm_bytes=l_all, comm_group="Q", group="panel")
            rest = max(1, gi.rows - gi.width)
            swap = Kernel(f"{t}.swap", KernelKind.comm, {"m": gi.width, "n": max(1, math.ceil(rest / Q))}, flop=0,
                          output_bytes=u_step, extra_memory_bytes=u_all + (u_all - u_step), collective="all_to_all",
                          comm_bytes=u_all, comm_group="P", group="update")
            update = Kernel(f"{t}.update", KernelKind.matmul,
                            {"m": max(1, math.ceil(rest / P)), "n": max(1, math.ceil(rest / Q)), "k": gi.width},
                            flop=gi.update_flop / (P * Q), output_bytes=gi.a_bytes / (P * Q),
                            extra_memory_bytes=2 * gi.a_bytes / (P * Q) + (l_all - l_step) + (u_all - u_step),
                            group="update")
            kernels += [bcast, swap, update]
            if rowg:
                net[bcast.name] = gi.steps * self.costs.time_s("broadcast", gi.l_bytes / P / gi.steps, rowg)
            if colg:
                net[swap.name] = gi.steps * self.costs.time_s("all_to_all", gi.u_bytes / Q / gi.steps, colg)
            if prev is not None:
                tensors.append(Tensor(f"{prev}.done>{t}.swap", prev, swap.name, TOKEN_BYTES))
            tensors += [
                Tensor(f"{t}.L", panel.name, bcast.name, l_step),
                Tensor(f"{t}.piv", panel.name, swap.name, gi.columns * 4.0, "pivots"),
                Tensor(f"{t}.Lb", bcast.name, update.name, l_step, "a"),
                Tensor(f"{t}.U", swap.name, update.name, u_step, "b"),
            ]
            prev = update.name
        solve = Kernel("solve", KernelKind.matmul, {"m": max(1, math.ceil(self.n / P)), "n": 1, "k": self.n},
                       flop=self.solve_flop / (P * Q), output_bytes=self.n * p / P,
                       extra_memory_bytes=self.solve_bytes / (P * Q), group="solve")
        kernels.append(solve)
        tensors += [Tensor(f"{prev}.done>solve", prev, "solve", TOKEN_BYTES),
                    Tensor("rhs", None, "solve", max(1.0, self.n * p / P), "b"),
                    Tensor("x", "solve", None, max(1.0, self.n * p / P))]
        return kernels, tensors, net

    # -- search interface ---------------------------------------------------------------------
    def lower_bound_s(self, m: HPLMapping) -> float:
        """Every group takes at least its update; the solve follows: their kernel floors."""
        kernels, _, _ = self.chip_graph(m)
        sel = [k for k in kernels if k.kind == KernelKind.matmul]
        return floor_terms(sel, self.system, self.precision, {}).bound_s(self.system)

    def refined_bound_s(self, m: HPLMapping) -> float | None:
        return None

    def evaluate(self, m: HPLMapping) -> FamilyEvaluation:
        mem = self.memory(m)
        if not mem.fits:
            return self.misfit(m, f"{m.P} x {m.Q} grid: {mem.summary()}", mem)
        kernels, tensors, net = self.chip_graph(m)
        graph = DataflowGraph(kernels, tensors, name=f"{self.workload.name}.hpl.chip",
                              meta={**self.graph.meta, "P": m.P, "Q": m.Q})
        try:
            ct = chip_time(graph, self.system, net, solver=self.solver, time_limit_s=self.time_limit_s)
        except InfeasibleError as e:
            return self.misfit(m, f"{m.P} x {m.Q} grid: intra-chip: {e}", mem, math.inf)
        br = empty_breakdown()
        per_group = []
        if ct.single_kernel:
            total = 0.0
            for i, gi in enumerate(self.groups):
                t_p, d_p = ct.kernel_time(f"{gi.tag}.panel")
                if gi.update_flop <= 0:
                    total += t_p
                    br[d_p] += t_p
                    per_group.append(t_p)
                    continue
                t_b, d_b = ct.kernel_time(f"{gi.tag}.bcast")
                t_s, d_s = ct.kernel_time(f"{gi.tag}.swap")
                t_u, d_u = ct.kernel_time(f"{gi.tag}.update")
                t_u += panel_chip_s(ct, f"{gi.tag}.panel", self.system.chip.overlap)
                g_time = t_s + max(t_u, t_p + t_b)
                br[d_s] += t_s
                if t_u >= t_p + t_b:
                    br[d_u] += t_u
                else:
                    br[d_p] += t_p
                    br[d_b] += t_b
                if i == 0:  # the very first panel and broadcast have no update to hide behind
                    first = (t_p + t_b) / gi.steps
                    g_time += first
                    br[d_p] += t_p / gi.steps
                    br[d_b] += t_b / gi.steps
                total += g_time
                per_group.append(g_time)
            t_solve, d_solve = ct.kernel_time("solve")
            total += t_solve
            br[d_solve] += t_solve
            schedule = f"look-ahead depth {LOOKAHEAD}"
        else:
            total = ct.time_s
            for k, v in ct.parts_s.items():
                br[k] += v
            schedule = "fused partitions (no extra look-ahead)"
        detail = {"per_group_s": per_group, "schedule": schedule, "network_s": sum(net.values())}
        return FamilyEvaluation(m, total, br, mem, True, ct.proven_optimal, ct, detail)


def panel_chip_s(ct, name: str, overlap: bool) -> float:
    """The chip time the look-ahead cannot hide of a panel factorisation: its compute and memory
    work (their ``max`` on chips that overlap the two, else their sum). The next panel runs on
    its own stream beside the trailing update, but on the same GPU: they share its SMs and HBM,
    so the look-ahead hides the panel's pivot all-reduce latency and the broadcast, not the
    panel's arithmetic (NVIDIA's HPL factors panels on the GPU; only work on another device or
    the network overlaps for free)."""
    row = ct._by_kernel()[name]
    return float(max(row["compute_s"], row["memory_s"]) if overlap else row["compute_s"] + row["memory_s"])


_WHY = {
    "tp": "HPL's parallelism is its P x Q process grid, searched over every P * Q = N (no tp knob)",
    "dp": "HPL is one factorisation (no data parallelism)",
    "pp": "HPL is not pipelined (pp must be 1)",
    "micro_batch": "HPL has no batch",
    "recompute": "HPL does not train (recompute must be 'none')",
    "sequence_parallel": "HPL has no sequence dimension",
    "interleave": "HPL is not pipelined (interleave must be 1)",
    "distributed_optimizer": "HPL has no optimizer",
}


def candidates(model: HPLModel, knobs: Knobs):
    for P in divisors(model.N):
        Q = model.N // P
        for lay in split_dims(model.system, {"P": P, "Q": Q}):
            yield HPLMapping(P, Q, (("P", lay["P"]), ("Q", lay["Q"])))


def solve_hpl(workload, system: System, knobs: Knobs, *, solver: str = "auto", time_limit_s: float | None = None,
              exhaustive: bool = False):
    reject_knobs(knobs, "HPL", (), _WHY)
    model = HPLModel(workload, system, solver=solver, time_limit_s=time_limit_s)
    best, stats = run_search(model, candidates(model, knobs), exhaustive=exhaustive)
    return to_result(model, best, stats)


def to_result(model: HPLModel, ev: FamilyEvaluation, stats):
    m: HPLMapping = ev.mapping
    w, system = model.workload, model.system
    flop = hpl_useful_flop(model.n)
    t = ev.iteration_time_s
    rows, cols = model.local_dims(m)
    notes = [
        f"HPL: {m.P} x {m.Q} process grid (P x Q = {model.N}), {ev.detail['schedule']}; "
        f"{flop / t / 1e9:,.0f} Gflop/s ({flop / t / 1e9 / model.N:,.1f} per chip) for n = {model.n}, nb = {model.nb}",
        "breakdown: panel broadcast, pivot all-reduces and row swaps -> tp_comm (when they dominate); the "
        "trailing update and solve -> compute or memory",
        f"memory: local matrix {rows} x {cols} as weights, look-ahead panel and U buffers as activations",
        "samples_per_s = tokens_per_s = runs per second (1 / iteration)",
        f"{len(model.groups)} step groups of {model.groups[0].steps} steps (workload max_steps); collectives "
        "priced per step at the group's mean message",
    ]
    wp, wq = w.p, w.q
    if wp * wq == model.N and (wp, wq) != (m.P, m.Q):
        other = [HPLMapping(wp, wq, (("P", lay["P"]), ("Q", lay["Q"])))
                 for lay in split_dims(system, {"P": wp, "Q": wq})]
        evs = [model.evaluate(x) for x in other]
        fit = [e for e in evs if e.fits]
        if fit:
            best = min(fit, key=lambda e: e.iteration_time_s)
            notes.append(f"the workload's {wp} x {wq} grid would take {best.iteration_time_s:.4g} s "
                         f"({best.iteration_time_s / t:.3f}x the optimum)")
    elif wp * wq != model.N:
        notes.append(f"the workload's {wp} x {wq} grid does not match {model.N} chips; the grid is searched")
    sharding = {
        "panel": f"column of {m.P} chips, block-cyclic rows (nb = {model.nb})",
        "bcast": f"broadcast along process rows ({m.Q} chips)",
        "swap": f"row swap over process columns ({m.P} chips)",
        "update": f"2-D block-cyclic over {m.P} x {m.Q}",
        "solve": f"2-D block-cyclic over {m.P} x {m.Q}",
    }
    par = Parallelism(tp=model.N, pp=1, dp=1, micro_batch=1, num_micro_batches=1, dims=m.dims_report())
    return build_result(workload=w, system=system, ev=ev, stats=stats, useful_flop=flop, samples=1.0,
                        parallelism=par, sharding=sharding, intra_per="run", notes=notes,
                        pipeline={"grid": [m.P, m.Q], "per_group_s": ev.detail["per_group_s"],
                                  "schedule": ev.detail["schedule"]})


class HPLFamily(ModelFamily):
    """``kind: hpl`` behind the common family interface (:mod:`dfmodel.inter_chip.family_api`)."""

    kind = "hpl"
    model_class = HPLModel
    candidates_fn = staticmethod(candidates)
    result_fn = staticmethod(to_result)
    solve_fn = staticmethod(solve_hpl)
