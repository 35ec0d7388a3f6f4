"""DLRM graphs (Naumov et al. 2019, arXiv:1906.00091): embedding look-ups, an all-to-all, bottom
MLP, dot interaction, top MLP and loss, with backward and weight-gradient kernels.

Notation: B samples, t tables, d embedding dim, L_i look-ups (pooling factor) and R_i rows of
table i, F = t + 1 interacting feature vectors (t pooled embeddings and the bottom MLP output).

- Embedding look-ups are memory bound: ``extra_memory_bytes = B * sum(L_i) * d * p`` (the rows
  gathered), ``params = sum(R_i) * d``, and ``weight_bytes = 0`` because the tables live in
  DRAM and only the gathered rows are read, never the whole table.
- ``fwd.emb_a2a`` is the all-to-all that turns table-sharded pooled embeddings into
  sample-sharded ones (``comm_group="embedding"``); it costs nothing when the tables are not
  sharded (the inter-chip pass decides). The backward sends the gradients back the same way.
- The dot interaction is one batched matmul ``Z = X X^T`` (b = B, m = n = F, k = d); the top MLP
  reads the bottom output concatenated with the ``F(F-1)/2`` distinct pairwise products.
- The embedding backward is a sparse gradient scatter (``wgrad.emb``): memory bound,
  read-modify-write of every touched row.

Parameters: ``sum(R_i) d + sum over MLP layers (k n + n)``.
"""

from __future__ import annotations

from dfmodel.graph.builders.base import GraphBuilder
from dfmodel.graph.builders.formulas import INDEX_BYTES, LOSS_BYTES, matmul_flop, vector_flop
from dfmodel.graph.builders.llm import linear_params
from dfmodel.graph.graph import DataflowGraph
from dfmodel.graph.kernel import KernelKind, Phase
from dfmodel.graph.workload import DLRMWorkload

MM, EW, RED, EMB, COMM = (KernelKind.matmul, KernelKind.elementwise, KernelKind.reduction,
                          KernelKind.embedding, KernelKind.comm)
FWD, BWD, WG = Phase.forward, Phase.backward, Phase.weight_grad


def top_mlp_input(num_tables: int, dim: int) -> int:
    """Width of the top MLP's input: bottom output (d) + distinct pairs of F = t+1 vectors."""
    f = num_tables + 1
    return dim + f * (f - 1) // 2


def dlrm_params(w: DLRMWorkload) -> int:
    """Trainable parameters: embedding tables plus both MLPs (weights and biases).

    >>> from dfmodel.graph.workload import load_workload
    >>> w = load_workload({"kind": "dlrm", "name": "d", "embedding": {"num_tables": 2,
    ...     "rows_per_table": [10, 20], "dim": 4}, "dense_features": 3, "bottom_mlp": [4],
    ...     "top_mlp": [1], "training": {"global_batch": 16}})
    >>> dlrm_params(w) == 30 * 4 + (3 * 4 + 4) + ((4 + 3) * 1 + 1)
    True
    """
    e = w.embedding
    total = sum(e.rows()) * e.dim
    for k, n in _layers(w.dense_features, w.bottom_mlp) + _layers(top_mlp_input(e.num_tables, e.dim), w.top_mlp):
        total += linear_params(k, n)
    return total


def _layers(width_in: int, widths: list[int]) -> list[tuple[int, int]]:
    ins = [width_in, *widths[:-1]]
    return list(zip(ins, widths))


