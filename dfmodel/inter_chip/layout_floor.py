"""The unsharded graph of a block scaled to the least share of it one chip of a TP group can
hold under any Megatron layout (search bounds on dataflow chips, issue 12).

:mod:`.dataflow_floor` and :mod:`.fused_floor` bound a sharded phase by the unsharded one
divided by the TP degree ``tp``: every kernel's FLOP, every tensor and weight at ``1 / tp``
(``strategies.local_fraction`` is never below it). Megatron's layouts split less than that:
without sequence parallelism the norms, residual adds and the tensors between blocks stay
replicated on every member (Korthikanti et al. 2022, sec. 4.2.2: "the layer-norm and dropout
... are replicated across the tensor-parallel group"), and a column-parallel GEMM reads its
whole input. On the 4-tile dragonfly chip, whose partitions spill nearly every tensor to
DRAM, the ``1 / tp`` floor was 1.5-6x below the solved passes (Llama-3 70B on 512 chips, the
evaluated candidates' median 2.5x without SP).

This module takes, per item, the least share over the strategies the sharding pass may pick
(``ShardingProblem`` with ``megatron_layouts=True``, as ``LLMModel._solve_block`` shards):

- a kernel's FLOP and extra bytes: ``1 / tp`` when some option of its weight group splits the
  work, else 1 (``sharding._scaled_kernel``);
- a weight: ``1 / tp`` when some option splits it, else 1;
- a tensor ``u -> v``: in the sharded graph it is either one edge in the consumer's layout
  (no collective: ``local_fraction(dst)``), or the producer's layout up to a communication
  kernel and the consumer's after it (``sharding._sharded_graph``); a partition boundary it
  crosses in the unsharded plan is crossed by one of those pieces, so at least the least of
  ``local_fraction(src)``, ``local_fraction(dst)`` over every (producer option, consumer
  option) pair with a valid conversion (graph inputs and outputs: the boundary layouts,
  ``ShardingProblem.output_layouts``). The edges of one tensor name and producer take the
  least over them (the cost model reads one size per name and producer).

Every share is >= ``1 / tp``, so the floors built on this graph (with ``tp = 1``) are never
below the old ones, and each stays a lower bound: the arguments of :mod:`.dataflow_floor` and
:mod:`.fused_floor` hold item by item with the share in place of ``1 / tp``.
tests/test_layout_floor.py checks the shares against every plan of small graphs and the floors
below every solved phase of the shipped dense layers on the dragonfly chip.
"""

from __future__ import annotations

import dataclasses

from dfmodel.graph.graph import DataflowGraph
from dfmodel.inter_chip.sharding import ShardingProblem, TPGroup
from dfmodel.inter_chip.strategies import conversion, local_fraction
from dfmodel.system.schema import System


def least_share_graph(graph: DataflowGraph, system: System, tp: int, sequence_parallel: bool) -> DataflowGraph:
    """``graph`` with every kernel's FLOP and extra bytes, weight and tensor scaled to the least
    share one member of a TP group of ``tp`` holds under any Megatron layout (module doc)."""
    if tp <= 1:
        return graph
    problem = ShardingProblem(graph, system, TPGroup(tp, ()), None, tokens_split=sequence_parallel,
                              megatron_layouts=True)
    work, weight = _kernel_shares(problem, tp)
    edge = {}
    for e in graph.tensors:
        key = (e.name, e.producer)
        edge[key] = min(edge.get(key, float("inf")), e.bytes * _edge_share(problem, e, tp))
    kernels = [dataclasses.replace(k, flop=k.flop * work[k.name], extra_memory_bytes=k.extra_memory_bytes * work[k.name],
                                   weight_bytes=k.weight_bytes * weight[k.name]) for k in graph.kernels]
    tensors = [dataclasses.replace(e, bytes=edge[(e.name, e.producer)]) for e in graph.tensors]
    return DataflowGraph(kernels, tensors, name=f"{graph.name}/least{tp}", meta=graph.meta, check=False)


def _kernel_shares(problem: ShardingProblem, tp: int) -> tuple[dict[str, float], dict[str, float]]:
    """Per kernel: the least share of its work and of its weight over its group's options."""
    work, weight = {}, {}
    for g, ks in problem.groups.items():
        opts = [problem.strategy(k, name) for k in ks for name in problem.options[g]]
        w = 1.0 / tp if any(s.splits_work for s in opts) else 1.0
        p = 1.0 / tp if any(s.splits_weight for s in opts) else 1.0
        for k in ks:
            work[k.name], weight[k.name] = w, p
    return work, weight


def _edge_share(problem: ShardingProblem, e, tp: int) -> float:
    """Least share of edge ``e`` any sharded plan holds on one chip (module doc)."""
    def names(kernel_name):
        return problem.options[problem.group_of[kernel_name]] if kernel_name is not None else [None]

    best = float("inf")
    for r in names(e.producer):
        for q in names(e.consumer):
            for boundary in problem.boundaries:
                src, dst = problem.edge_layouts(e, r, q, boundary)
                conv = conversion(src, dst, e.bytes, tp)
                if conv is None:
                    continue
                share = local_fraction(dst, tp)
                if conv.collective is not None:
                    share = min(share, local_fraction(src, tp))
                best = min(best, share)
    return best if best < float("inf") else 1.0 / tp


__all__ = ["least_share_graph"]
