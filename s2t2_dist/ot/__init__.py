"""Pure optimal-transport math (no torch.distributed, no I/O).

Import functions from their modules, e.g. ``from s2t2_dist.ot.sparsemax import sparsemax`` and
``from s2t2_dist.ot.sinkhorn import sparse_sinkhorn``. (The package deliberately does not re-export the function
``sparsemax``: it would shadow the submodule of the same name.)
"""
