"""Result of the intra-chip pass: the partition sequence, its times and its proof status."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class PartitionReport:
    """One partition: its kernels (run together), time breakdown (seconds) and SRAM use (bytes).

    ``time_s`` includes the per-partition overheads; ``tile_fraction`` is the row tile streamed
    (None for kernel-by-kernel chips); ``weights_streamed`` says whether the partition streams
    its weights from DRAM (re-read per row tile, ``stream_extra_bytes`` of ``memory_bytes``)
    rather than holding them resident (see :mod:`dfmodel.intra_chip.cost`); ``tiles_per_kernel`` the integer split of the compute
    tiles and ``integer_tile_compute_s`` its compute time (a diagnostic: the objective uses the
    continuous split, see :mod:`dfmodel.intra_chip.cost`).
    """

    kernels: list[str]
    compute_s: float
    memory_s: float
    network_s: float
    time_s: float
    memory_bytes: float
    sram_bytes: float
    tile_fraction: float | None
    tiles_per_kernel: dict[str, int] = field(default_factory=dict)
    integer_tile_compute_s: float | None = None
    dram_live_bytes: float = 0.0
    weights_streamed: bool = False
    stream_extra_bytes: float = 0.0

    def to_dict(self) -> dict:
        # what asdict gives (fresh list and dict), without its recursive deep copy: the search
        # turns every partition of every block solve into a row (asdict was 5% of a solve)
        return {**self.__dict__, "kernels": list(self.kernels), "tiles_per_kernel": dict(self.tiles_per_kernel)}

    @classmethod
    def from_row(cls, row: dict) -> "PartitionReport":
        keys = cls.__dataclass_fields__
        return cls(**{k: v for k, v in row.items() if k in keys})


@dataclass
class PartitionResult:
    """The chip's time per micro-batch and how it was found.

    ``method``: ``closed_form`` (kernel-by-kernel), ``dp`` (exact shortest path over ideals) or
    ``milp``; ``solver``: ``closed_form``, ``dp``, ``highs`` or ``gurobi``; ``status``:
    ``optimal`` or ``time_limit`` (then ``gap`` says how far from proven);
    ``proven_optimal`` is True for the closed form, the DP and a MILP that closed its gap.
    """

    time_s: float
    partitions: list[PartitionReport]
    proven_optimal: bool
    gap: float | None
    solver: str
    method: str
    status: str
    wall_s: float
    max_partitions: int | None = None
    bound_s: float | None = None
    peak_dram_live_bytes: float = 0.0
    message: str = ""
    stats: dict = field(default_factory=dict)

    @property
    def num_partitions(self) -> int:
        return len(self.partitions)

    @property
    def plan(self) -> list[list[str]]:
        return [p.kernels for p in self.partitions]

    def to_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        proof = "optimal" if self.proven_optimal else f"gap {100 * (self.gap or 0):.2f}%"
        return (f"{self.time_s * 1e3:.4f} ms in {self.num_partitions} partitions "
                f"({self.method}/{self.solver}, {proof}, {self.wall_s:.2f} s)")
