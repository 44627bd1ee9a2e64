"""Data: Sample (sample.py), prompt datasets (dataset.py), the rollout data source (source.py)."""
