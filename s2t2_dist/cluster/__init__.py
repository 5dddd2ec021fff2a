"""Launching on clusters: `submit` (SLURM through submitit, requeue on preemption) and `probe` (a stand-in entry
point that checks rendezvous, collectives, logging and checkpoint/resume on a cluster)."""
