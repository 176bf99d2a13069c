"""The data plane: activations go worker to worker, beside the task graph.

The scheduler plugin stays the control plane (placement, plan versions, failure);
a request's blocks run on their workers as their inputs arrive, over distributed's
comms (so TLS, ``Security`` and UCX apply), the way distributed's P2P shuffle moves
its shards: ``manager.DataPlane`` is a worker's run manager, ``runs`` the state of
one request there (and of the prompt chunk it follows, ``feed(after=...)``), ``chain`` a
decode step's last and next blocks on one compute thread,
``wire`` how tensors of every dtype travel, and ``client`` what
the caller sends and collects, ``streams`` the one connection per pipeline edge that a
worker's messages to a peer go down (``flow``: what goes next on it, and how it times the link;
docs/routing.md). Setting ``seabiscuit.runtime.data-plane``: ``p2p`` (this)
or ``tasks`` (one Dask task per block, activations through Dask).
"""

from ...errors import RunFailed, StaleRun
from .manager import DataPlane, timed
from .runs import Loop, decode_loop
from .streams import Links
from .wire import Tensors

__all__ = ["DataPlane", "Links", "Loop", "RunFailed", "StaleRun", "Tensors", "decode_loop", "timed"]
