"""The API's door into the farm: route a request to workers (gateway.py) and read its token stream (submission.py).

Layout per model, from the live worker registry:
- prefill and decode workers present -> disaggregated: the router picks the prefill worker by KV
  overlap and load and the decode worker by decode load; the prefill task computes the prompt's KV,
  emits a signed KV handle and hands the decode task to the chosen decode worker's queue;
- otherwise aggregated workers (`both`) -> one generate task on the worker the router picks;
- decode workers alone -> the decode task prefills locally.
Tasks go to the chosen worker's own queue. While a reader iterates `events`, it checks the workers that
hold the request (farm.reliability.worker_gone); one that died before starting it or mid-stream makes
the request migrate to another worker with the tokens streamed so far (Submission). Load is recorded in
Redis as the request moves (placed -> prefilled -> done) so every API replica sees the same load.
Events come back on the request's Redis Stream (farm.protocol) and are read here with XREAD.
"""

from farm.gateway.errors import BusyError, ClientGone, GatewayTimeout, NoWorkersError
from farm.gateway.gateway import Gateway
from farm.gateway.submission import Dispatch, Submission

__all__ = ["BusyError", "ClientGone", "Dispatch", "Gateway", "GatewayTimeout", "NoWorkersError", "Submission"]
