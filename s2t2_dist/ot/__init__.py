"""Pure optimal-transport math (no torch.distributed, no I/O): the public API.

    from s2t2_dist.ot import sparse_sinkhorn, SparseSinkhorn, softmax_sinkhorn, sparsemax

Modules, bottom up: ``dykstra`` (the projection primitives, the torch steps, and Algorithm 1 as one autograd
Function over per-device steps), ``dykstra_triton`` + ``triton_kernels`` (the CUDA steps), ``kernel_check`` (a
candidate's launches judged against the torch steps on identical inputs), ``routing`` (the steps per device, the
kernels once they pass that check; the route told to the caller), ``sinkhorn`` (the plans and their input checks),
``simplex`` (the scaled sparsemax on the plans' route), ``entropy``, ``marginals`` (division by a plan's marginals),
``prior`` (starting plans from the tokens' surface strings). Nothing here imports the rest of the package.
"""

from .simplex import sparsemax
from .sinkhorn import SparseSinkhorn, softmax_sinkhorn, sparse_sinkhorn

__all__ = ["SparseSinkhorn", "softmax_sinkhorn", "sparse_sinkhorn", "sparsemax"]