def build_dlrm(w: DLRMWorkload, batch: int) -> DataflowGraph:
    """The whole DLRM training step for ``batch`` samples.

    >>> from dfmodel.graph.workload import load_workload
    >>> w = load_workload("dlrm")
    >>> g = build_dlrm(w, 1024)
    >>> g.params() == dlrm_params(w)
    True
    """
    e, p, B = w.embedding, w.precision.bytes, batch
    t, d = e.num_tables, e.dim
    F = t + 1
    looked_up = B * sum(e.lookups())  # rows gathered per iteration
    pooled = B * t * d  # elements of the pooled embeddings
    bottom = _layers(w.dense_features, w.bottom_mlp)
    top_in = top_mlp_input(t, d)
    top = _layers(top_in, w.top_mlp)
    g = GraphBuilder()

    # ---- forward ------------------------------------------------------------------------------
    g.kernel("fwd.emb", EMB, {"b": B, "t": t, "n": d}, flop=vector_flop("embedding_pool", looked_up * d),
             output_bytes=pooled * p, extra_memory_bytes=looked_up * d * p, params=sum(e.rows()) * d,
             group="embedding")
    g.kernel("fwd.emb_a2a", COMM, {"b": B, "t": t, "n": d}, flop=0, output_bytes=pooled * p,
             collective="all_to_all", comm_bytes=pooled * p, comm_group="embedding", group="embedding")
    for i, (k, n) in enumerate(bottom):
        _linear_fwd(g, f"bot{i}", B, k, n, p, "bottom_mlp", relu=True)
    g.kernel("fwd.interact", MM, {"b": B, "m": F, "n": F, "k": d}, flop=matmul_flop(B, F, F, d),
             output_bytes=B * top_in * p, group="interaction")
    for i, (k, n) in enumerate(top):
        _linear_fwd(g, f"top{i}", B, k, n, p, "top_mlp", relu=i < len(top) - 1)
    n_out = w.top_mlp[-1]
    g.kernel("fwd.loss", RED, {"m": B, "n": n_out}, flop=vector_flop("cross_entropy", B * n_out),
             output_bytes=B * LOSS_BYTES, group="loss")

    # ---- backward -----------------------------------------------------------------------------
    g.kernel("bwd.loss", EW, {"m": B, "n": n_out}, flop=vector_flop("cross_entropy_bwd", B * n_out),
             output_bytes=B * n_out * p, phase=BWD, group="loss")
    for i in reversed(range(len(top))):
        k, n = top[i]
        _linear_bwd(g, f"top{i}", B, k, n, p, "top_mlp", relu=i < len(top) - 1, data_grad=True)
    g.kernel("bwd.interact", MM, {"b": B, "m": F, "n": d, "k": F}, flop=matmul_flop(B, F, d, F),
             output_bytes=B * F * d * p, phase=BWD, group="interaction")  # dX = (dZ + dZ^T) X
    g.kernel("bwd.emb_a2a", COMM, {"b": B, "t": t, "n": d}, flop=0, output_bytes=pooled * p, phase=BWD,
             collective="all_to_all", comm_bytes=pooled * p, comm_group="embedding", group="embedding")
    g.kernel("wgrad.emb", EMB, {"b": B, "t": t, "n": d}, flop=vector_flop("embedding_scatter", looked_up * d),
             output_bytes=looked_up * d * p, extra_memory_bytes=2 * looked_up * d * p, phase=WG,
             group="embedding")
    for i in reversed(range(len(bottom))):
        k, n = bottom[i]
        # the dense input needs no gradient: the first bottom layer has no data-gradient matmul
        _linear_bwd(g, f"bot{i}", B, k, n, p, "bottom_mlp", relu=True, data_grad=i > 0)

    # ---- tensors ------------------------------------------------------------------------------
    g.tensor("indices", None, ["fwd.emb", "wgrad.emb"], looked_up * INDEX_BYTES, "index")
    g.tensor("pooled", "fwd.emb", "fwd.emb_a2a", pooled * p, "x", (B, t, d))
    g.tensor("emb_out", "fwd.emb_a2a", ["fwd.interact", "bwd.interact"], pooled * p, ["a", "saved"], (B, t, d))
    g.tensor("dense", None, ["fwd.bot0", "wgrad.bot0"], B * w.dense_features * p, "a", (B, w.dense_features))
    for i, (k, n) in enumerate(bottom):
        src = f"fwd.bot{i}_relu"
        nxt = f"fwd.bot{i + 1}" if i + 1 < len(bottom) else "fwd.interact"
        saver = f"wgrad.bot{i + 1}" if i + 1 < len(bottom) else "bwd.interact"
        g.tensor(f"bot{i}_out", f"fwd.bot{i}", src, B * n * p, "x", (B, n))
        g.tensor(f"bot{i}_act", src, [nxt, f"bwd.bot{i}_relu", saver], B * n * p,
                 ["a", "saved", "saved" if saver == "bwd.interact" else "a"], (B, n))
    g.tensor("interact_out", "fwd.interact", ["fwd.top0", "wgrad.top0"], B * top_in * p, "a", (B, top_in))
    for i, (k, n) in enumerate(top):
        last = i == len(top) - 1
        if last:
            g.tensor("logits", f"fwd.top{i}", ["fwd.loss", "bwd.loss"], B * n * p, ["x", "saved"], (B, n))
        else:
            g.tensor(f"top{i}_out", f"fwd.top{i}", f"fwd.top{i}_relu", B * n * p, "x", (B, n))
            g.tensor(f"top{i}_act", f"fwd.top{i}_relu", [f"fwd.top{i + 1}", f"bwd.top{i}_relu", f"wgrad.top{i + 1}"],
                     B * n * p, ["a", "saved", "a"], (B, n))
    g.tensor("labels", None, ["fwd.loss", "bwd.loss"], B * LOSS_BYTES, "labels", (B,))
    g.tensor("loss", "fwd.loss", None, B * LOSS_BYTES, "x", (B,))

    # gradients flowing down the top MLP: bwd.loss -> (relu bwd) -> dgrad/wgrad per layer
    grad_src = "bwd.loss"
    for i in reversed(range(len(top))):
        k, n = top[i]
        relu = i < len(top) - 1
        if relu:
            g.tensor(f"d_top{i}_act", grad_src, f"bwd.top{i}_relu", B * n * p, "grad", (B, n))
            grad_src = f"bwd.top{i}_relu"
        g.tensor(f"d_top{i}_out", grad_src, [f"bwd.top{i}", f"wgrad.top{i}"], B * n * p, ["a", "b"], (B, n))
        g.tensor(f"dW.top{i}", f"wgrad.top{i}", None, linear_params(k, n) * p, "x")
        grad_src = f"bwd.top{i}"
    g.tensor("d_interact_out", grad_src, "bwd.interact", B * top_in * p, "grad", (B, top_in))
    g.tensor("d_emb_out", "bwd.interact", "bwd.emb_a2a", pooled * p, "grad", (B, t, d))
    g.tensor("d_pooled", "bwd.emb_a2a", "wgrad.emb", pooled * p, "grad", (B, t, d))
    g.tensor("dW.emb", "wgrad.emb", None, looked_up * d * p, "x")
    grad_src = "bwd.interact"
    for i in reversed(range(len(bottom))):
        k, n = bottom[i]
        g.tensor(f"d_bot{i}_act", grad_src, f"bwd.bot{i}_relu", B * n * p, "grad", (B, n))
        consumers = [f"bwd.bot{i}", f"wgrad.bot{i}"] if i > 0 else [f"wgrad.bot{i}"]
        g.tensor(f"d_bot{i}_out", f"bwd.bot{i}_relu", consumers, B * n * p, ["a", "b"] if i > 0 else "b", (B, n))
        g.tensor(f"dW.bot{i}", f"wgrad.bot{i}", None, linear_params(k, n) * p, "x")
        grad_src = f"bwd.bot{i}"

    meta = {"family": "dlrm", "workload": w.name, "batch": B, "num_tables": t, "embedding_dim": d,
            "lookups_per_sample": sum(e.lookups()), "top_mlp_input": top_in,
            "precision": w.precision.value, "bytes_per_element": p}
    return g.build(f"{w.name}.dlrm", meta)


