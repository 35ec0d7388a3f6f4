"""Input data pipeline and checkpointing of a training workload (sub-schemas of ``training``).

Both are optional; without them the input model falls back to streaming every sample from the
outermost storage tier and no checkpoint is taken::

    training:
      global_batch: 4096
      input_bytes_per_sample: 1 MB        # bytes read per sample (the existing field)
      data:
        dataset_samples: 400000000        # or dataset_bytes: 400 TB (one of the two)
        samples_per_request: 1            # samples fetched by one storage request, or
                                          # request_bytes: 4 MiB (default: 1 MiB requests)
        access: shuffle                   # shuffle (a new global permutation each epoch) | sequential
        preprocess_core_s_per_sample: 5 ms   # CPU core-seconds to decode/augment one sample
        cpu_cores_per_node: 96            # host cores given to the data loaders of one node
        prefetch_depth: 16                # storage requests in flight per node
      checkpoint:
        interval_steps: 500               # or interval_s: 30 min (one of the two)
        mode: async                       # sync | async (copy to host memory, drain in background)
        tier: lustre                      # storage tier that takes it (default: the outermost)
        fully_parallel: true              # every data-parallel rank writes a slice (default)
        include_gradients: false          # save gradients too (not needed to resume)

Field semantics, and where each is used, are in :mod:`dfmodel.inter_chip.input_pipeline` and
:mod:`dfmodel.inter_chip.checkpoint`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import PositiveInt, model_validator

from dfmodel.system.schema import Strict
from dfmodel.system.units import Bytes, Seconds, _q, _positive

PositiveSeconds = _q("time", _positive)
DEFAULT_REQUEST_BYTES = 2.0**20  # 1 MiB, Lustre's default stripe size


class DataPipeline(Strict):
    """How a training job reads and preprocesses its samples (see module doc)."""

    dataset_bytes: Bytes | None = None
    dataset_samples: PositiveInt | None = None
    samples_per_request: PositiveInt | None = None
    request_bytes: Bytes | None = None
    access: Literal["shuffle", "sequential"] = "shuffle"
    preprocess_core_s_per_sample: Seconds = 0.0
    cpu_cores_per_node: PositiveInt | None = None
    # PyTorch DataLoader's default prefetch_factor is 2 batches per worker; 2 requests in flight
    # is the conservative floor when the user does not say
    prefetch_depth: PositiveInt = 2

    @model_validator(mode="after")
    def _consistent(self) -> "DataPipeline":
        if self.dataset_bytes is not None and self.dataset_samples is not None:
            raise ValueError("give dataset_bytes or dataset_samples, not both")
        if self.samples_per_request is not None and self.request_bytes is not None:
            raise ValueError("give samples_per_request or request_bytes, not both")
        if self.preprocess_core_s_per_sample > 0 and self.cpu_cores_per_node is None:
            raise ValueError("preprocess_core_s_per_sample needs cpu_cores_per_node (host cores doing it)")
        return self

    def samples_per_request_for(self, sample_bytes: float) -> float:
        """Samples one storage request carries: as given, or ``request_bytes / sample_bytes``,
        by default 1 MiB requests (Lustre's default stripe size, Lustre Operations Manual,
        "Setting the File Layout/Striping Configuration": samples packed in large files are read
        in stripe-sized requests); never less than one sample."""
        if self.samples_per_request is not None:
            return float(self.samples_per_request)
        request = self.request_bytes if self.request_bytes is not None else DEFAULT_REQUEST_BYTES
        return max(1.0, request / sample_bytes) if sample_bytes > 0 else 1.0

    def dataset_size_bytes(self, sample_bytes: float) -> float | None:
        """Dataset bytes (None when unknown)."""
        if self.dataset_bytes is not None:
            return float(self.dataset_bytes)
        if self.dataset_samples is not None:
            return self.dataset_samples * sample_bytes
        return None

    def dataset_size_samples(self, sample_bytes: float) -> float | None:
        if self.dataset_samples is not None:
            return float(self.dataset_samples)
        if self.dataset_bytes is not None and sample_bytes > 0:
            return self.dataset_bytes / sample_bytes
        return None


class Checkpointing(Strict):
    """How often and how a training job saves its state (see module doc)."""

    interval_steps: PositiveInt | None = None
    interval_s: PositiveSeconds | None = None  # type: ignore[valid-type]
    mode: Literal["sync", "async"] = "sync"
    tier: str | None = None
    fully_parallel: bool = True
    include_gradients: bool = False

    @model_validator(mode="after")
    def _one_interval(self) -> "Checkpointing":
        if (self.interval_steps is None) == (self.interval_s is None):
            raise ValueError("give exactly one of interval_steps and interval_s")
        return self
