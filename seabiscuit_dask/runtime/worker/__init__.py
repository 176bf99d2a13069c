"""The worker's side of the runtime: what runs inside a Dask worker process.

``agent`` measures what the worker has (memory, compute, GPUs, caches, links) for its reports;
``resident`` keeps the blocks and weight tiles it holds (``ResidentBlocks``), counted in its
budget, and their KV caches; ``store`` reads tiles from checkpoints; ``tasks`` are the functions
Dask tasks run here (loading a block, running one); ``integrity`` checks what was written. The
worker plugin (``plugins/worker.py``) builds them and the data plane (``runtime/dataplane/``) runs
blocks through them.
"""
