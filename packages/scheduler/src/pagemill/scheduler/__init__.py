"""pagemill.scheduler: the iteration-level, continuous-batching scheduler.

Pure Python on top of pagemill.blockpool's KVCacheManager: the one request record, chunked
prefill, prefix-cache reuse, FCFS or priority admission, preemption by recompute when the KV
pool runs dry, and the token stop rules.
"""

from pagemill.scheduler.config import SchedulerConfig
from pagemill.scheduler.output import RequestUpdate, ScheduledRequest, SchedulerOutput
from pagemill.scheduler.request import Request, RequestStatus
from pagemill.scheduler.scheduler import Scheduler
from pagemill.scheduler.stats import SchedulerStats
from pagemill.scheduler.stopping import check_stop
from pagemill.scheduler.token_ids_view import TokenIdsView

__version__ = "0.4.0"

__all__ = [
    "Request",
    "RequestStatus",
    "RequestUpdate",
    "ScheduledRequest",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "SchedulerStats",
    "TokenIdsView",
    "check_stop",
]
