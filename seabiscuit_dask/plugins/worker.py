"""``SeaBiscuitWorkerPlugin``: the resource agent and keeper of resident blocks on one worker.

It measures the worker once at setup (``agent.static_report``), publishes its
figures through ``worker.metrics["seabiscuit"]`` on every heartbeat, and keeps
the compiled blocks of deployed models with their weight shards, counting their
bytes against the worker's budget: a load that would exceed it is refused with
``ClusterTooSmall``. The budget is the worker resource ``MEM`` (bytes), else the
config key ``seabiscuit.worker.memory-budget``, else
``seabiscuit.worker.memory-fraction`` of the worker's memory limit (or of its
GPU's memory).

The module-level functions are what Dask tasks run: ``load_block`` (put a
block's weights in place) and ``run_block_task`` (one block of one request).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import psutil
from distributed import WorkerPlugin, get_worker
from distributed.utils import sync

from .. import config
from ..errors import BadCheckpoint, ClusterTooSmall, SeaBiscuitError
from ..integrity import crc32, load_checkpoint, save_checkpoint
from ..ir import fmt_bytes
from ..lower.blocks import BlockProgram, BlockSpec, run_block
from . import agent

logger = logging.getLogger(__name__)

PLUGIN_NAME = "seabiscuit"


def worker_budget(resources: Mapping[str, float], memory_limit: int | None, gpu_bytes: int | None) -> int:
    """Bytes of shards and activations this worker may hold (see the module docstring)."""
    if resources.get("MEM"):
        return int(resources["MEM"])
    configured = config.get("worker.memory-budget")
    if configured:
        return config.to_bytes(configured, "seabiscuit.worker.memory-budget")
    fraction = float(config.get("worker.memory-fraction", 0.6))
    base = gpu_bytes or memory_limit or psutil.virtual_memory().total
    return int(base * fraction)


def tune_malloc() -> bool:
    """Let glibc reuse freed activation buffers instead of mapping fresh pages for each.

    Dask's nanny sets ``MALLOC_TRIM_THRESHOLD_``, which also freezes glibc's mmap
    threshold at 128 KiB: every activation tensor is then a fresh ``mmap`` with page
    faults, about 20% slower per block here. Buffers up to
    ``seabiscuit.worker.malloc-mmap-threshold`` come from the heap again; memory above
    ``malloc-trim-threshold`` still goes back to the system.
    """
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if not name or "musl" in name:
        return False
    try:
        libc = ctypes.CDLL(name)
        mmap_max = config.to_bytes(config.get("worker.malloc-mmap-threshold"), "malloc-mmap-threshold")
        trim = config.to_bytes(config.get("worker.malloc-trim-threshold"), "malloc-trim-threshold")
        m_trim_threshold, m_mmap_threshold = -1, -3
        return bool(libc.mallopt(m_mmap_threshold, mmap_max)) and bool(libc.mallopt(m_trim_threshold, trim))
    except (OSError, AttributeError):
        return False


class SeaBiscuitWorkerPlugin(WorkerPlugin):
    """Resource agent and resident-block keeper; installed by the scheduler plugin."""

    name = PLUGIN_NAME
    idempotent = True

    def setup(self, worker: Any) -> None:
        import torch

        self.worker = worker
        tune_malloc()
        torch.set_num_threads(max(1, int(worker.state.nthreads)))
        self.device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        gpu_bytes = (torch.cuda.get_device_properties(0).total_memory
                     if self.device.type == "cuda" else None)
        limit = getattr(getattr(worker, "memory_manager", None), "memory_limit", None)
        self.memory_limit = limit
        self.budget_bytes = worker_budget(dict(worker.state.total_resources), limit, gpu_bytes)
        self.report = agent.static_report(int(worker.state.nthreads), limit, self.device.type)
        self.report["budget_bytes"] = self.budget_bytes
        self.process = psutil.Process()
        self.process.cpu_percent()
        self.programs: dict[tuple[str, int], BlockProgram] = {}
        self.versions: dict[str, int] = {}
        self.lock = threading.RLock()
        self.stores: dict[str, Any] = {}
        self.tiles: dict[str, dict[tuple[Any, ...], Any]] = {}
        self.tile_crc: dict[str, dict[tuple[Any, ...], int]] = {}
        self.released: set[str] = set()             # model ids are never reused
        self.checkpoint_dirs: dict[str, str] = {}
        self.runs: dict[tuple[str, int], int] = {}
        self.counters = {"block_runs": 0, "resumed_from_checkpoint": 0, "checkpoints_written": 0,
                         "corrupt_tiles": 0, "corrupt_checkpoints": 0, "prefetched_blocks": 0}
        self.simulated: dict[str, float] = {}       # readings injected by tests and drills
        self.pressure_sent: str | None = None
        worker.metrics[PLUGIN_NAME] = self.metrics
        worker.handlers["seabiscuit_prefetch"] = self.prefetch

    def teardown(self, worker: Any) -> None:
        worker.metrics.pop(PLUGIN_NAME, None)
        worker.handlers.pop("seabiscuit_prefetch", None)
        with self.lock:
            self.programs.clear()

    # --- reporting ------------------------------------------------------------------------
    @property
    def resident_bytes(self) -> int:
        """Bytes of weight tiles held for resident blocks, each tile once."""
        return sum(t.numel() * t.element_size() for tiles in list(self.tiles.values())
                   for t in list(tiles.values()))

    def metrics(self, worker: Any) -> dict[str, Any]:
        live = {**agent.live_report(self.process), **self.simulated}
        self._check_pressure(live)
        return {**self.report, **live, "budget_bytes": self.budget_bytes,
                "resident_bytes": self.resident_bytes, "blocks": len(self.programs),
                "models": dict(self.versions), **self.counters}

    def _check_pressure(self, live: Mapping[str, Any]) -> None:
        """Ask the scheduler to move work away once memory or GPU heat crosses its limit."""
        reason = None
        limit = self.memory_limit or psutil.virtual_memory().total
        frac = float(config.get("worker.memory-pressure", 0.9))
        if live.get("rss_bytes", 0) > frac * limit:
            reason = (f"memory pressure: {fmt_bytes(live['rss_bytes'])} in use, over {frac:.0%} of "
                      f"{fmt_bytes(limit)}")
        hot = float(config.get("worker.gpu-temperature-limit", 85))
        temps = [float(t) for t in live.get("gpu_temperature_c", ()) or ()]
        if "gpu_temperature_c_max" in live:
            temps.append(float(live["gpu_temperature_c_max"]))
        if temps and max(temps) > hot:
            reason = f"GPU at {max(temps):.0f} C, over the {hot:.0f} C limit"
        if reason is None:
            self.pressure_sent = None
        elif self.pressure_sent is None and self.versions:
            self.pressure_sent = reason
            w = self.worker
            w.loop.add_callback(w.scheduler.seabiscuit_pressure, address=w.address, reason=reason)

    # --- resident blocks ------------------------------------------------------------------
    def _store(self, model: str) -> Any:
        from ..weights import WeightStore

        if model not in self.stores:
            self.stores[model] = WeightStore(device=self.device)
        return self.stores[model]

    def _read_tile(self, spec: BlockSpec, name: str, p: Any) -> Any:
        """Read one tile and check it against its reference checksum (re-read once on a mismatch)."""
        want = spec.checksums.get(name)
        for attempt in range(2):
            if attempt:     # NOTE: a fresh handle maps the file again (tiles may share its pages)
                self.stores.pop(spec.model, None)
            t = self._store(spec.model).load(p)
            got = crc32(t)
            if want is None or got == want:
                return t, got
            self.counters["corrupt_tiles"] += 1
            logger.warning("tile %s of model %s read with CRC-32 %d, expected %d: reading again",
                           name, spec.model, got, want)
        raise BadCheckpoint(f"tile {name!r} ({p.source.key}{list(p.source.slices or [])} in "
                            f"{p.source.file}) has CRC-32 {got} twice, expected {want}: the weights on "
                            "disk are corrupt")

    def load(self, spec: BlockSpec, keep: bool = True) -> BlockProgram:
        """Compile ``spec`` and load its shards; resident (counted) when ``keep``.

        A tile read by several blocks of this worker (a tied embedding) is loaded
        and counted once. Every tile is checked against its checksum as it is read.
        """
        with self.lock:
            self._retire(spec.model, spec.version)
            if spec.checkpoint_dir:
                self.checkpoint_dirs[spec.model] = spec.checkpoint_dir
            have = self.programs.get((spec.model, spec.index))
            if have is not None and have.spec.version == spec.version:
                return have
            # NOTE: a prefetch still loading when its model was released must not bring it back
            keep = keep and spec.version == self.versions.get(spec.model) and spec.model not in self.released
            tiles = self.tiles.setdefault(spec.model, {}) if keep else {}
            crcs = self.tile_crc.setdefault(spec.model, {})
            need = sum(p.nbytes for p in {_tile_key(p): p for p in spec.params.values()}.values()
                       if _tile_key(p) not in tiles)
            held = self.resident_bytes
            if keep and held + need > self.budget_bytes:
                raise ClusterTooSmall(
                    f"worker {self.worker.address} cannot hold block b{spec.index} of model "
                    f"{spec.model}: it holds {fmt_bytes(held)} of shards, the block needs "
                    f"{fmt_bytes(need)} more, and its budget is {fmt_bytes(self.budget_bytes)} "
                    f"({held} + {need} > {self.budget_bytes} bytes)")
            names = {_tile_key(p): n for n, p in spec.params.items()}

            def tile(p: Any) -> Any:
                k = _tile_key(p)
                if k not in tiles:
                    tiles[k], crcs[k] = self._read_tile(spec, names[k], p)
                return tiles[k]

            program = BlockProgram.load(spec, tile, self.device)
            if keep:
                self.programs[(spec.model, spec.index)] = program
            return program

    def verify(self, program: BlockProgram) -> bool:
        """Check a block's resident tiles against their checksums; reload the model's tiles on a mismatch.

        Runs every ``verify_every`` runs of a block, as deployed (0: never). Returns
        False when corruption was found (the block must be fetched again).
        """
        every = program.spec.verify_every
        key = (program.spec.model, program.spec.index)
        self.runs[key] = n = self.runs.get(key, 0) + 1
        if every <= 0 or n % every:
            return True
        crcs = self.tile_crc.get(program.spec.model, {})
        for name, p in program.spec.params.items():
            want = crcs.get(_tile_key(p))
            if want is not None and crc32(program.weights[name]) != want:
                self.counters["corrupt_tiles"] += 1
                logger.warning("resident tile %s of model %s is corrupt: dropping the model's tiles "
                               "on %s and reading them again", name, program.spec.model, self.worker.address)
                with self.lock:
                    self._drop(program.spec.model)
                    self.stores.pop(program.spec.model, None)   # NOTE: tiles may share the file's pages
                return False
        return True

    def _retire(self, model: str, version: int) -> None:
        """Note ``version`` as seen; a newer version drops the older blocks."""
        current = self.versions.get(model, -1)
        if version > current and model not in self.released:
            self.versions[model] = version
            self._drop(model)

    def _drop(self, model: str) -> int:
        """Forget ``model``'s resident blocks and tiles; returns the tile bytes freed."""
        for k in [k for k in self.programs if k[0] == model]:
            del self.programs[k]
        return sum(t.numel() * t.element_size() for t in self.tiles.pop(model, {}).values())

    def program(self, model: str, version: int, block: int) -> BlockProgram:
        """The block to run: resident, or loaded now from a spec the scheduler keeps.

        A block of the current plan that this worker owns becomes resident; any
        other (a request in flight when the plan changed, re-pinned here) is loaded
        for this run only and not counted against the budget.
        """
        have = self.programs.get((model, block))
        if have is not None and have.spec.version == version:
            return have
        spec = BlockSpec.from_dict(self._fetch_spec(model, version, block))
        owner = spec.address in ("", self.worker.address)
        return self.load(spec, keep=owner and version >= self.versions.get(model, -1))

    def _fetch_spec(self, model: str, version: int, block: int) -> dict[str, Any]:
        w = self.worker
        try:
            return sync(w.loop, w.scheduler.seabiscuit_block, model=model, version=version, block=block)
        except Exception as e:
            raise SeaBiscuitError(f"worker {w.address} could not get block b{block} of model {model} "
                                  f"plan {version} from the scheduler: {e}") from e

    async def prefetch(self, model: str = "", version: int = 0, budget_bytes: int | None = None) -> int:
        """RPC from the scheduler after a plan change: load the blocks this worker now owns.

        Returns how many blocks were loaded. A worker that owns none drops its old
        blocks, so a drained worker frees its memory at once.
        """
        import asyncio

        if budget_bytes:
            self.budget_bytes = int(budget_bytes)
        w = self.worker
        specs = await w.scheduler.seabiscuit_owned(model=model, version=version, address=w.address)
        with self.lock:
            self._retire(model, version)

        def load_all() -> int:
            for d in specs:
                if model in self.released:
                    return 0
                self.load(BlockSpec.from_dict(d))
            return len(specs)

        n = await asyncio.to_thread(load_all)
        self.counters["prefetched_blocks"] += n
        return n

    # --- checkpoints ----------------------------------------------------------------------
    def checkpoint_path(self, model: str, version: int, request: int, block: int) -> Path | None:
        d = self.checkpoint_dirs.get(model)
        if not d or request < 0:
            return None
        return Path(d) / model / f"r{request}" / f"v{version}-b{block}.safetensors"

    def release(self, model: str) -> int:
        """Drop every block of ``model``; returns the bytes freed."""
        with self.lock:
            self.released.add(model)
            freed = self._drop(model)
            self.versions.pop(model, None)
            self.stores.pop(model, None)
            self.tile_crc.pop(model, None)
        return freed


