"""The door into the farm for a process that generates (an API process, a batch driver): place a request on
workers (placement.py), read its typed events back through the process's reply reader (replies.py), one request in
flight with its migration (submission.py), and what a reader makes of the events (reading.py: until decode starts,
a whole completion, usage across choices). gateway.py ties them together; failures.py names how a request can fail.
"""

from farm.gateway.failures import BusyError, ClientGone, GatewayTimeout, NoWorkersError, WorkerError
from farm.gateway.gateway import Gateway
from farm.gateway.placement import Dispatch, Placed
from farm.gateway.submission import Submission

__all__ = ["BusyError", "ClientGone", "Dispatch", "Gateway", "GatewayTimeout", "NoWorkersError", "Placed",
           "Submission", "WorkerError"]
