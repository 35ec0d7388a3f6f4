"""Non-LLM families (DLRM, HPL, FFT): one entry point, :func:`solve_family`, and what they share.

Every family follows the LLM path (DESIGN.md section 2): enumerate the family's own parallel
configurations and their placements on the network (:func:`dfmodel.netmodels.split_dims`),
price each with a cheap valid lower bound, visit them best-bound-first with
:func:`dfmodel.inter_chip.search.search`, and evaluate a candidate by building the graph one chip
runs (the builder's graph rescaled to that chip's share), costing its collectives with the
system's :class:`~dfmodel.netmodels.CostTable`, running the intra-chip pass
(:func:`dfmodel.intra_chip.partition`) on it, composing the family's schedule and checking memory.

Families and their parallelism (details in each module):

- DLRM (:mod:`.dlrm`): embedding tables sharded over a group of ``tp`` chips (table-, row-,
  column-wise, replicated, and size-ordered hybrids), replicated over ``dp = N / tp`` such
  groups; the dense MLPs are data-parallel over all ``N`` chips;
- HPL (:mod:`.hpl`): a ``P x Q`` process grid (``P * Q = N``), every factorisation and placement;
- FFT (:mod:`.fft`): pencil (``P1 x P2``) or slab (``P``) decomposition of each transform over
  ``N / dp`` chips, ``dp`` groups sharing the batch of transforms.

Result conventions for these families (the JSON keys are the LLM ones):

- ``iteration_time_s``: DLRM one training step of the global batch; HPL the whole run
  (factorisation and solve); FFT the whole batch of transforms;
- ``samples_per_s``: DLRM samples/s; HPL runs/s (``1 / iteration``); FFT transforms/s
  (``batch / iteration``, i.e. ``1 / iteration`` per transform of a batch of one);
  ``tokens_per_s`` equals ``samples_per_s`` (these families have no tokens);
- ``model_flops_utilization``: the family's useful FLOP / (time x chips x matrix peak at the
  workload precision); ``hardware_flops_utilization`` is the same number (no recompute, no
  redundant FLOP counted);
- ``breakdown_s``: the eight LLM keys; each family says in ``notes`` which of its collectives
  it books under ``tp_comm`` (model-parallel communication inside the step) and ``dp_comm``;
- ``memory_per_chip_bytes``: ``weights, gradients, optimizer, activations, total, capacity`` (HPL
  books the local matrix as ``weights`` and its panel buffers as ``activations``; FFT its local
  data and transpose buffer as ``activations``).
"""

from __future__ import annotations

from dfmodel.errors import InputError
from dfmodel.inter_chip.config import Knobs
from dfmodel.inter_chip.family_base import *  # noqa: F401,F403 -- the shared machinery, re-exported
from dfmodel.inter_chip.family_base import FamilyEvaluation, FamilyMemory, ChipTime, chip_time, floor_terms, FloorTerms
from dfmodel.result import Result
from dfmodel.system.schema import System


def solve_family(workload, system: System, knobs: Knobs | None = None, *, solver: str = "auto",
                 time_limit_s: float | None = None, exhaustive: bool = False) -> Result:
    """Fastest mapping of a DLRM, HPL, FFT or graph workload on ``system`` (see the module doc).

    ``exhaustive=True`` evaluates every candidate (the oracle the tests compare the pruned
    search against). Raises InputError for knobs that mean nothing for the family and
    InfeasibleError (what does not fit, by how much) when no mapping fits.
    """
    from dfmodel.inter_chip.registry import family_for

    kind = getattr(workload, "kind", None)
    if kind == "llm":
        raise InputError("no inter-chip model for workload kind 'llm' here (families: dlrm, hpl, fft, graph; llm has "
                         "its own path)", source=getattr(workload, "source", None), field="kind")
    family = family_for(kind, source=getattr(workload, "source", None))
    return family.solve(workload, system, knobs or Knobs(), solver=solver, time_limit_s=time_limit_s,
                        exhaustive=exhaustive)


__all__ = ["solve_family", "FamilyMemory", "FamilyEvaluation", "ChipTime", "chip_time", "floor_terms", "FloorTerms"]
