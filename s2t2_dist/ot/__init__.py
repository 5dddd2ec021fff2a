"""Pure optimal-transport math (no torch.distributed, no I/O): the public API.

    from s2t2_dist.ot import sparse_sinkhorn, SparseSinkhorn, softmax_sinkhorn, sparsemax

Modules: ``sinkhorn`` (the plans and their input checks), ``simplex`` (the scaled sparsemax on the plans' route),
``dykstra`` (Algorithm 1 as one autograd Function over per-device steps; the torch steps), ``dykstra_triton`` +
``triton_kernels`` (the CUDA steps), ``entropy``, ``marginals`` (division by a plan's marginals), ``prior`` (starting
plans from the tokens' surface strings).
"""

from .simplex import sparsemax
from .sinkhorn import SparseSinkhorn, softmax_sinkhorn, sparse_sinkhorn

__all__ = ["SparseSinkhorn", "softmax_sinkhorn", "sparse_sinkhorn", "sparsemax"]
