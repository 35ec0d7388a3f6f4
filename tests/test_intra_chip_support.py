"""Random small DAGs and chips for the intra-chip tests (helpers only; no tests here)."""

from __future__ import annotations

import random

from dfmodel.graph.graph import DataflowGraph
from dfmodel.graph.kernel import Kernel, KernelKind, Phase, Tensor
from dfmodel.system.schema import Chip

MIB = 2**20


def chip(*, execution="dataflow", sram_mib=64.0, tiles=64, overlap=True, dram_gib=64.0, overhead_s=2e-6,
         bw=1e12, peak=100e12) -> Chip:
    return Chip(
        name="test",
        peak_flops=peak,
        vector_flops=peak / 8,
        sram_bytes=int(sram_mib * MIB),
        compute_tiles=tiles,
        memory={"kind": "HBM", "capacity_bytes": int(dram_gib * 2**30), "bandwidth_Bps": bw},
        execution=execution,
        overlap=overlap,
        efficiency={"matmul": 0.8, "vector": 0.6, "memory": 0.9, "kernel_overhead_s": overhead_s},
    )


def random_graph(seed: int, n: int | None = None) -> tuple[DataflowGraph, dict]:
    """A random DAG of <= 7 kernels with random FLOP, tensor sizes, shared weights, extra
    traffic, multi-consumer tensors, graph inputs/outputs and weight-gradient kernels; plus a
    random network-time dict."""
    rng = random.Random(seed)
    n = n or rng.randint(1, 7)
    kernels, tensors = [], []
    weights = ["W0", "W1", None]
    for i in range(n):
        kind = rng.choice([KernelKind.matmul, KernelKind.matmul, KernelKind.elementwise, KernelKind.embedding])
        phase = rng.choice([Phase.forward, Phase.forward, Phase.backward, Phase.weight_grad])
        wb = rng.choice([0.0, 0.0, rng.uniform(1, 24) * MIB])
        w = rng.choice(weights) if wb else None
        kernels.append(Kernel(
            f"k{i}", kind, {"m": 2048, "n": 1024, "k": 1024},
            flop=rng.uniform(0.05, 3) * 1e12 if kind == KernelKind.matmul else rng.uniform(1, 50) * 1e9,
            output_bytes=rng.uniform(1, 16) * MIB,
            weight_bytes=wb, weight=w,
            extra_memory_bytes=rng.uniform(0, 30) * MIB if kind == KernelKind.embedding else 0.0,
            phase=phase,
        ))
    for i in range(n):
        out = f"t{i}"
        b = rng.uniform(1, 24) * MIB
        consumers = [j for j in range(i + 1, n) if rng.random() < 0.45]
        for j in consumers:
            tensors.append(Tensor(out, f"k{i}", f"k{j}", b))
        if not consumers or rng.random() < 0.25:
            tensors.append(Tensor(out, f"k{i}", None, b))
        if rng.random() < 0.35:
            xb = rng.uniform(1, 16) * MIB
            readers = [j for j in range(i, n) if j == i or rng.random() < 0.3]
            for j in readers:
                tensors.append(Tensor(f"x{i}", None, f"k{j}", xb))
    net = {f"k{i}": rng.uniform(0, 40e-6) for i in range(n) if rng.random() < 0.3}
    return DataflowGraph(kernels, tensors, name=f"rand{seed}", meta={"tile_rows": 1024}), net


