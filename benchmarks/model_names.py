"""The step benchmarks' model names, importable without torch: the cluster benchmark's CLI and report
name them without loading a model (``workload.py`` builds them)."""

from __future__ import annotations

from cgx_ps.planning.shapes import MODELS as SHAPED_MODELS

__all__ = ["CPU_MODELS", "SHAPED_MODELS"]

CPU_MODELS = ("tiny", "mlp17m", "mlp25m", "convnet")  # computed on the CPU (workload.build_model)
# SHAPED_MODELS: real models' gradient shapes with emulated accelerator compute (shaped_model.py)
