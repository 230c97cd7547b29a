"""The side-car evaluator: a process that evaluates each checkpoint a job writes
(`kfit-ps evaluate`, `kfit_ps.SidecarEvaluator`)."""

from kfit_ps.evaluator.sidecar import CheckpointEvaluation, SidecarEvaluator

__all__ = ["CheckpointEvaluation", "SidecarEvaluator"]
