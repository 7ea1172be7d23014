"""Parallelism, one file per idea; parallelize.py composes them in one documented order."""
