"""Scheduling policies behind one small contract (see :mod:`asyncinfer.schedulers.base`)."""

from asyncinfer.schedulers.base import Scheduler, SchedulerConfig, SchedulerOutput
from asyncinfer.schedulers.fifo import FIFOScheduler
from asyncinfer.schedulers.registry import create_scheduler, register_scheduler, resolve_scheduler

__all__ = [
    "FIFOScheduler",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "create_scheduler",
    "register_scheduler",
    "resolve_scheduler",
]
