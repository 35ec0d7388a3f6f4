"""Offload of LLM training state to host memory: memory moved, time exposed, and when to try it.

Three strategy options of the parallelism record (:data:`dfmodel.inter_chip.config.OPTIONS`),
for systems with a ``host`` block (:class:`dfmodel.system.host.Host`):

- ``offload_optimizer`` -- ZeRO-Offload (Ren et al., "ZeRO-Offload: Democratizing
  Billion-Scale Model Training", USENIX ATC 2021, sec. 3-4): the fp32 master weights, Adam
  moments and gradients live in host DRAM and the CPU runs the step; the chip keeps its 16-bit
  weights. It is built on ZeRO-2 (sec. 4.2): every micro-batch's gradients are reduce-scattered
  bucket by bucket and each rank's 16-bit shard is copied to the host as the backward produces
  it (accumulated there in fp32), so it needs ZeRO stage >= 2 with data parallelism. Per step
  the updated 16-bit weights come back (ZeRO-Offload's data-flow graph: ``2M`` bytes each way
  for ``M`` parameters). ``host``: each micro-batch's gradient copy hides behind its backward,
  then the CPU step runs, and the weights go back tile by tile while the CPU updates the next
  tile (DeepSpeed ``ds_adam_step_plus_copy``, csrc/adam/cpu_adam.cpp): exposed ``m max(0, d2h
  - backward) + max(cpu, h2d)``. ``delayed`` (one-step delayed parameter update, sec. 4.3):
  the step and the weight copy run during the next iteration: ``m max(0, d2h - backward) +
  max(0, cpu + h2d - pipeline)``.
- ``offload_activations`` -- the saved activations of each layer are copied to the host during
  its forward and prefetched during its backward (Megatron-Core / Transformer Engine
  ``cpu_offloading``, double-buffered): per layer and micro-batch, exposed ``max(0, transfer -
  the layer's compute it hides behind)``; the chip keeps two layers' worth (the one computing,
  the one in transfer).
- ``offload_weights`` -- ZeRO-Infinity (Rajbhandari et al., SC 2021, sec. 5): layer weights
  and gradients live on the host and are streamed per layer and micro-batch, weights up in
  forward and again in backward, gradients down in backward; the chip keeps the FSDP working
  buffer of three layers (the one running, the one prefetched, one layer's gradients). It
  needs the optimizer on the host (the gradients are there) and, with data parallelism, ZeRO
  stage 3 (each rank streams its shard; DeepSpeed's ``offload_param`` is a stage-3 feature).

Host memory: every chip of a host is charged its worst pipeline stage's host bytes against
``usable / chips_per_host`` (conservative when stages that need less share the host). Not
modelled: NVMe offload (ZeRO-Infinity's third tier), partial offload (ZeRO-Offload++'s
Twin-Flow ratio, Megatron-Core's ``cpu_offloading_num_layers`` < all), the pinned staging
buffers' own size, and the CPU-Adam step competing with the transfers for host DRAM.

Transfers of the per-layer kinds run in both directions at once (1F1B interleaves forwards and
backwards), the step's one direction at a time: :meth:`Host.link_Bps` gives a chip's share.

When the search tries it: offload only adds time (a mapping's compute, communication and
pipeline are unchanged; the per-layer and step terms are >= 0) -- except that the CPU step
replaces the chip's own optimizer step, which is faster on every real system (HBM at TB/s
against host DRAM shared by the host's chips). So a mapping that fits without offload is never
beaten by its offloaded twin, and the free search tries offload variants only for mappings
that do not fit without it (:func:`variants`, called by the search when a mapping is ruled out
for memory). On a system whose CPU step would beat the chip's (:func:`host_step_can_win`) every
variant is enumerated up front instead. ``delayed`` changes the training algorithm (one step
stale weights) and is only used when the user fixes it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import product

from dfmodel.errors import InputError
from dfmodel.inter_chip.config import OFFLOAD_OPTIMIZER
from dfmodel.system.host import Host
from dfmodel.system.processor import memory_time_s

OFFLOAD_OPTIONS = ("offload_optimizer", "offload_activations", "offload_weights")
NEUTRAL_OFFLOAD = {"offload_optimizer": "none", "offload_activations": False, "offload_weights": False}
#: The chip's Adam step moves 28 bytes per parameter through HBM (dfmodel.inter_chip.llm)
CHIP_ADAM_BYTES_PER_PARAM = 28.0
#: Layers of saved activations a chip keeps with activation offload: the one being computed
#: and the one being copied (Transformer Engine's CPU-offload handler double-buffers per layer)
RESIDENT_ACTIVATION_LAYERS = 2
#: Layers of weights a chip keeps with weight offload: running, prefetched, one layer's
#: gradients on their way out (as FSDP's working buffer, dfmodel.inter_chip.memory)
RESIDENT_WEIGHT_LAYERS = 3


def uses_offload(m) -> bool:
    return getattr(m, "offload_optimizer", "none") != "none" or getattr(m, "offload_activations", False) \
        or getattr(m, "offload_weights", False)


def valid(m) -> bool:
    """Whether mapping ``m``'s offload options go together (:func:`valid_options`)."""
    return valid_options(vars(m), m.dp_cp)


