"""Graph builders, one module per workload family (see :mod:`dfmodel.graph.build` for the API)."""

from dfmodel.graph.builders.dlrm import build_dlrm
from dfmodel.graph.builders.explicit import build_explicit
from dfmodel.graph.builders.fft import build_fft
from dfmodel.graph.builders.hpl import build_hpl
from dfmodel.graph.builders.llm import build_llm_dense_layer, build_llm_embedding, build_llm_head, build_llm_layer

__all__ = ["build_dlrm", "build_explicit", "build_fft", "build_hpl", "build_llm_dense_layer", "build_llm_embedding", "build_llm_head",
           "build_llm_layer"]
