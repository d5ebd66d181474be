"""Scheduling policies behind one small contract (see :mod:`asyncinfer.schedulers.base`)."""

from asyncinfer.schedulers.aging_priority import AgingPriorityScheduler
from asyncinfer.schedulers.base import SCHEDULER_API_VERSION, Scheduler, SchedulerConfig, SchedulerOutput
from asyncinfer.schedulers.fifo import FIFOScheduler
from asyncinfer.schedulers.length_bucket import LengthBucketScheduler
from asyncinfer.schedulers.ordered import OrderedScheduler
from asyncinfer.schedulers.pd_split import PDSplitScheduler
from asyncinfer.schedulers.registry import (
    ENTRY_POINT_GROUP,
    available_schedulers,
    builtin_schedulers,
    check_scheduler_options,
    create_scheduler,
    register_scheduler,
    registered_schedulers,
    resolve_scheduler,
)

__all__ = [
    "ENTRY_POINT_GROUP",
    "SCHEDULER_API_VERSION",
    "AgingPriorityScheduler",
    "FIFOScheduler",
    "LengthBucketScheduler",
    "OrderedScheduler",
    "PDSplitScheduler",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "available_schedulers",
    "builtin_schedulers",
    "check_scheduler_options",
    "create_scheduler",
    "register_scheduler",
    "registered_schedulers",
    "resolve_scheduler",
]