def valid_options(opts: dict, dp_cp: int) -> bool:
    """Optimizer offload runs on ZeRO-2 (gradients reduce-scattered per micro-batch), weight
    offload on ZeRO-3 and needs the optimizer on the host -- with data parallelism.

    >>> valid_options({"offload_optimizer": "host", "zero_stage": 1}, 8), valid_options({"offload_optimizer": "host", "zero_stage": 0}, 1)
    (False, True)
    """
    opt = opts.get("offload_optimizer", "none") != "none"
    if opt and not (opts.get("zero_stage", 0) >= 2 or dp_cp == 1):
        return False
    if not opts.get("offload_weights", False):
        return True
    return opt and (opts.get("zero_stage", 0) == 3 or dp_cp == 1)


@dataclass(frozen=True)
class OffloadPlan:
    """What one mapping offloads, with the host it offloads to and the byte sizes it moves."""

    host: Host
    num_chips: int
    optimizer: str
    activations: bool
    weights: bool
    bytes_per_element: float  # 16-bit weights, gradients and activations moved over the link
    weight_bytes_per_param: float  # on-chip layer weight bytes per parameter (incl. an FP8 cache)
    optimizer_bytes_per_param: float  # on-chip optimizer state per parameter (master + moments)
    grad_bytes: float = 4.0  # gradient accumulation on the host (fp32 in ZeRO-Offload)

    @classmethod
    def of(cls, m, system, training, *, weight_bytes_per_param: float, optimizer_bytes_per_param: float):
        """The plan of mapping ``m`` (None when it offloads nothing)."""
        if not uses_offload(m):
            return None
        if system.host is None:
            raise InputError(f"system {system.name} has no host block: nothing can be offloaded",
                             field="offload_optimizer/offload_activations/offload_weights")
        return cls(system.host, system.num_chips, m.offload_optimizer, m.offload_activations, m.offload_weights,
                   float(training.activation_bytes), float(weight_bytes_per_param), float(optimizer_bytes_per_param),
                   float(training.grad_bytes))

    @property
    def sharing(self) -> int:
        return self.host.sharing(self.num_chips)

    # -- memory ---------------------------------------------------------------------------------
    def stage_memory(self, b, *, layers: int, layer_state, layer_act_bytes: float, in_flight: float,
                     layer_params: float, fsdp_buffer: bool):
        """One stage's :class:`~dfmodel.inter_chip.memory.MemoryBreakdown` with the offloaded
        state moved to the host (``host_bytes``), against the chip's share of the host.

        ``layer_state`` is the stage's layer :class:`~dfmodel.inter_chip.memory.ModelState`
        (already ZeRO-sharded), ``layer_act_bytes`` one layer's saved activations per
        micro-batch, ``layer_params`` one layer's parameters on the chip (unsharded by ZeRO),
        ``fsdp_buffer`` whether ZeRO-3 already holds the three-layer working buffer."""
        e = self.bytes_per_element
        weights, grads, opt, acts, host = b.weights_bytes, b.gradients_bytes, b.optimizer_bytes, b.activations_bytes, 0.0
        if self.optimizer != "none":
            # master weights + moments, and the gradients of the same shard, accumulated on the
            # host; the chip keeps only the buckets in flight (not counted)
            host += opt + self.grad_bytes * opt / self.optimizer_bytes_per_param
            opt = grads = 0.0
        if self.weights:
            params = layer_state.weights_bytes / self.weight_bytes_per_param  # the stage's layer shard
            weights -= layer_state.weights_bytes
            host += e * params  # the 16-bit copy streamed up (the fp32 master is the optimizer's)
            if not fsdp_buffer and layers:
                acts += RESIDENT_WEIGHT_LAYERS * layer_params * e
        if self.activations:
            saved = layer_act_bytes * layers * in_flight
            moved = max(0.0, saved - RESIDENT_ACTIVATION_LAYERS * layer_act_bytes)
            acts -= moved
            host += moved
        # (a new breakdown built directly: dataclasses.replace costs ~3x more, on every screen)
        return type(b)(weights, grads, opt, acts, b.capacity_bytes, b.labels, b.reserve_bytes, host,
                       self.host.usable_bytes / self.sharing)

    # -- time -------------------------------------------------------------------------------------
    def transfer_s(self, nbytes: float, directions: int) -> float:
        """Seconds to move ``nbytes`` between one chip and its host (all chips moving at once)."""
        return nbytes / self.host.link_Bps(self.num_chips, directions) if nbytes > 0 else 0.0

    def layer_transfer_s(self, *, act_bytes: float, weight_bytes: float) -> tuple[float, float]:
        """Host-link time of one layer and micro-batch, (forward, backward).

        Forward: the activations go down while the weights come up; backward: activations and
        weights come up while the gradients (16-bit, as many bytes as the weights) go down; the
        two directions run at once, so each pass takes its busier direction. The layer's pass
        then takes ``max(its other work, this)``: the transfer hides behind the compute and
        communication of the same pass, and only the excess is exposed (:func:`exposed_s`).

        ``act_bytes`` is one layer's saved activations per micro-batch, ``weight_bytes`` the
        16-bit bytes of the layer's weights this chip streams (its ZeRO-3 shard).

        >>> from dfmodel.system.host import Host
        >>> h = Host(capacity_bytes=1e12, chips_per_host=1, memory_bandwidth_Bps=1e12, link_bandwidth_Bps=10e9)
        >>> p = OffloadPlan(h, 1, "host", True, True, 2.0, 2.0, 12.0)
        >>> p.layer_transfer_s(act_bytes=1e9, weight_bytes=0.5e9)  # (max(1, 0.5), max(1 + 0.5, 0.5)) GB / 10 GB/s
        (0.1, 0.15)
        """
        act = act_bytes if self.activations else 0.0
        w = weight_bytes if self.weights else 0.0
        if act == 0.0 and w == 0.0:
            return 0.0, 0.0
        fwd = max(self.transfer_s(act, 2), self.transfer_s(w, 2))
        bwd = max(self.transfer_s(act + w, 2), self.transfer_s(w, 2))
        return fwd, bwd

    def cpu_step_s(self, params: float) -> float:
        """The host CPU's Adam step over ``params`` parameters of each of its chips."""
        return params * self.sharing / self.host.adam_params_per_s

    def step_exposed_s(self, params: float, *, backward_s: float, pipeline_s: float, micro_batches: int) -> float:
        """Exposed gradient copies and optimizer step of one chip whose optimizer shard holds
        ``params`` parameters (module doc: ``host`` or ``delayed``); ``backward_s`` is one
        micro-batch's backward. With weight offload the gradients and weights move per layer
        (:meth:`layer_transfer_s`), so only the CPU step remains."""
        if self.optimizer == "none":
            return 0.0
        moved = 0.0 if self.weights else self.bytes_per_element * params
        d2h = h2d = self.transfer_s(moved, 1)
        grads = micro_batches * exposed_s(d2h, backward_s)
        cpu = self.cpu_step_s(params)
        if self.optimizer == "delayed":
            return grads + exposed_s(cpu + h2d, pipeline_s)
        return grads + max(cpu, h2d)

    def step_floor_s(self, params: float) -> float:
        """A lower bound on :meth:`step_exposed_s` for any mapping with at least ``params``."""
        if self.optimizer != "host":
            return 0.0
        moved = 0.0 if self.weights else self.bytes_per_element * params
        return max(self.cpu_step_s(params), self.transfer_s(moved, 1))


