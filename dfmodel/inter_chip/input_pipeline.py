"""Input pipeline: reading and preprocessing the global batch overlaps the training step."""

from __future__ import annotations

from dfmodel.system.schema import System


def input_exposed_s(system: System, global_batch: int, input_bytes_per_sample: float, step_s: float) -> float:
    """Seconds the step waits for its input.

    Each node reads ``global_batch / nodes`` samples at ``storage.read_bandwidth_Bps`` and
    preprocesses them at ``storage.preprocess_samples_per_s``; loading the next batch overlaps
    the current step, so only ``max(0, load - step)`` is exposed. No ``storage`` block, or no
    input bytes, means the input pipeline is not modelled (0).

    >>> from dfmodel.system import load_system
    >>> s = load_system({"name": "t", "chip": {"name": "c", "peak_flops": 1e12, "sram_bytes": 1e6,
    ...     "memory": {"kind": "DDR", "capacity_bytes": 1e9, "bandwidth_Bps": 1e10}},
    ...     "network": [{"name": "r", "topology": "ring", "size": 8, "link_bandwidth_Bps": 1e9}],
    ...     "storage": {"chips_per_node": 8, "read_bandwidth_Bps": 1e9, "preprocess_samples_per_s": 1e3}})
    >>> input_exposed_s(s, 4000, 1e6, 1.0)   # 4 GB at 1 GB/s = 4 s; preprocessing 4 s: 3 s exposed
    3.0
    """
    storage = system.storage
    if storage is None or input_bytes_per_sample <= 0:
        return 0.0
    nodes = max(1, system.num_chips // storage.chips_per_node)
    samples_per_node = global_batch / nodes
    load_s = max(samples_per_node * input_bytes_per_sample / storage.read_bandwidth_Bps,
                 samples_per_node / storage.preprocess_samples_per_s)
    return max(0.0, load_s - step_s)
