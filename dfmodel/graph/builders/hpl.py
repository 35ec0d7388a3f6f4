"""HPL graphs: right-looking blocked LU with partial pivoting, then the triangular solves.

Step j (j = 0 .. ceil(n/nb)-1) works on the r x r trailing matrix, r = n - j*nb, with panel
width w = min(nb, r):

- ``panel`` (lu_panel): factorise the r x w panel (:func:`~.formulas.lu_panel_flop`);
- ``bcast`` (comm, broadcast, ``comm_group="row"``): the L panel (r x w) goes to the process row;
- ``swap`` (comm, all_to_all, ``comm_group="col"``): pivot rows of U (w x (r-w)) are exchanged
  within the process column (HPL's spread-roll / binary-exchange swap, an all-to-all pattern);
- ``update`` (matmul): triangular solve of U12 and the trailing update A22 -= L21 U12.

N/NB can be ~10^5 steps, so consecutive steps are grouped into at most ``max_steps`` groups
of (nearly) equal step count. A group's kernels carry the exact sums of FLOP and bytes of the
steps they stand for; their dims are those of the group's middle step (representative sizes);
groups are chained in order. Byte counts are whole (unsharded) tensors: the mapping passes
divide them over the P x Q grid. The total FLOP is exactly ``lu_flop(n) + 2n^2 - n``, i.e.
``2/3 n^3 + 3/2 n^2 - 7/6 n`` (HPL reports ``2/3 N^3 + 3/2 N^2``).
"""

from __future__ import annotations

from dfmodel.graph.builders.base import GraphBuilder
from dfmodel.graph.builders.formulas import INDEX_BYTES, lu_step_flop, triangular_solve_flop
from dfmodel.graph.graph import DataflowGraph
from dfmodel.graph.kernel import KernelKind
from dfmodel.graph.workload import HPLWorkload


def hpl_steps(n: int, nb: int) -> list[tuple[int, int]]:
    """(r, w) for every LU step: trailing order r and panel width w.

    >>> hpl_steps(10, 4)
    [(10, 4), (6, 4), (2, 2)]
    """
    return [(n - j, min(nb, n - j)) for j in range(0, n, nb)]


def hpl_groups(num_steps: int, max_groups: int) -> list[tuple[int, int]]:
    """Split ``num_steps`` consecutive steps into at most ``max_groups`` (first, count) groups.

    >>> hpl_groups(10, 4)
    [(0, 3), (3, 3), (6, 2), (8, 2)]
    """
    g = min(num_steps, max_groups)
    base, extra = divmod(num_steps, g)
    out, first = [], 0
    for i in range(g):
        count = base + (1 if i < extra else 0)
        out.append((first, count))
        first += count
    return out


def build_hpl(w: HPLWorkload) -> DataflowGraph:
    """The whole HPL run (one factorisation and solve) as a chain of step groups.

    >>> from dfmodel.graph.workload import load_workload
    >>> from dfmodel.graph.builders.formulas import lu_flop
    >>> w = load_workload({"kind": "hpl", "name": "h", "n": 1000, "nb": 64, "max_steps": 4})
    >>> g = build_hpl(w)
    >>> g.total_flop() == lu_flop(1000) + 2 * 1000**2 - 1000
    True
    """
    n, nb, p = w.n, w.nb, w.precision.bytes
    steps = hpl_steps(n, nb)
    groups = hpl_groups(len(steps), w.max_steps)
    width = len(str(len(groups) - 1))
    g = GraphBuilder()
    prev_name, prev_bytes, prev_producer = "A", n * n * p, None
    lu_total = 0
    for gi, (first, count) in enumerate(groups):
        members = steps[first : first + count]
        r, wd = steps[first + (count - 1) // 2]  # representative: the middle step
        panel_flop = update_flop = 0
        l_bytes = u_bytes = a_bytes = piv_bytes = 0
        for rr, ww in members:
            f_panel, f_trsm, f_gemm = lu_step_flop(rr, ww)
            panel_flop += f_panel
            update_flop += f_trsm + f_gemm
            l_bytes += rr * ww * p
            u_bytes += ww * (rr - ww) * p
            a_bytes += (rr - ww) ** 2 * p
            piv_bytes += ww * INDEX_BYTES
        lu_total += panel_flop + update_flop
        tag = f"g{gi:0{width}d}"
        panel = g.kernel(f"{tag}.panel", KernelKind.lu_panel, {"m": r, "n": wd}, flop=panel_flop,
                         output_bytes=l_bytes, group="panel")
        has_update = update_flop > 0  # only the final step alone has no trailing matrix
        consumers = [panel, f"{tag}.swap"] if has_update else [panel]
        g.tensor(prev_name, prev_producer, consumers, prev_bytes, "x")
        if not has_update:
            prev_name, prev_bytes, prev_producer = f"L{gi}", l_bytes, panel
            continue
        rest = max(1, r - wd)
        bcast = g.kernel(f"{tag}.bcast", KernelKind.comm, {"m": r, "n": wd}, flop=0, output_bytes=l_bytes,
                         collective="broadcast", comm_bytes=l_bytes, comm_group="row", group="panel")
        swap = g.kernel(f"{tag}.swap", KernelKind.comm, {"m": wd, "n": rest}, flop=0, output_bytes=u_bytes,
                        collective="all_to_all", comm_bytes=u_bytes, comm_group="col", group="update")
        update = g.kernel(f"{tag}.update", KernelKind.matmul, {"m": rest, "n": rest, "k": wd}, flop=update_flop,
                          output_bytes=a_bytes, group="update")
        g.tensor(f"L{gi}", panel, bcast, l_bytes, "x")
        g.tensor(f"piv{gi}", panel, swap, piv_bytes, "pivots")
        g.tensor(f"Lb{gi}", bcast, update, l_bytes, "a")
        g.tensor(f"U{gi}", swap, update, u_bytes, "b")
        prev_name, prev_bytes, prev_producer = f"A{gi + 1}", a_bytes, update
    # forward and back substitution with the LU factors (read from DRAM: extra_memory_bytes)
    g.kernel("solve", KernelKind.matmul, {"m": n, "n": 1, "k": n}, flop=triangular_solve_flop(n),
             output_bytes=n * p, extra_memory_bytes=n * n * p, group="solve")
    g.tensor(prev_name, prev_producer, "solve", prev_bytes, "x")
    g.tensor("rhs", None, "solve", n * p, "b")
    g.tensor("x", "solve", None, n * p, "x")
    meta = {"family": "hpl", "workload": w.name, "batch": 1, "n": n, "nb": nb, "p": w.p, "q": w.q,
            "steps": len(steps), "groups": [list(x) for x in groups], "comm_groups": {"row": w.q, "col": w.p},
            "lu_flop_exact": lu_total, "precision": w.precision.value, "bytes_per_element": p}
    return g.build(f"{w.name}.hpl", meta)
