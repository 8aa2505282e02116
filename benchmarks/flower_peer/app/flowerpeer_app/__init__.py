"""Flower App for fedtrain's side-by-side benchmark (see benchmarks/flower_peer/run.py)."""
