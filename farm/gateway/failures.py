"""What a request through the gateway can end with besides its events: the API maps each to a status."""

from __future__ import annotations

from farm.protocol import ErrorEvent
from farm.router.router import BusyError

__all__ = ["BusyError", "ClientGone", "GatewayTimeout", "NoWorkersError", "WorkerError"]


class NoWorkersError(RuntimeError):
    """No live worker serves the model: the API answers 503."""


class ClientGone(ConnectionError):
    """The reader's client went away while it waited: the caller cancels the request (Submission.cancel)."""


class GatewayTimeout(TimeoutError):
    """No progress from the workers within the configured time: the API answers 504."""


class WorkerError(RuntimeError):
    """The request failed on the workers (an `error` event): `code` says why (engine_error, invalid_task,
    worker_lost when no other worker could take it over, orphaned, events_lost when Redis lost part of the
    answer, invalid_request when the engine could not do what the request asked...). The API answers 503 for
    worker_lost, orphaned and events_lost (retry later), 400 for invalid_request and 500 otherwise."""

    def __init__(self, message: str, code: str):
        super().__init__(message)
        self.code = code

    @property
    def retryable(self) -> bool:
        return self.code in ("worker_lost", "orphaned", "events_lost")

    @property
    def status(self) -> int:
        """The HTTP status it is answered with (the API's response, a batch line's error): 503 when retrying
        later may succeed, 400 when the request asked what the engine could not do, else 500."""
        return 503 if self.retryable else 400 if self.code == ErrorEvent.INVALID_REQUEST else 500
