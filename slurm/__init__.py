"""Slurm-side helpers: SLURM_* environment, sbatch rendering, queries, the local cluster."""
