"""Flower App for fedtrain's simulation benchmark (see benchmarks/sim_vs_flower.py)."""