def _tile_key(p: Any) -> tuple[Any, ...]:
    return (p.source.key, p.source.slices, p.source.file, p.dtype)


def _plugin() -> SeaBiscuitWorkerPlugin:
    w = get_worker()
    p = w.plugins.get(PLUGIN_NAME)
    if not isinstance(p, SeaBiscuitWorkerPlugin):
        raise SeaBiscuitError(f"worker {w.address} has no SeaBiscuit plugin: install it on the scheduler "
                              "(client.register_plugin(SeaBiscuitSchedulerPlugin()) or "
                              "`dask scheduler --preload seabiscuit_dask.plugins.preload`)")
    return p


def load_block(spec: dict[str, Any]) -> int:
    """Task: make a block resident on this worker; returns its shard bytes."""
    return _plugin().load(BlockSpec.from_dict(spec)).nbytes


def load_block_json(spec: str) -> int:
    """Task: ``load_block`` with the spec as JSON text (cheap for Dask to carry)."""
    return load_block(json.loads(spec))


def run_block_task(model: str, version: int, request: int, block: int, inputs: Mapping[str, Any],
                   *deps: Any) -> Any:
    """Task: run one block of one request, or take its outputs from an intact checkpoint."""
    p = _plugin()
    ckpt = p.checkpoint_path(model, version, request, block)
    if ckpt is not None:
        out, why = load_checkpoint(ckpt)
        if out is not None:
            p.counters["resumed_from_checkpoint"] += 1
            _report_run(p, model, version, request, block, "resumed")
            return out
        if why != "missing":
            p.counters["corrupt_checkpoints"] += 1
            logger.warning("checkpoint %s not used (%s): running the block again", ckpt, why)
    program = p.program(model, version, block)
    if not p.verify(program):
        program = p.program(model, version, block)
    out = run_block(program, inputs, deps)
    p.counters["block_runs"] += 1
    _report_run(p, model, version, request, block, "computed")
    ckpt = ckpt or p.checkpoint_path(model, version, request, block)
    if ckpt is not None:
        save_checkpoint(ckpt, out)
        p.counters["checkpoints_written"] += 1
    return out


def _report_run(p: SeaBiscuitWorkerPlugin, model: str, version: int, request: int, block: int,
                how: str) -> None:
    """Tell the scheduler plugin a block ran (it counts re-executions after failures)."""
    p.worker.log_event("seabiscuit-runs", {"model": model, "version": version, "request": request,
                                           "block": block, "how": how})


def release_model(model: str, dask_worker: Any = None) -> int:
    """``client.run`` target: free a model's blocks on this worker."""
    p = (dask_worker or get_worker()).plugins.get(PLUGIN_NAME)
    return p.release(model) if isinstance(p, SeaBiscuitWorkerPlugin) else 0


def worker_report(dask_worker: Any = None) -> dict[str, Any] | None:
    """``client.run`` target: the agent's full report, or None without the plugin."""
    p = (dask_worker or get_worker()).plugins.get(PLUGIN_NAME)
    return p.metrics(p.worker) if isinstance(p, SeaBiscuitWorkerPlugin) else None
