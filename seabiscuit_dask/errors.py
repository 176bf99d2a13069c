"""One error hierarchy: every failure a user can cause is a ``SeaBiscuitError``.

Each message names the object at fault and the numbers involved, so that a
user can act on it without reading a traceback.
"""

from __future__ import annotations


class SeaBiscuitError(Exception):
    """Base class of every error SeaBiscuit raises on purpose."""


class UnsupportedModel(SeaBiscuitError):
    """The object is not a model SeaBiscuit can trace, or its export failed."""


class BadInput(SeaBiscuitError):
    """Inputs do not match what the graph was traced for."""


class Busy(BadInput):
    """The deployment has no room for the call now (its sessions are all taken): retry once calls
    finish, or deploy with more ``sessions``."""


class BudgetTooSmall(SeaBiscuitError):
    """Some op cannot be split to fit the per-op memory budget."""


class BadCheckpoint(SeaBiscuitError):
    """A checkpoint file is unreadable, truncated, or does not match the model."""


class UnsupportedOp(SeaBiscuitError):
    """A graph names an operation that is not in SeaBiscuit's op registry."""


class AccessDenied(SeaBiscuitError):
    """A request names a model it did not deploy, a path outside the configured roots, or a
    quantity the machine cannot have."""


class InvalidGraph(SeaBiscuitError):
    """An OpGraph breaks one of its invariants (see ``verify``)."""


class ClusterTooSmall(SeaBiscuitError):
    """The cluster cannot hold the model."""


class RoomTaken(ClusterTooSmall):
    """A plan counted on room another model took since it was made (deployed meanwhile, by
    another client): measure the cluster and place again (``distribute`` does, once)."""


class DeviceUnavailable(ClusterTooSmall):
    """No worker of the cluster has the kind of device the model must run on (``device="cuda"``
    and no GPU worker)."""


class UnknownWorker(SeaBiscuitError):
    """A call or a plan names a worker the cluster does not have (now), or one whose SeaBiscuit
    agent has not reported yet: name one the cluster lists, or measure and place again."""


class WorkerLost(SeaBiscuitError):
    """A worker was lost and its work could not be recovered."""


class WorkerHung(WorkerLost):
    """A worker stopped answering mid-request: it was fenced and the request runs again elsewhere."""


class RunFailed(WorkerLost):
    """A request failed on the data plane (a peer could not be reached or failed it): every
    worker drops it, and the caller runs it again under a new id."""


class StaleRun(RunFailed):
    """A data-plane message named an older plan version than its worker holds (the plan changed
    while the request ran): the caller takes the current plan and sends the request again."""


STALE_TRIES = 10     # NOTE: times a request or step is sent again because the plan changed while it ran


def restless(what: str, tries: int, error: BaseException) -> StaleRun:
    """The error a caller raises once ``what`` was sent ``tries`` times and the plan changed under
    every one (``error``: the last try's): the cluster replans faster than it runs."""
    return StaleRun(f"{what} was sent {tries} times and the plan changed under every try, the last "
                    f"time: {error}. The cluster replans faster than the request runs (workers "
                    "draining, restoring or changing capacity one after another); send it again once "
                    "the plan settles")


class ModelClosed(SeaBiscuitError):
    """A call reached a distributed model after (or while) it was closed."""


class SessionClosed(ModelClosed):
    """A kept session (``dm.session()``) was closed while a turn of it ran, or asked for after."""
