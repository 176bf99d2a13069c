"""Runtime: run a graph in this process, or deploy a plan onto a Dask cluster and serve it.

``local`` runs a graph in-process (the reference every distributed run must
match). The rest is the Dask side, and the only stage that talks to a Client:
``client`` (``deploy``, ``distribute``, ``DistributedModel``), ``discover``
(``measure_cluster``), ``state`` (``PlacementState``: the scheduler's decisions),
``resident`` (``ResidentBlocks``: a worker's blocks), ``agent`` (what a worker
has), ``tasks`` (what Dask tasks run), ``access`` (what an RPC may name).
"""

from .local import run_local

__all__ = ["run_local"]
