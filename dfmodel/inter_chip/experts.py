"""Mixture-of-experts terms of the LLM mapping: dense vs MoE layers per stage, the expert
data-parallel group, and the all-to-all overlap of Megatron-Core / DeepSeek's DualPipe.

Plain functions over numbers and groups (no model object), so :mod:`.llm` calls them as hooks
and the tests check them in closed form.
"""

from __future__ import annotations

from dfmodel.netmodels.nccl import H100_SMS

#: SMs DeepSeek-V3 gives the dispatch / combine kernels while they overlap computation:
#: "only 20 SMs are sufficient to fully utilize the bandwidths of IB and NVLink" (DeepSeek-AI
#: 2024, arXiv:2412.19437, sec. 3.2.2), of the H800's 132 SMs (same die as the H100 SXM5).
A2A_OVERLAP_SMS = 20


def a2a_sm_fraction(sms: int = H100_SMS, comm_sms: int = A2A_OVERLAP_SMS) -> float:
    """Fraction of the chip's compute the overlapped all-to-all kernels take away.

    >>> round(a2a_sm_fraction(), 4)
    0.1515
    """
    return comm_sms / sms


def overlapped_a2a_exposed_s(a2a_s: float, compute_s: float, sm_fraction: float) -> float:
    """Exposed time of ``a2a_s`` of all-to-alls run beside ``compute_s`` of another
    micro-batch's computation that loses ``sm_fraction`` of the chip while they run.

    While the communication kernels run (``a2a_s``) the computation proceeds at ``1 - f`` of
    its rate; so the pair takes ``c + f a`` when the computation outlasts the communication
    (``a (1 - f) <= c``) and ``a`` otherwise: ``max(a, c + f a)``. The exposed part, beyond the
    computation alone, is ``max(a - c, f a)``: what the computation cannot hide, or the SMs the
    communication took, whichever is larger. ``f = 0`` gives the textbook ``max(0, a - c)``.

    >>> overlapped_a2a_exposed_s(2.0, 10.0, 0.0), overlapped_a2a_exposed_s(12.0, 10.0, 0.0)
    (0.0, 2.0)
    >>> overlapped_a2a_exposed_s(2.0, 10.0, 0.25), overlapped_a2a_exposed_s(12.0, 10.0, 0.25)
    (0.5, 3.0)
    """
    if a2a_s <= 0.0:
        return 0.0
    if not 0.0 <= sm_fraction < 1.0:
        raise ValueError(f"sm_fraction must be in [0, 1), got {sm_fraction}")
    return max(a2a_s - compute_s, sm_fraction * a2a_s)


def a2a_overlap_applies(*, ep: int, num_micro_batches: int) -> bool:
    """Whether the overlap option can do anything: an ep group to exchange over and a second
    micro-batch whose computation hides the first's all-to-alls (Megatron-Core pairs the
    forward of micro-batch ``i + 1`` with the backward of ``i``; DualPipe pairs a forward and a
    backward chunk, sec. 3.2.1 of the DeepSeek-V3 report).

    >>> a2a_overlap_applies(ep=8, num_micro_batches=4), a2a_overlap_applies(ep=1, num_micro_batches=4)
    (True, False)
    """
    return ep > 1 and num_micro_batches >= 2


def dense_layers_per_stage(chunk_layers: "tuple[int, ...] | list[int]", pp: int, num_dense: int) -> list[int]:
    """How many of the first ``num_dense`` layers (an MoE model's dense layers) each physical
    pipeline stage holds, given the layers per (virtual) chunk in pipeline order: chunk ``j``
    runs on stage ``j mod pp`` (Megatron's interleaved placement) and takes the next layers of
    the chain, so the dense layers fill the first chunks.

    >>> dense_layers_per_stage([2, 2, 2, 2], 4, 3), dense_layers_per_stage([1, 1, 1, 1], 2, 3)
    ([2, 1, 0, 0], [2, 1])
    """
    out = [0] * pp
    left = num_dense
    for j, n in enumerate(chunk_layers):
        take = min(n, left)
        out[j % pp] += take
        left -= take
    return out