def _build(n, kinds, phases, flops, weights, wnames, extras, sizes, edges, outs, inputs, net):
    kernels = []
    named = {}
    for i in range(n):  # kernels naming one weight declare one size (as the builders do)
        if weights[i] and wnames[i]:
            weights[i] = named.setdefault(wnames[i], weights[i])
        kernels.append(Kernel(
            f"k{i}", kinds[i], {"m": 2048, "n": 1024, "k": 1024}, flop=flops[i], output_bytes=sizes[i],
            weight_bytes=weights[i], weight=wnames[i] if weights[i] else None,
            extra_memory_bytes=extras[i] if kinds[i] == KernelKind.embedding else 0.0, phase=phases[i],
        ))
    tensors = []
    for i in range(n):
        consumers = [j for j in range(i + 1, n) if edges[i][j]]
        for j in consumers:
            tensors.append(Tensor(f"t{i}", f"k{i}", f"k{j}", sizes[i]))
        if not consumers or outs[i]:
            tensors.append(Tensor(f"t{i}", f"k{i}", None, sizes[i]))
        if inputs[i]:
            xb, readers = inputs[i]
            for j in sorted({i, *[r for r in readers if i <= r < n]}):
                tensors.append(Tensor(f"x{i}", None, f"k{j}", xb))
    g = DataflowGraph(kernels, tensors, name="hyp", meta={"tile_rows": 1024})
    return g, {f"k{i}": t for i, t in enumerate(net) if t}


try:
    from hypothesis import strategies as st

    @st.composite
    def dags(draw, max_kernels: int = 7):
        """Hypothesis strategy: ``(graph, network_time_s)`` of up to ``max_kernels`` kernels with
        random FLOP, tensor and weight sizes, shared weights, multi-consumer tensors, graph
        inputs/outputs, embedding traffic and weight-gradient kernels."""
        n = draw(st.integers(1, max_kernels))
        mib = st.floats(1, 24).map(lambda x: x * MIB)
        kinds = draw(st.lists(st.sampled_from([KernelKind.matmul, KernelKind.matmul, KernelKind.elementwise,
                                               KernelKind.embedding]), min_size=n, max_size=n))
        phases = draw(st.lists(st.sampled_from([Phase.forward, Phase.backward, Phase.weight_grad]),
                               min_size=n, max_size=n))
        flops = [draw(st.floats(0.05, 3)) * (1e12 if k == KernelKind.matmul else 2e10) for k in kinds]
        weights = draw(st.lists(st.one_of(st.just(0.0), mib), min_size=n, max_size=n))
        wnames = draw(st.lists(st.sampled_from(["W0", "W1", None]), min_size=n, max_size=n))
        extras = draw(st.lists(mib, min_size=n, max_size=n))
        sizes = draw(st.lists(mib, min_size=n, max_size=n))
        density = draw(st.floats(0.1, 0.8))
        edges = [[draw(st.floats(0, 1)) < density for _ in range(n)] for _ in range(n)]
        outs = draw(st.lists(st.booleans(), min_size=n, max_size=n))
        inputs = [draw(st.one_of(st.none(), st.tuples(mib, st.lists(st.integers(0, n - 1), max_size=3))))
                  for _ in range(n)]
        net = draw(st.lists(st.one_of(st.just(0.0), st.floats(0, 40e-6)), min_size=n, max_size=n))
        return _build(n, kinds, phases, flops, weights, wnames, extras, sizes, edges, outs, inputs, net)

    @st.composite
    def chips(draw, execution=None):
        """Hypothesis strategy for small chips whose SRAM, tiles and DRAM are often tight (SRAM
        down to 4 MiB, below most weights: those partitions must stream their weights)."""
        return chip(
            execution=execution or draw(st.sampled_from(["dataflow", "dataflow", "dataflow", "kernel_by_kernel"])),
            sram_mib=draw(st.sampled_from([4, 8, 16, 32, 48, 64, 128, 512])),
            tiles=draw(st.sampled_from([2, 3, 64])),
            overlap=draw(st.booleans()),
            dram_gib=draw(st.sampled_from([0.05, 0.1, 64.0])),
            overhead_s=draw(st.sampled_from([2e-6, 20e-6])),
        )
    def streaming():
        """Hypothesis strategy for the :class:`CostModel` weight-streaming options: mostly on,
        with the default or a larger double buffer (a quarter or all of each weight)."""
        return st.fixed_dictionaries({
            "weight_streaming": st.sampled_from([True, True, True, False]),
            "stream_buffer_fraction": st.sampled_from([None, 0.25, 1.0]),
        })
except ImportError:  # hypothesis is a test extra
    pass
