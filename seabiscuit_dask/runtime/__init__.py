"""Runtime: run a graph in this process, or deploy a plan onto a Dask cluster and serve it.

Laid out by where each line executes:

- in the caller's process: ``local`` runs a graph here (the reference every distributed run must
  match); ``client/`` deploys a plan (``deploy``, ``distribute``) and is ``DistributedModel``, a
  facade over the program cache, the request sender and the plan it follows; ``generation/`` is
  the text-generation engine (a scheduler that decides each step as a plain record, an executor
  that carries it out); ``discover`` measures the cluster (``measure_cluster``); ``serving``
  holds what ``seabiscuit serve``, the demo and the CLI share;
- on the scheduler: ``scheduler/`` (``PlacementState``: what the scheduler knows and decides,
  as plain Python the scheduler plugin forwards Dask's hooks to);
- on a worker: ``worker/`` (the agent, the resident blocks and their store, the tasks Dask runs);
  ``dataplane/`` is the worker-to-worker data plane, laid out as distributed's shuffle (runs that
  hold their behaviour, a run manager, the client's end in ``dataplane/client``);
- on every side: ``access`` (ids, tickets and peer proofs: what an RPC may name) and ``watch``
  (deadlines).
"""

from .local import run_local

__all__ = ["run_local"]