def complement_group(system, group, sub) -> tuple[tuple[str, int], ...]:
    """``group`` with the members of its sub-group ``sub`` factored out, per network dimension:
    Megatron-Core's expert data-parallel group (the dp x cp ranks that hold the same experts:
    ``dp x cp / ep`` of them with expert TP = TP) from the dp x cp group and the ep group
    carved out of it (``parallel_state.py``: ``expert_data_parallel_size = world / (etp x ep x
    pp)``).

    >>> from dfmodel.system import load_system
    >>> s = load_system({"name": "t", "chip": {"name": "c", "peak_flops": 1e12, "sram_bytes": 1e6,
    ...     "memory": {"kind": "DDR", "capacity_bytes": 1e9, "bandwidth_Bps": 1e10}},
    ...     "network": [{"name": "nv", "topology": "switch", "size": 8, "link_bandwidth_Bps": 1e11},
    ...                 {"name": "ib", "topology": "switch", "size": 16, "link_bandwidth_Bps": 1e10}]})
    >>> complement_group(s, (("nv", 4), ("ib", 8)), (("nv", 4), ("ib", 2)))
    (('ib', 4),)
    """
    members = dict(group)
    for dim, n in sub:
        if members.get(dim, 1) % n:
            raise ValueError(f"{sub} is not a sub-group of {group}")
        members[dim] = members[dim] // n
    return tuple((d.name, members[d.name]) for d in system.network if members.get(d.name, 1) > 1)


def recipe_order(deg: dict[str, int], fast_size: int) -> tuple:
    """Order in which the search tries MoE recipe incumbents (:meth:`LLMSpace.seeds`), as the
    published MoE runs are laid out: TP inside the fast (NVLink) domain, no context parallelism
    at short sequences, the largest expert-parallel degree (DeepSeek-V3: EP 64 over 8 nodes,
    arXiv:2412.19437 sec. 3.2; Megatron-Core's DeepSeek-V3 recipe: EP 64), then the shallowest
    pipeline, then the narrowest TP (memory decides whether a candidate fits; the search
    evaluates it).

    >>> sorted([{"tp": 2, "pp": 16, "cp": 1, "ep": 64}, {"tp": 16, "pp": 2, "cp": 1, "ep": 4},
    ...         {"tp": 1, "pp": 8, "cp": 1, "ep": 64}], key=lambda d: recipe_order(d, 8))[0]
    {'tp': 1, 'pp': 8, 'cp': 1, 'ep': 64}
    """
    return (deg["tp"] > fast_size, deg["cp"], -deg["ep"], deg["pp"], deg["tp"])


#: overlap flags MoE recipes turn on (Megatron-Core's DeepSeek-V3 / Mixtral recipes: TP
#: communication overlap, overlapped gradient reduce and parameter gather): a seed takes them
RECIPE_OVERLAPS = ("tp_comm_overlap", "overlap_grad_reduce", "overlap_param_gather")


def members_off(group, fast_dim: str) -> int:
    """Members of a rank group (``(dim, members)`` pairs) outside the fast dimension: 1 when
    the whole group sits on it (where recipes put TP: Megatron-LM keeps TP within the NVLink
    domain).

    >>> members_off((("nvlink", 2),), "nvlink"), members_off((("nvlink", 2), ("ib", 4)), "nvlink")
    (1, 4)
    """
    out = 1
    for dim, n in group:
        if dim != fast_dim:
            out *= n
    return out


__all__ = ["members_off", "recipe_order", "A2A_OVERLAP_SMS", "a2a_sm_fraction", "overlapped_a2a_exposed_s", "a2a_overlap_applies",
           "dense_layers_per_stage", "complement_group"]
