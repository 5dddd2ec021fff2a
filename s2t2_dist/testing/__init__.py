"""Test helpers usable outside the test suite: `slurm_cluster.LocalSlurmCluster` starts a private SLURM cluster
(several slurmd nodes on this host, with accounting) for tests and for trying the sbatch scripts by hand."""
