"""NCCL's protocols, NVLink SHARP (NVLS), compute slowdown under overlapped communication, and
Megatron's TP-communication overlap: pure functions the collective table and the LLM
evaluation can call.

Sources (read, not copied):

- NCCL ``src/graph/tuning.cc`` (github.com/NVIDIA/nccl @ 5067397): per-protocol bandwidth
  factors (LL: half of the link, 8-byte lines carrying 4 bytes of data plus a flag; LL128:
  120 of every 128 bytes, ``* 0.92``; Simple: all of it), per-step hardware latencies on NVLink
  (ring LL 0.6 us, LL128 1.9 us, Simple 3.4 us; NVLS Simple 25 us) and the NVLS efficiency
  factor (``nvlsEfficiency``: Hopper 0.85, Blackwell 0.74). NCCL converts bus bandwidth to
  algorithm bandwidth with ``nRanks / nsteps``, ``nsteps = 2 (nRanks - 1)`` for all-reduce.
- NVLink SHARP (NVSwitch Gen3+, "NVLS", NCCL 2.17+): the switch reduces and multicasts, so each
  GPU sends its buffer once and receives the result once: ``S / B`` instead of a ring's
  ``2 (p-1)/p S / B``.
- AutoCCL (Xu et al., NSDI'25): NCCL's protocol / channel choices are tunables, and the channels
  (one CTA each) an overlapped collective takes slow the compute it hides behind.
- Megatron-LM ``--tp-comm-overlap`` (Transformer Engine userbuffers): the all-gather before a
  column-parallel GEMM and the reduce-scatter after a row-parallel GEMM are split into chunks
  exchanged peer to peer while the GEMM runs on the chunks already present (Wang et al.,
  "Overlap communication with dependent computation via decomposition", ASPLOS'23).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Protocol:
    """One NCCL protocol: the fraction of link bandwidth it delivers and its per-step latency
    relative to Simple's (NCCL tuning.cc, NVLink ring hwLatencies LL/LL128/Simple =
    0.6/1.9/3.4 us)."""

    name: str
    bandwidth_fraction: float
    latency_fraction: float


PROTOCOLS = (
    Protocol("LL", 0.5, 0.6 / 3.4),
    Protocol("LL128", 0.92, 1.9 / 3.4),
    Protocol("Simple", 1.0, 1.0),
)

#: NCCL's latency model (tuning.cc ``ncclTunerConstantsDefaults`` @ 5067397, microseconds, per
#: protocol LL / LL128 / Simple as :data:`PROTOCOLS`): a collective pays its algorithm's base
#: latency once, and every step of it the hardware latency of the transport that step crosses.
#: ``baseLatencies``: Tree 6.8 / 14.0 / 8.4, Ring 6.6 / 14.0 / 8.4.
NCCL_BASE_LATENCY_US = {"tree": (6.8, 14.0, 8.4), "ring": (6.6, 14.0, 8.4)}
#: ``hwLatencies`` per transport (NCCL_HW_NVLINK / PCI / NET) and algorithm.
NCCL_HW_LATENCY_US = {
    "nvlink": {"tree": (0.6, 1.25, 4.0), "ring": (0.6, 1.9, 3.4)},
    "pci": {"tree": (1.0, 1.9, 4.0), "ring": (1.0, 2.5, 5.7)},
    "net": {"tree": (5.0, 8.5, 14.0), "ring": (2.7, 4.0, 14.0)},
}
#: In a ring that leaves the node, every intra-node step also pays the host's network overhead:
#: ``intraLat = max(intraLat, netOverhead)``, netOverhead 1 us on an Intel x86 host (DGX H100's
#: Xeon 8480C; 2 us on AMD), 3x for Simple (tuning.cc ``getNetOverhead``).
NCCL_NET_OVERHEAD_US = 1.0


def algorithm_family(name: str) -> str | None:
    """``ring`` or ``tree`` for an algorithm NCCL runs as one of its rings or trees (by the
    candidate's name), else None (pairwise all-to-all, scatter + all-gather... whose latency is
    the dimension's own ``latency_s``).

    >>> algorithm_family("double binary tree"), algorithm_family("pipelined chain"), algorithm_family("bruck")
    ('tree', 'ring', None)
    """
    if "tree" in name:
        return "tree"
    if "ring" in name or "chain" in name:
        return "ring"
    return None


def step_latency_s(transport: str, family: str, protocol: int, *, multi_node: bool = False) -> float:
    """NCCL's per-step latency of ``family`` (ring / tree) with protocol index ``protocol`` over
    ``transport`` (nvlink / pci / net); inside a ring or tree that also crosses the network, an
    intra-node step is at least the host's net overhead (3x for Simple).

    >>> step_latency_s("net", "ring", 2), step_latency_s("nvlink", "ring", 0, multi_node=True)
    (1.4e-05, 1e-06)
    """
    lat = NCCL_HW_LATENCY_US[transport][family][protocol]
    if multi_node and transport != "net":
        lat = max(lat, NCCL_NET_OVERHEAD_US * (3 if PROTOCOLS[protocol].name == "Simple" else 1))
    return lat * 1e-6


def base_latency_s(family: str, protocol: int) -> float:
    """NCCL's fixed latency of one ring or tree collective (``baseLatencies``).

    >>> round(base_latency_s("ring", 0) * 1e6, 9)
    6.6
    """
    return NCCL_BASE_LATENCY_US[family][protocol] * 1e-6


#: CollNet (in-network reduction, SHARP) latency over the network: tuning.cc hwLatencies NET
#: CollNetDirect Simple, 31 us (its base latency is 0).
COLLNET_LATENCY_S = 31e-6


def sharp_all_reduce_s(message_bytes: float, bandwidth_Bps: float, latency_s: float = COLLNET_LATENCY_S) -> float:
    """All-reduce reduced in the switches (InfiniBand SHARP, NCCL CollNet): each member sends its
    ``S`` bytes up once and receives the reduced ``S`` once, ``a + S / B`` with ``B`` the
    member's achieved link bandwidth, against ``2 (p-1)/p S / B`` for a ring.

    >>> sharp_all_reduce_s(45e6, 45e9, 0.0)
    0.001
    """
    return latency_s + message_bytes / bandwidth_Bps


#: NVLS per-collective latency on NVLink (NCCL tuning.cc hwLatencies, NVLS Simple): 25 us.
NVLS_LATENCY_S = 25e-6
#: NVLS efficiency relative to the link bandwidth (NCCL tuning.cc ``nvlsEfficiency``).
NVLS_EFFICIENCY = {"hopper": 0.85, "blackwell": 0.74}


def with_protocols(time_fn, bandwidth_Bps: float, latency_s: float) -> tuple[str, float]:
    """Fastest protocol for an algorithm whose alpha-beta time is ``time_fn(bandwidth, latency)``.

    Each protocol scales the bandwidth and the per-step latency; NCCL picks the fastest per
    message size (LL for small, Simple for large messages).

    >>> from dfmodel.netmodels.formulas import ring_all_reduce_s
    >>> with_protocols(lambda b, a: ring_all_reduce_s(8, 1e3, b, a), 1e11, 3.4e-6)[0]
    'LL'
    >>> with_protocols(lambda b, a: ring_all_reduce_s(8, 1e9, b, a), 1e11, 3.4e-6)[0]
    'Simple'
    """
    best = min(PROTOCOLS, key=lambda p: time_fn(bandwidth_Bps * p.bandwidth_fraction, latency_s * p.latency_fraction))
    return best.name, time_fn(bandwidth_Bps * best.bandwidth_fraction, latency_s * best.latency_fraction)


def nvls_all_reduce_s(message_bytes: float, link_bandwidth_Bps: float, nvls_efficiency: float,
                      latency_s: float = NVLS_LATENCY_S) -> float:
    """NVLink SHARP all-reduce on one NVSwitch domain: ``a + S / (B e)``.

    Every member pushes its ``S`` bytes into the switch once (the switch adds them) and reads
    the reduced ``S`` back once by multicast, against ``2 (p-1)/p S`` each way for a ring. ``B``
    is the member's link bandwidth (one direction), ``e`` NCCL's NVLS efficiency.

    >>> nvls_all_reduce_s(4.5e9, 450e9, 0.85, 0.0) == 4.5e9 / (450e9 * 0.85)
    True
    """
    return latency_s + message_bytes / (link_bandwidth_Bps * nvls_efficiency)


def contended_kernel_s(compute_s: float, memory_s: float, *, comm_channels: int, sms: int,
                       comm_hbm_Bps: float, hbm_Bps: float) -> float:
    """Time of a kernel while an overlapped collective runs on the same GPU.

    The collective holds ``comm_channels`` SMs (NCCL runs one CTA per channel; AutoCCL,
    NSDI'25) and moves ``comm_hbm_Bps`` of HBM traffic (every byte sent is read from HBM and
    every byte received written; reductions read once more). The kernel keeps
    ``sms - comm_channels`` SMs and ``hbm_Bps - comm_hbm_Bps`` of bandwidth:

        max(compute_s * sms / (sms - c), memory_s * hbm / (hbm - comm_hbm))

    >>> contended_kernel_s(1.0, 0.2, comm_channels=32, sms=132, comm_hbm_Bps=0, hbm_Bps=3e12)
    1.32
    """
    if not 0 <= comm_channels < sms:
        raise ValueError(f"comm_channels must be in [0, {sms}), got {comm_channels}")
    if not 0 <= comm_hbm_Bps < hbm_Bps:
        raise ValueError(f"comm_hbm_Bps must be in [0, {hbm_Bps}), got {comm_hbm_Bps}")
    return max(compute_s * sms / (sms - comm_channels), memory_s * hbm_Bps / (hbm_Bps - comm_hbm_Bps))


def overlapped_exposed_s(comm_s: float, compute_s: float, sm_fraction: float) -> float:
    """Exposed time of ``comm_s`` of communication run beside ``compute_s`` of computation that
    loses ``sm_fraction`` of the chip while it runs (the SMs of its kernels: MoE all-to-alls
    beside another micro-batch).

    While the communication kernels run (``comm_s``) the computation proceeds at ``1 - f`` of
    its rate; so the pair takes ``c + f a`` when the computation outlasts the communication
    (``a (1 - f) <= c``) and ``a`` otherwise: ``max(a, c + f a)``. The exposed part, beyond the
    computation alone, is ``max(a - c, f a)``: what the computation cannot hide, or the SMs the
    communication took, whichever is larger. ``f = 0`` gives the textbook ``max(0, a - c)``.

    >>> overlapped_exposed_s(2.0, 10.0, 0.0), overlapped_exposed_s(12.0, 10.0, 0.0)
    (0.0, 2.0)
    >>> overlapped_exposed_s(2.0, 10.0, 0.25), overlapped_exposed_s(12.0, 10.0, 0.25)
    (0.5, 3.0)
    """
    if comm_s <= 0.0:
        return 0.0
    if not 0.0 <= sm_fraction < 1.0:
        raise ValueError(f"sm_fraction must be in [0, 1), got {sm_fraction}")
    return max(comm_s - compute_s, sm_fraction * comm_s)


#: SMs of an H100 SXM5 (NVIDIA H100 Tensor Core GPU Architecture whitepaper: 132 SMs).
H100_SMS = 132

#: SMs (channels: one CTA each) an NCCL ring collective between DGX H100 nodes holds: NCCL lays
#: 16 ring channels over 3 DGX H100 nodes (NVIDIA/nccl issue #1453, its NCCL_DEBUG=INFO log:
#: "Channel 00/16 ... Channel 15/16"); a channel runs as one CTA on its own SM (NVIDIA/nccl issue
#: #689, S. Jeaugey: NCCL "launches" 2 SMs, one per channel, on a one-NIC PCI system).
NCCL_RING_CHANNELS = 16


def overlapped_collective_s(overlapped_s: float, comm_sms: float, sms: int) -> float:
    """Compute time lost while ``overlapped_s`` of a collective runs hidden behind compute-bound
    kernels that give it ``comm_sms`` of the chip's ``sms`` SMs: they keep ``sms - comm_sms``
    (:func:`contended_kernel_s` without HBM contention), so in that time they do
    ``1 - comm_sms / sms`` of their work and the rest runs later (AutoCCL, NSDI'25: the channels
    an overlapped collective takes slow the compute it hides behind).

    >>> overlapped_collective_s(0.5, 16, 132) == 0.5 * 16 / 132
    True
    """
    if overlapped_s < 0 or not 0 <= comm_sms < sms:
        raise ValueError(f"overlapped_s must be >= 0 and comm_sms in [0, {sms}), got {overlapped_s}, {comm_sms}")
    return overlapped_s * comm_sms / sms


#: SMs the userbuffers exchanges hold while they overlap a GEMM, averaged over the ten overlapped
#: GEMMs of a layer in NeMo's H100 configuration (nemo/collections/llm/recipes/tp_overlap_configs/
#: userbuffers.py, userbuffers_bf16_h100_h16384_tp8_cp2_mbs1_seqlen8192: ring-exchange all-gathers
#: on copy engines (0 SMs) for qkv/fc1 fprop and proj/fc2 dgrad; pipelined reduce-scatters with 24
#: and 8 SMs for proj/fc2 fprop; bulk overlaps with 2, 24, 2, 2 SMs for qkv/fc1 dgrad/wgrad:
#: (24 + 8 + 2 + 24 + 2 + 2) / 10 = 6.2).
USERBUFFERS_SMS = 6.2


#: SMs a userbuffers exchange holds while it overlaps each GEMM, per (linear layer, pass), from NeMo's
#: H100 configs (nemo/collections/llm/recipes/tp_overlap_configs/userbuffers.py; the bf16 and fp8
#: variants hold the same SMs): ring-exchange all-gathers (qkv/fc1 fprop, proj/fc2 dgrad) run on
#: the copy engines (0 SMs); the pipelined reduce-scatters after proj/fc2 fprop hold ``num_sm``
#: (``set_sm_margin``: the GEMM runs on the rest); the bulk exchanges hold theirs beside the qkv/fc1
#: dgrad (all-gather of the saved input) and wgrad (reduce-scatter of the input gradient) GEMMs.
#: Key: the TP degree of the config (4: userbuffers_*_h100_h8192_tp4_mbs1_seqlen8192, Llama 3 70B;
#: 8: userbuffers_*_h100_h16384_tp8_cp2_mbs1_seqlen8192, Llama 3.1 405B).
USERBUFFERS_SMS_BY_TP = {
    4: {("out_proj", "fprop"): 24, ("fc2", "fprop"): 16, ("qkv", "dgrad"): 4, ("qkv", "wgrad"): 24,
        ("fc1", "dgrad"): 2, ("fc1", "wgrad"): 4},
    8: {("out_proj", "fprop"): 24, ("fc2", "fprop"): 8, ("qkv", "dgrad"): 2, ("qkv", "wgrad"): 24,
        ("fc1", "dgrad"): 2, ("fc1", "wgrad"): 2},
}


#: SMs Transformer Engine gives an exchange its run's userbuffers config does not set: ``num_sm``
#: defaults to 16 (TE v1.x module/base.py ``initialize_ub``: ``add_ub(..., num_sm=16, ...)`` for an
#: exchange absent from ``ub_cfgs``, ``ub_cfg.get("num_sm", 16)`` for one present without it). A
#: NeMo 1.x run with ``ub_tp_comm_overlap`` and no ``ub_tp_comm_overlap_cfg`` gets these for every
#: exchange (megatron_gpt_model.py ``initialize_ub_func`` passes ``ub_cfgs=None``).
TE_DEFAULT_UB_SMS = 16

#: The exchanges that hold SMs, by TE's default method (TE initialize_ub ``methods``): the
#: pipelined reduce-scatters after proj/fc2 fprop and the bulk exchanges beside qkv/fc1 dgrad and
#: wgrad; the ring exchanges (qkv/fc1 fprop, proj/fc2 dgrad) run on the copy engines (0 SMs).
#: Key: (layer as the graph names it, GEMM pass) -> TE's exchange name.
UB_SM_EXCHANGES = {("out_proj", "fprop"): "proj_fprop", ("fc2", "fprop"): "fc2_fprop",
                   ("qkv", "dgrad"): "qkv_dgrad", ("qkv", "wgrad"): "qkv_wgrad",
                   ("fc1", "dgrad"): "fc1_dgrad", ("fc1", "wgrad"): "fc1_wgrad"}


def userbuffers_sms(layer: str, gemm_pass: str, tp: int, config: dict[str, int] | None = None) -> float:
    """SMs the userbuffers exchange paired with GEMM ``(layer, gemm_pass)`` holds at TP ``tp``.

    ``config`` None: NeMo's tuned H100 configs (:data:`USERBUFFERS_SMS_BY_TP`; tp <= 4 uses the
    TP-4 config, larger tp the TP-8 one). Else the run's own ``num_sm`` per TE exchange name
    (``{"proj_fprop": 24, ...}``; ``{}`` is TE's defaults): an SM-holding exchange it leaves out
    holds :data:`TE_DEFAULT_UB_SMS`. A GEMM no SM-holding exchange pairs with (a ring exchange,
    or a wgrad of proj/fc2) keeps every SM.

    >>> userbuffers_sms("fc2", "fprop", 4), userbuffers_sms("fc2", "fprop", 8), userbuffers_sms("fc1", "fprop", 8)
    (16, 8, 0)
    >>> userbuffers_sms("fc2", "fprop", 8, {}), userbuffers_sms("qkv", "wgrad", 4, {"qkv_wgrad": 8}), userbuffers_sms("fc1", "fprop", 8, {})
    (16, 8, 0)
    """
    if config is None:
        return USERBUFFERS_SMS_BY_TP[4 if tp <= 4 else 8].get((layer, gemm_pass), 0)
    exchange = UB_SM_EXCHANGES.get((layer, gemm_pass))
    return 0 if exchange is None else config.get(exchange, TE_DEFAULT_UB_SMS)


def userbuffers_gemm_slowdown(sms: int = H100_SMS, ub_sms: float = USERBUFFERS_SMS) -> float:
    """Slowdown of a compute-bound GEMM that runs beside a userbuffers exchange: it keeps
    ``sms - ub_sms`` SMs (:func:`contended_kernel_s` with no HBM contention).

    >>> round(userbuffers_gemm_slowdown(132, 6.2), 4)
    1.0493
    """
    return contended_kernel_s(1.0, 0.0, comm_channels=ub_sms, sms=sms, comm_hbm_Bps=0.0, hbm_Bps=1.0)


def tp_overlapped_phase_s(phase_s: float, exposed_comm_s: float, gemm_s: float, comm_s: float, chunks: int,
                          *, gemm_slowdown: float = 1.0) -> float:
    """One layer phase (forward or backward) with Megatron's ``tp_comm_overlap``.

    ``phase_s`` is the phase as the intra-chip pass timed it, ``exposed_comm_s`` the part of it
    that is TP communication nothing hid; ``gemm_s`` the time of the linear-layer GEMMs the
    collectives feed or drain (QKV, projection, FC1, FC2 and their gradients), ``comm_s`` the
    phase's whole TP collective time. Userbuffers pair every collective with its GEMM
    (:func:`tp_comm_overlap_s`); the rest of the phase is unchanged:

        phase - exposed - gemm + tp_comm_overlap_s(gemm, comm, chunks)

    >>> tp_overlapped_phase_s(10.0, 2.0, 6.0, 2.0, 2)   # 10 - 2 - 6 + (3 + max(3, 2))
    8.0
    """
    rest = max(0.0, phase_s - exposed_comm_s - gemm_s)
    return rest + tp_comm_overlap_s(gemm_s, comm_s, chunks, gemm_slowdown=gemm_slowdown)


def tp_comm_overlap_s(gemm_s: float, comm_s: float, chunks: int, *, gemm_slowdown: float = 1.0) -> float:
    """Time of a GEMM and its TP all-gather or reduce-scatter overlapped the way Megatron's
    ``tp_comm_overlap`` (Transformer Engine userbuffers, ring exchange) runs them.

    The GEMM is split into ``chunks`` pieces (the TP degree) and the collective into the
    ``chunks - 1`` peer-to-peer transfers it consists of. All-gather: the local shard is
    multiplied first while the next arrives; reduce-scatter: the first partial is computed
    before anything can be sent, then each send overlaps the next piece. Either way one GEMM
    piece is exposed and the other ``n - 1`` steps take the slower of a piece and a transfer:

        g + (n - 1) max(g, c),  g = gemm_s * slowdown / n,  c = comm_s / (n - 1)

    (the GEMM loses the SMs the exchange uses: ``gemm_slowdown``, see
    :func:`contended_kernel_s`). With one chunk nothing overlaps: ``gemm_s + comm_s``. The
    result lies between ``max(gemm, comm)`` and ``gemm + comm`` (tested).

    >>> tp_comm_overlap_s(8.0, 3.0, 4)    # 2 + 3 * max(2, 1)
    8.0
    >>> tp_comm_overlap_s(2.0, 6.0, 4)    # 0.5 + 3 * max(0.5, 2)
    6.5
    >>> tp_comm_overlap_s(8.0, 4.0, 1)
    12.0
    """
    if chunks < 1:
        raise ValueError(f"chunks must be >= 1, got {chunks}")
    if chunks == 1:
        return gemm_s + comm_s
    g, c = gemm_s * gemm_slowdown / chunks, comm_s / (chunks - 1)
    return g + (chunks - 1) * max(g, c)
