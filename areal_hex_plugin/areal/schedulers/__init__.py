"""Upstream schedulers that put each role on its planned GPU type (local, Ray, Slurm)."""
