"""Planning a deployment: a performance model of DDP and cgx-ps (``model``), real models' gradient shapes
(``shapes``), this machine's measured speeds (``calibrate``), the ``cgx-ps plan`` command (``command``) and the
model fed with what a running job measured, auto mode's first choice (``measured``).
Importing it imports no torch: ``shapes`` and ``calibrate`` load it (and transformers) only when asked."""

from .model import OPTIONS, Cluster, Prediction, Speeds, Tensor, Workload, predict, predict_all, shards_needed
from .shapes import COMPUTE_S, MODELS, PlanningError, sized_workload, workload

__all__ = ["COMPUTE_S", "MODELS", "OPTIONS", "Cluster", "PlanningError", "Prediction", "Speeds", "Tensor",
           "Workload", "predict", "predict_all", "shards_needed", "sized_workload", "workload"]