def _linear_fwd(g: GraphBuilder, name: str, B: int, k: int, n: int, p: int, group: str, *, relu: bool) -> None:
    params = linear_params(k, n)
    g.kernel(f"fwd.{name}", MM, {"m": B, "n": n, "k": k}, flop=matmul_flop(1, B, n, k), output_bytes=B * n * p,
             params=params, weight_bytes=params * p, group=group)
    if relu:  # bias add + ReLU
        g.kernel(f"fwd.{name}_relu", EW, {"m": B, "n": n}, flop=vector_flop("bias", B * n) + vector_flop("relu", B * n),
                 output_bytes=B * n * p, group=group)


def _linear_bwd(g: GraphBuilder, name: str, B: int, k: int, n: int, p: int, group: str, *, relu: bool,
                data_grad: bool) -> None:
    params = linear_params(k, n)
    if relu:  # ReLU mask + bias gradient
        g.kernel(f"bwd.{name}_relu", EW, {"m": B, "n": n},
                 flop=vector_flop("relu_bwd", B * n) + vector_flop("bias_grad", B * n), output_bytes=B * n * p,
                 phase=BWD, group=group)
    if data_grad:
        g.kernel(f"bwd.{name}", MM, {"m": B, "n": k, "k": n}, flop=matmul_flop(1, B, k, n), output_bytes=B * k * p,
                 phase=BWD, weight_bytes=params * p, group=group)
    g.kernel(f"wgrad.{name}", MM, {"m": k, "n": n, "k": B}, flop=matmul_flop(1, k, n, B), output_bytes=params * p,
             phase=WG, weight_bytes=params * p, group=group)
