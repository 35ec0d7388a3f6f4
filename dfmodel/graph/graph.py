"""The dataflow graph: kernels (vertices) and tensors (edges) over a networkx MultiDiGraph."""

from __future__ import annotations

import heapq
import json
from collections.abc import Iterable
from functools import cached_property
from pathlib import Path

import networkx as nx

from dfmodel.errors import InputError
from dfmodel.graph.kernel import Kernel, Phase, Tensor


class DataflowGraph:
    """An acyclic graph of kernels connected by tensors, all sizes positive.

    The networkx graph (``.nx``, a MultiDiGraph so two tensors may join the same pair) holds each
    :class:`Kernel` as node attribute ``kernel`` and each edge's :class:`Tensor` as ``tensor``.
    Tensors with no producer (graph inputs) or no consumer (graph outputs) are kept beside it.

    >>> from dfmodel.graph.kernel import KernelKind
    >>> a = Kernel("a", KernelKind.matmul, {"m": 4, "n": 4, "k": 4}, flop=128, output_bytes=32)
    >>> b = Kernel("b", KernelKind.elementwise, {"m": 4, "n": 4}, flop=16, output_bytes=32)
    >>> g = DataflowGraph([a, b], [Tensor("t", "a", "b", 32)], name="demo")
    >>> g.topological_names()
    ['a', 'b']
    >>> g.total_flop()
    144.0
    """

    def __init__(
        self,
        kernels: Iterable[Kernel],
        tensors: Iterable[Tensor],
        *,
        name: str = "graph",
        meta: dict | None = None,
        source: str | None = None,
        check: bool = True,
    ):
        self.name = name
        self.meta = dict(meta or {})
        self.kernels: list[Kernel] = list(kernels)
        self.tensors: list[Tensor] = list(tensors)
        if check:  # False only for graphs derived from a checked one (subgraph): nothing new to check
            self._check(source)
        self._by_name = {k.name: k for k in self.kernels}
        self._params: float | None = None
        # the topological order doubles as the acyclicity check; the networkx view is built on
        # first use (the solvers build thousands of graphs and never need it)
        self._topo = self._lexicographic_order()
        if len(self._topo) < len(self.kernels):
            cycle = " -> ".join(u for u, *_ in nx.find_cycle(self.nx))
            raise InputError(f"graph must be acyclic, found cycle {cycle}", source=source, field="tensors")

    @cached_property
    def nx(self) -> nx.MultiDiGraph:
        """The graph as a networkx MultiDiGraph (node attribute ``kernel``, edge ``tensor``)."""
        g = nx.MultiDiGraph(name=self.name)
        for k in self.kernels:
            g.add_node(k.name, kernel=k)
        for i, t in enumerate(self.tensors):
            if t.producer is not None and t.consumer is not None:
                g.add_edge(t.producer, t.consumer, key=i, tensor=t)
        return g

    def _lexicographic_order(self) -> list[str]:
        """Kahn's algorithm taking the ready kernel listed first: the order of networkx's
        ``lexicographical_topological_sort`` keyed by insertion index (deterministic and
        builder-friendly). Shorter than the kernel list when there is a cycle."""
        index = {k.name: i for i, k in enumerate(self.kernels)}
        indegree = [0] * len(self.kernels)
        children: list[list[int]] = [[] for _ in self.kernels]
        for t in self.tensors:
            if t.producer is not None and t.consumer is not None:
                c = index[t.consumer]
                children[index[t.producer]].append(c)
                indegree[c] += 1
        ready = [i for i, d in enumerate(indegree) if d == 0]
        heapq.heapify(ready)
        order = []
        while ready:
            i = heapq.heappop(ready)
            order.append(self.kernels[i].name)
            for c in children[i]:
                indegree[c] -= 1
                if indegree[c] == 0:
                    heapq.heappush(ready, c)
        return order

    def _check(self, source: str | None) -> None:
        names: set[str] = set()
        for i, k in enumerate(self.kernels):
            where = f"kernels.{i}"
            if k.name in names:
                raise InputError(f"duplicate kernel name {k.name!r}", source=source, field=f"{where}.name")
            names.add(k.name)
            for attr in ("flop", "output_bytes", "weight_bytes", "extra_memory_bytes", "params", "comm_bytes"):
                if getattr(k, attr) < 0:
                    raise InputError(f"must be >= 0, got {getattr(k, attr):g}", source=source, field=f"{where}.{attr}")
            for d, v in k.dims.items():
                if v <= 0:
                    raise InputError(f"must be > 0, got {v}", source=source, field=f"{where}.dims.{d}")
        for i, t in enumerate(self.tensors):
            where = f"tensors.{i}"
            if not t.bytes > 0:
                raise InputError(f"must be > 0, got {t.bytes:g}", source=source, field=f"{where}.bytes")
            for end in ("producer", "consumer"):
                v = getattr(t, end)
                if v is not None and v not in names:
                    raise InputError(f"unknown kernel {v!r}", source=source, field=f"{where}.{end}")
            if t.producer is None and t.consumer is None:
                raise InputError("a tensor needs a producer or a consumer", source=source, field=where)
            if t.producer is not None and t.producer == t.consumer:
                raise InputError(f"self-loop on {t.producer!r}: graph must be acyclic", source=source, field=where)

    # -- structure ------------------------------------------------------------------------------
    @cached_property
    def _kernel_keys(self) -> list[tuple]:
        return [tuple(tuple(sorted(v.items())) if isinstance(v, dict) else v for v in vars(k).values())
                for k in self.kernels]

    @cached_property
    def _tensor_keys(self) -> list[tuple]:
        return [tuple(vars(t).values()) for t in self.tensors]

    @cached_property
    def content_key(self) -> tuple:
        """Hashable key of the graph's content (kernels, tensors, meta; not its name): graphs with
        equal keys cost the same in every pass, so solves can be memoised on it. The graph must
        not be mutated after this is read (nothing in the package mutates a built graph)."""
        return tuple(self._kernel_keys), tuple(self._tensor_keys), repr(sorted(self.meta.items()))

    def subgraph_key(self, names: Iterable[str]) -> tuple:
        """What :meth:`subgraph` of ``names`` would contain, as a hashable key, without building
        it: its kernels and every tensor touching them (the cut tensors' renaming depends on
        nothing else), and the meta it inherits."""
        keep = set(names)
        kernels = tuple(kk for k, kk in zip(self.kernels, self._kernel_keys) if k.name in keep)
        tensors = tuple(tk for t, tk in zip(self.tensors, self._tensor_keys) if t.producer in keep or t.consumer in keep)
        return kernels, tensors, repr(sorted(self.meta.items()))

    def kernel(self, name: str) -> Kernel:
        return self._by_name[name]

    def __len__(self) -> int:
        return len(self.kernels)

    def topological_names(self) -> list[str]:
        return list(self._topo)

    def internal_tensors(self) -> list[Tensor]:
        """Tensors with both a producer and a consumer (the edges)."""
        return [t for t in self.tensors if t.producer is not None and t.consumer is not None]

    def inputs(self) -> list[Tensor]:
        return [t for t in self.tensors if t.producer is None]

    def outputs(self) -> list[Tensor]:
        return [t for t in self.tensors if t.consumer is None]

    def subgraph(self, names: Iterable[str], *, name: str | None = None) -> "DataflowGraph":
        """Induced subgraph; tensors cut at the boundary become inputs/outputs of the subgraph."""
        keep = set(names)
        kernels = [k for k in self.kernels if k.name in keep]
        # a cut tensor loses its producer; keep distinct tensors that share a name (a tensor and
        # its converted copy after sharding) distinct by naming the producer they came from
        cut_producers: dict[str, set] = {}
        for t in self.tensors:
            if t.producer is not None and t.producer not in keep and t.consumer in keep:
                cut_producers.setdefault(t.name, set()).add(t.producer)
        tensors = []
        for t in self.tensors:
            p = t.producer if t.producer in keep else None
            c = t.consumer if t.consumer in keep else None
            if p is None and c is None:
                continue
            tensor_name = t.name  # (not ``name``: that is the subgraph's, below)
            if p is None and t.producer is not None and len(cut_producers.get(t.name, ())) > 1:
                tensor_name = f"{t.name}@{t.producer}"
            tensors.append(Tensor(tensor_name, p, c, t.bytes, t.operand, t.shape))
        return DataflowGraph(kernels, tensors, name=name or f"{self.name}[sub]", meta=self.meta, check=False)

    # -- totals ---------------------------------------------------------------------------------
    def total_flop(self, phase: Phase | None = None) -> float:
        return float(sum(k.flop for k in self.kernels if phase is None or k.phase == phase))

    def matmul_flop(self, phase: Phase | None = None) -> float:
        return float(
            sum(k.flop for k in self.kernels if k.kind.is_matrix and (phase is None or k.phase == phase))
        )

    def params(self) -> float:
        # memoised: the search's memory checks ask a block's parameter count ~100k times
        p = self.__dict__.get("_params")
        if p is None:
            p = self._params = float(sum(k.params for k in self.kernels))
        return p

    def weight_bytes(self) -> float:
        """Bytes of parameters owned by the graph (forward kernels' weights)."""
        return float(sum(k.weight_bytes for k in self.kernels if k.phase == Phase.forward))

    # -- export ---------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "meta": self.meta,
            "kernels": [k.to_dict() for k in self.kernels],
            "tensors": [t.to_dict() for t in self.tensors],
        }

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, d: dict, source: str | None = None) -> "DataflowGraph":
        return cls(
            [Kernel.from_dict(k) for k in d["kernels"]],
            [Tensor.from_dict(t) for t in d["tensors"]],
            name=d.get("name", "graph"),
            meta=d.get("meta"),
            source=source,
        )

    def to_dot(self) -> str:
        """Graphviz DOT text: kernels as boxes labelled with FLOP, edges with tensor bytes."""
        lines = [f'digraph "{self.name}" {{', "  rankdir=TB;", "  node [shape=box, fontsize=10];"]
        colors = {Phase.forward: "#cfe2ff", Phase.backward: "#ffe5b4", Phase.weight_grad: "#d5f5d5"}
        for k in self.kernels:
            label = f"{k.name}\\n{k.kind.value}, {k.flop:.3g} FLOP"
            lines.append(f'  "{k.name}" [label="{label}", style=filled, fillcolor="{colors[k.phase]}"];')
        for t in self.internal_tensors():
            lines.append(f'  "{t.producer}" -> "{t.consumer}" [label="{t.name} {t.bytes:.3g} B", fontsize=8];')
        lines.append("}")
        return "\n".join(lines) + "\n"

    def write(self, path: str | Path) -> None:
        """Write ``.json`` or ``.dot`` according to the suffix."""
        path = Path(path)
        text = self.to_dot() if path.suffix == ".dot" else self.to_json()
        path.write_text(text)

    def __repr__(self) -> str:
        return f"DataflowGraph({self.name!r}, {len(self.kernels)} kernels, {len(self.tensors)} tensors)"
