"""Choosing compression while training: layer-wise adaptive bit widths (a knapsack over measured errors)
and auto mode (compress only where it measurably pays)."""