def exposed_s(transfer_s: float, pass_s: float) -> float:
    """What a transfer adds to a pass it overlaps: ``max(0, transfer - pass)``."""
    return max(0.0, transfer_s - pass_s)


def floor_overrides(m) -> dict[str, float]:
    """Arguments of :func:`dfmodel.inter_chip.memory.memory_lower_bound_bytes` that keep it a
    lower bound with ``m``'s offload: what goes to the host counts 0 on the chip."""
    out: dict[str, float] = {}
    if getattr(m, "offload_optimizer", "none") != "none":
        out.update(bytes_per_param_optimizer=0.0, bytes_per_param_grads=0.0)
    if getattr(m, "offload_weights", False):
        out.update(bytes_per_param_weights=0.0, bytes_per_param_grads=0.0)
    if getattr(m, "offload_activations", False):
        out["bytes_per_element"] = 0.0
    return out


def host_step_can_win(system) -> bool:
    """True when the host's CPU step per chip is faster than the chip's own (never on the
    shipped presets): then an optimizer-offloaded twin may beat a fitting mapping."""
    host = system.host
    if host is None:
        return False
    cpu_per_param_s = host.sharing(system.num_chips) / host.adam_params_per_s
    return cpu_per_param_s < memory_time_s(system.chip, CHIP_ADAM_BYTES_PER_PARAM)


