"""Pure optimal-transport math (no torch.distributed, no I/O): the public API.

    from s2t2_dist.ot import sparsemax, sparse_sinkhorn, softmax_sinkhorn

Modules: ``simplex`` (sparsemax and the simplex projector behind it), ``sinkhorn`` (sparse and softmax Sinkhorn
plans), ``entropy``, ``marginals`` (division by a plan's marginals), ``fused`` (compiled pass kernels).
"""

from .simplex import SimplexProjector, sparsemax
from .sinkhorn import SparseSinkhorn, softmax_sinkhorn, sparse_sinkhorn

__all__ = ["SimplexProjector", "SparseSinkhorn", "softmax_sinkhorn", "sparse_sinkhorn", "sparsemax"]
