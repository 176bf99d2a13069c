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


class BadConfig(BadInput):
    """A setting is malformed or out of range: a ``seabiscuit.*`` configuration value, or an argument
    that stands in for one (a budget or memory size that is no byte count, a device choice that is
    not one of ``auto``, ``cuda``, ``cpu``)."""


class BadClusterSpec(BadInput):
    """A cluster description (a YAML file, a dict, a preset, measured figures) names an impossible
    cluster: a missing or unknown field, a figure that is no positive finite number, duplicate
    device names, a relay or link that joins devices the cluster does not have."""


class BadPlan(BadInput):
    """A plan, loaded from its document or built from an assignment, does not fit its graph or its
    cluster: ops without a device, devices out of range, blocks out of phase order, a wrong schema."""


class MissingPackage(SeaBiscuitError):
    """A feature needs an optional package that is not installed: the message says what to install."""


class Busy(BadInput):
    """The deployment has no room for the call now (its sessions are all taken): retry once calls
    finish, or deploy with more ``sessions``."""


class QueueTimeout(Busy):
    """A call waited for room longer than ``seabiscuit.generate.queue-timeout``: the deployment
    is busy for longer than that; try again later (503 with ``Retry-After`` over HTTP)."""


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


class LaneStopped(RunFailed):
    """A lane's decode loop (rows that change as it runs) stopped: every row was empty when its next
    step was to be built. Its caller starts the loop anew with the rows it holds now."""


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


class BadMessage(SeaBiscuitError):
    """A data-plane message is malformed or contradicts what its receiver holds: a frame from a
    peer that is not the layout SeaBiscuit writes (lengths, dtypes, shapes, a header that does not
    match its frames), a message naming another plan version than its run here or a tensor its
    block does not read, a task's inputs naming what its dependencies lack. The message is refused
    (a stream that sends one is dropped) and a run that needed it fails; its peers hear of it as
    ``RunFailed``."""


class BlockFailed(SeaBiscuitError):
    """A block raised an error of its own as it ran (its kernel failed on these inputs): running the
    request again would fail the same way, so it is not retried."""


class SpecUnavailable(SeaBiscuitError):
    """A worker could not get a block's spec from the scheduler plugin: the scheduler refused (the
    model was released or its plan replaced) or did not answer."""
