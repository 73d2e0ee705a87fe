"""What a request through the gateway can end with besides its events: the API maps each to a status."""

from __future__ import annotations

from farm.router.router import BusyError

__all__ = ["BusyError", "ClientGone", "GatewayTimeout", "NoWorkersError"]


class NoWorkersError(RuntimeError):
    """No live worker serves the model: the API answers 503."""


class ClientGone(ConnectionError):
    """The reader's client went away while it waited: the caller cancels the request (Submission.cancel)."""


class GatewayTimeout(TimeoutError):
    """No progress from the workers within the configured time: the API answers 504."""
