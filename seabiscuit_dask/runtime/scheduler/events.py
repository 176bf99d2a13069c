"""What ``PlacementState.handle`` takes (events) and returns (instructions): frozen records.

One vocabulary: the device events are placement's own (``DeviceLost``,
``DeviceAdded``, ``CapacityChanged``) plus ``DeviceDrained``/``DeviceRestored``,
and a device is named by its worker's address (``ClusterSpec.index`` accepts a
device's name or address). ``ForModel(model, event)`` scopes a device event to
one model: what a client may ask for its own deployment.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...ir import OpGraph
from ...lower.blocks import Key
from ...placement import CapacityChanged, DeviceAdded, DeviceLost, DeviceSpec, Plan


# --- events ----------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelDeployed:
    model: str
    plan: Plan                        # its devices carry their workers' addresses
    token: str = ""                   # what the deploying client must show to change it
    checkpoint_dir: str = ""          # block outputs are checkpointed there ("" = not)
    verify_every: int = 0             # resident tiles are checked every N runs of a block
    owner: str = ""                   # id of the client whose stream claimed the deploy


@dataclass(frozen=True)
class ModelReleased:
    model: str


@dataclass(frozen=True)
class DeviceDrained:
    """Move work off a device that stays up (by hand, or under memory or heat pressure)."""

    name: str
    reason: str = "drained"


@dataclass(frozen=True)
class DeviceRestored:
    """A drained device may take work again: models spread onto it as onto one that joins."""

    device: DeviceSpec


@dataclass(frozen=True)
class WorkerFenced:
    """A worker stopped answering mid-request: every model is replanned around it as if it had left,
    and what it misses until it answers again is kept for its return (``Fencing``)."""

    address: str
    reason: str


DeviceEvent = DeviceLost | DeviceAdded | CapacityChanged | DeviceDrained | DeviceRestored


@dataclass(frozen=True)
class ForModel:
    """``event`` for one model only (a client drains, restores or re-budgets its own model)."""

    model: str
    event: DeviceEvent


@dataclass(frozen=True)
class BlockObserved:
    """A worker ran a block of a request in ``compute_s`` seconds (its own clock)."""

    model: str
    version: int
    block: int
    compute_s: float


@dataclass(frozen=True)
class BlockRan:
    """A worker reports a block run: computed, or read back from a checkpoint (``computed=False``:
    only counted); a computed run of a request with its time (``compute_s``) is learned from."""

    model: str
    version: int = 0
    request: int = 0
    block: int = 0
    computed: bool = True
    compute_s: float | None = None


@dataclass(frozen=True)
class LinksObserved:
    """A worker's data plane timed transfers to its peers: (receiver, bytes, seconds, when, and the
    seconds its bytes took to come in at the receiver: 0 where not known) each."""

    sender: str
    samples: tuple[tuple[str, float, float, float, float], ...]


@dataclass(frozen=True)
class ProgramAdded:
    """Another program of a deployed model (a generation step): placed where its weights are."""

    model: str
    graph: OpGraph


@dataclass(frozen=True)
class TasksSubmitted:
    keys: tuple[Key, ...]


@dataclass(frozen=True)
class TasksForgotten:
    keys: tuple[Key, ...]


Event = (ModelDeployed | ModelReleased | DeviceEvent | ForModel | WorkerFenced | TasksSubmitted
         | TasksForgotten | BlockObserved | BlockRan | ProgramAdded | LinksObserved)


# --- instructions ----------------------------------------------------------------------
@dataclass(frozen=True)
class Pin:
    """Run ``key`` on ``address`` only."""

    key: Key
    address: str
    repin: bool = False               # True: the task was pinned before (its worker left)
    order: tuple[int, int, int] = (1, 0, 0)   # (0 if its outputs leave the worker, request, block)


@dataclass(frozen=True)
class PlanChanged:
    """A model has a new plan version: tell its clients and workers."""

    model: str
    version: int
    reason: str
    moved_bytes: float = 0.0
    replan_s: float = 0.0


@dataclass(frozen=True)
class Stranded:
    """A model lost a worker and the rest of the cluster cannot hold it (until capacity returns)."""

    model: str
    message: str


@dataclass(frozen=True)
class RoutesChanged:
    """Workers' messages now go through these relays: (from, to, via) worker addresses, all of them;
    ``watch``: links a repair left (from, to) that no plan uses now, which their senders probe."""

    routes: tuple[tuple[str, str, str], ...]
    watch: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Rerouted:
    """A link of ``model``'s plan changed and was weighed (``kind``: ``keep``, ``relay`` or ``recut``)."""

    model: str
    src: str
    dst: str
    kind: str
    reason: str


Instruction = Pin | PlanChanged | Stranded | RoutesChanged | Rerouted
