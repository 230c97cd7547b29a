"""Datasets: Criteo-shaped click logs (generator and reader)."""