def free_values(knobs, system) -> dict[str, list]:
    """Values the free search gives each offload option (fixed knobs fixed)."""
    from dfmodel.inter_chip.config import OPTIONS

    out = {}
    for opt in OPTIONS:
        if opt.name not in OFFLOAD_OPTIONS:
            continue
        fixed = getattr(knobs, opt.name, None)
        out[opt.name] = [fixed] if fixed is not None else (list(opt.values) if system.host is not None else [opt.neutral])
    return out


def variants(m, knobs, system) -> list:
    """Offloaded twins of ``m`` to try when ``m`` does not fit without offload: every valid
    combination of the free offload options other than ``m``'s own (empty without a host, or
    when ``m`` already offloads, or when they were all enumerated up front)."""
    if system.host is None or host_step_can_win(system):
        return []
    free = [n for n in OFFLOAD_OPTIONS if getattr(knobs, n, None) is None]
    base = {n: NEUTRAL_OFFLOAD[n] for n in free}
    if "offload_optimizer" in base and getattr(knobs, "offload_weights", None):
        base["offload_optimizer"] = "host"  # as llm_space.option_values enumerates it
    if any(getattr(m, n) != v for n, v in base.items()):
        return []  # already a variant
    values = free_values(knobs, system)
    out = []
    for combo in product(*(values[name] for name in OFFLOAD_OPTIONS)):
        v = replace(m, **dict(zip(OFFLOAD_OPTIONS, combo)))
        if v != m and valid(v):
            out.append(v)
    return out


def leanest(variants) -> list:
    """The variants with the least chip memory for each weight-offload choice: the most other
    offload (optimizer and activation offload only ever remove bytes from the chip)."""
    best: dict[bool, object] = {}
    for v in variants:
        rank = (v.offload_optimizer != "none", v.offload_activations)
        w = v.offload_weights
        if w not in best or rank > (best[w].offload_optimizer != "none", best[w].offload_activations):
            best[w] = v
    return list(best.values())


def check_knobs(knobs, system, source=None) -> None:
    """One-line InputError for offload knobs the system or the other knobs cannot take."""
    fixed = {n: getattr(knobs, n, None) for n in OFFLOAD_OPTIONS}
    asks = fixed["offload_optimizer"] not in (None, "none") or bool(fixed["offload_activations"]) \
        or bool(fixed["offload_weights"])
    if asks and system.host is None:
        name = next(n for n in OFFLOAD_OPTIONS if fixed[n] not in (None, "none", False))
        raise InputError(f"system {system.name} has no host block (host memory to offload to); add one "
                         f"(see dfmodel.system.host) or drop the offload", source=source, field=name)
    if fixed["offload_weights"] and fixed["offload_optimizer"] == "none":
        raise InputError("weight offload keeps the gradients on the host, so the optimizer runs there too: "
                         "offload_optimizer must be host or delayed", source=source, field="offload_weights")


__all__ = ["OffloadPlan", "OFFLOAD_OPTIONS", "OFFLOAD_OPTIMIZER", "variants", "valid", "floor_overrides", "exposed_s",
           "host_step_can_win", "check_knobs", "uses_offload"]
