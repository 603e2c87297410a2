"""Compute side: every Slurm task (or torchrun / local process) runs this package."""
