"""Host memory: the CPU-side DRAM tier that training state can be offloaded to (pydantic schema).

An optional ``host:`` block of a system spec. Absent = nothing can be offloaded (every result is
then what it was before this block existed)::

    host:
      kind: DDR5
      capacity_bytes: 2 TB            # one host's DRAM (a DGX node, a Grace CPU)
      chips_per_host: 8               # accelerators sharing that DRAM and its CPU
      memory_bandwidth_Bps: 614 GB/s  # the host's DRAM bandwidth (all sockets)
      link_bandwidth_Bps: 50 GB/s     # chip <-> host link, per direction (PCIe, NVLink-C2C)
      chips_per_link: 1               # chips behind one such link (a PCIe switch uplink, one C2C)
      reserve_bytes: 256 GiB          # OS, framework, data loader, pinned staging buffers
      cpu_adam_params_per_s: 6.5e9    # optional: the host's optimizer (CPU-Adam) throughput

How the models of :mod:`dfmodel.inter_chip.offload` read it:

- a chip's share of the link, per direction, is ``link_bandwidth_Bps / chips_per_link``, and
  never more than its share of host DRAM, ``memory_bandwidth_Bps / (chips x directions)`` --
  all chips of a host move data at once (they run the same schedule), and a transfer in each
  direction reads or writes DRAM once;
- the host's CPU runs the optimizer step of every chip it serves: ``cpu_adam_params_per_s``
  is the whole host's rate. Left out, it is derived from the DRAM bandwidth: CPU-Adam is
  memory-bound (it streams the fp32 master weight, both moments and the gradient per
  parameter), and ZeRO-Offload's measurement gives the achieved fraction (see
  :data:`CPU_ADAM_DRAM_EFFICIENCY`).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, PositiveInt

from dfmodel.system.units import Bytes, BytesOrZero, BytesPerSec, PositiveFloat

#: DRAM bytes CPU-Adam moves per parameter: reads fp32 master weight, momentum, variance and
#: the fp32 gradient (16), writes the three fp32 states (12) and the 16-bit weight copy that
#: goes back to the accelerator (2) -- DeepSpeed csrc/adam/cpu_adam_impl.cpp, ``Step_AVX``.
CPU_ADAM_BYTES_PER_PARAM = 30.0

#: Achieved fraction of host DRAM bandwidth in CPU-Adam. Ren et al., "ZeRO-Offload", USENIX
#: ATC 2021, Table 3 (as recalled here: the paper itself was not in the reference library):
#: CPU-Adam updates 10B parameters in 2.57 s (PyTorch's CPU Adam 14.76 s; the "5-7x faster"
#: of DeepSpeed's ZeRO-Offload tutorial) on a DGX-2 host, 2x Xeon Platinum 8168, 6 channels of
#: DDR4-2666 each = 256 GB/s: 3.9e9 params/s x 30 B = 117 GB/s = 0.46 of peak. One factor for
#: every host: newer CPUs have more cores per channel, so this is, if anything, conservative.
CPU_ADAM_DRAM_EFFICIENCY = (10e9 / 2.57) * CPU_ADAM_BYTES_PER_PARAM / (2 * 6 * 2666e6 * 8)


class Host(BaseModel):
    """One host's DRAM, its link to each accelerator, and its CPU's optimizer throughput."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)

    kind: str = Field(default="DDR", pattern=r"^(DDR|LPDDR|HBM|CXL)[0-9A-Za-z]*$")
    capacity_bytes: Bytes
    chips_per_host: PositiveInt
    memory_bandwidth_Bps: BytesPerSec
    link_bandwidth_Bps: BytesPerSec
    chips_per_link: PositiveInt = 1
    reserve_bytes: BytesOrZero = 0.0
    cpu_adam_params_per_s: PositiveFloat | None = None

    @property
    def usable_bytes(self) -> float:
        """DRAM left for offloaded training state."""
        return max(0.0, self.capacity_bytes - self.reserve_bytes)

    def sharing(self, num_chips: int) -> int:
        """Chips of a ``num_chips`` system that share one host (fewer on a partial host)."""
        return max(1, min(self.chips_per_host, num_chips))

    def link_Bps(self, num_chips: int, directions: int = 1) -> float:
        """One chip's host bandwidth per direction while every chip of its host transfers in
        ``directions`` (1 or 2) directions at once: its link share, capped by its DRAM share.

        >>> h = Host(capacity_bytes=1e12, chips_per_host=8, memory_bandwidth_Bps=400e9,
        ...          link_bandwidth_Bps=25e9)
        >>> h.link_Bps(8, 1), h.link_Bps(8, 2)
        (25000000000.0, 25000000000.0)
        >>> h.model_copy(update={"memory_bandwidth_Bps": 200e9}).link_Bps(8, 2)
        12500000000.0
        """
        if directions not in (1, 2):
            raise ValueError(f"directions must be 1 or 2, got {directions}")
        dram_share = self.memory_bandwidth_Bps / (self.sharing(num_chips) * directions)
        return min(self.link_bandwidth_Bps / self.chips_per_link, dram_share)

    @property
    def adam_params_per_s(self) -> float:
        """The whole host's CPU-Adam rate: given, or derived from its DRAM bandwidth."""
        if self.cpu_adam_params_per_s is not None:
            return float(self.cpu_adam_params_per_s)
        return self.memory_bandwidth_Bps * CPU_ADAM_DRAM_EFFICIENCY / CPU_ADAM_BYTES_PER_PARAM
