"""One small error hierarchy for the whole library.

Every message says what was wrong, where (key, site, round, tensor) and what to do,
so an operator can act on it without reading the code.
"""

from __future__ import annotations


class FedtrainError(Exception):
    """Base class of every error fedtrain raises on purpose."""


class ConfigError(FedtrainError, ValueError):
    """A configuration file or flag is invalid (unknown key, wrong type, bad value)."""


class TensorStreamError(FedtrainError, ValueError):
    """A chunked tensor stream is malformed: unknown or duplicate names, wrong dtype or
    shape, bad offsets, truncated or oversized data."""


class UpdateRejected(FedtrainError):
    """A site's update was refused (wrong shapes/dtypes, NaN/Inf, stale round, ...).

    The global model is never touched by a rejected update.
    """


class ProtocolError(FedtrainError):
    """A peer broke the federation protocol (unexpected message, unknown site, ...)."""


class SecAggError(FedtrainError):
    """Secure aggregation cannot proceed (bad parameters, too many dropouts, bad share)."""


class TaskError(FedtrainError):
    """A task could not be loaded or does not satisfy the Task protocol."""


class CertificateError(FedtrainError):
    """A TLS certificate or key is missing, unreadable, expired, not signed by the
    federation CA, issued for another purpose, or does not match its key.

    `cause` names the failed check in one word (`foreign_ca`, `expired`,
    `not_yet_valid`, `wrong_key_usage`, `key_mismatch`, `bad_certificate`) so that a
    refused peer's audit record can be filtered on it; "" when no single check applies.
    """

    def __init__(self, message: str, *, cause: str = "") -> None:
        super().__init__(message)
        self.cause = cause


class WorkerGroupError(FedtrainError):
    """A site's DDP worker group failed a round or could not start: a rank crashed,
    raised, or hung past the round's timeout.

    `failures` maps each rank to what happened. A local group tears itself down and
    restarts (`restarting` is True), so the site reports the round as failed and the
    next round runs on fresh workers.
    """

    def __init__(self, message: str, failures: dict[int, str], *, restarting: bool) -> None:
        super().__init__(message)
        self.failures = failures
        self.restarting = restarting


class SimulationError(FedtrainError):
    """A simulation worker failed: a client's training raised in a worker process or
    Ray actor (the message carries its traceback), or the worker died (killed, out of
    memory). The pool has been shut down by the time this is raised."""
