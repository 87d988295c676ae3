"""Recovery: a run that a killed rank, an elastic restart or a preemption costs at most one checkpoint interval
(`Resumable`), the preemption signals agreed at step boundaries, the job's attempts and its crash-loop rule."""
from .resumable import Resumable  # noqa: F401
