"""The data plane: activations go worker to worker, beside the task graph.

The scheduler plugin stays the control plane (placement, plan versions, failure);
a request's blocks run on their workers as their inputs arrive, over distributed's
comms (so TLS, ``Security`` and UCX apply), laid out as distributed's P2P shuffle lays
out its runs: ``manager.DataPlane`` is a worker's run manager (its runs by id, and the
handlers its RPCs and stream messages land on), ``runs`` one request there and all it does
(deliver a block's inputs, start it, send its outputs on, fail, be forgotten; a prompt's
chunk after the one before it, ``feed(after=...)``), ``host`` what the data plane asks of
its worker (one ``Host``, the plugin's), ``chain`` a decode step's last and next blocks on
one compute thread, ``ordered`` compute threads that take the oldest run's work first,
``loops`` a decode loop's steps fed from its greedy tokens (the generation engine's),
``wire`` how tensors of every dtype travel, ``client`` what the caller sends and collects,
``streams`` the one connection per pipeline edge that a worker's messages to a peer go down
(``flow``: what goes next on it, and how it times the link; docs/routing.md). Setting
``seabiscuit.runtime.data-plane``: ``p2p`` (this) or ``tasks`` (one Dask task per block,
activations through Dask).
"""

from ...errors import RunFailed, StaleRun
from .host import Host, timed
from .loops import STEP_INPUTS, Lane, Loop, decode_loop
from .manager import DataPlane
from .streams import Links
from .wire import Tensors

__all__ = ["STEP_INPUTS", "DataPlane", "Host", "Lane", "Links", "Loop", "RunFailed", "StaleRun", "Tensors",
           "decode_loop", "timed"]
