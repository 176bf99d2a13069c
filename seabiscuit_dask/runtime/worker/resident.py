"""A worker's resident blocks: compiled programs, their weight tiles, checksums and checkpoints.

Plain Python, no Dask: the worker plugin wraps one ``ResidentBlocks`` and tests
drive it directly. Tiles are counted once against the worker's budget (a tied
embedding read by two blocks is one tile) and checked against their CRC-32 as
they are read. The lock guards bookkeeping only and is never held while a tile
is read, so the worker's event loop never waits on a load.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Hashable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ... import config
from ...errors import BadCheckpoint, ClusterTooSmall
from ...ir import ParamSpec, fmt_bytes
from ...lower.blocks import BlockProgram, BlockSpec, run_block
from ...lower.fuse import linear_groups, pack_rows, should_fuse
from ...lower.kvcache import KVStore, using
from ...lower.layout import held as laid_out
from ...weights import WeightStore
from .. import access
from .integrity import crc32, load_checkpoint, request_folder, save_checkpoint

logger = logging.getLogger(__name__)

FetchSpec = Callable[[str, int, int], Mapping[str, Any]]
COUNTERS = ("block_runs", "resumed_from_checkpoint", "checkpoints_written", "checkpoint_write_failures",
            "checkpoints_skipped", "corrupt_tiles", "corrupt_checkpoints", "prefetched_blocks")


# a tile's identity: its source's key, slices, file and dtype (and an inline constant's shape and contents)
TileKey = tuple[Hashable, ...]


def tile_key(p: ParamSpec) -> TileKey:
    # NOTE: inline constants are named by their tracer (``_tensor_constant0``): programs traced at
    # other shapes reuse the names for other values, so their contents are part of the key
    inline = (p.shape, hash(p.source.data)) if p.source.kind == "inline" else ()
    # NOTE: integers or scales derived from a float weight (the scales of a tied head and of its
    # table, ``[n]`` and ``[n, 1]``, are two tensors of the same rows)
    derived = (p.source.quant, len(p.shape)) if p.source.quant is not None else ()
    return (p.source.key, p.source.slices, p.source.file, p.dtype, *inline, *derived)


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class ResidentBlocks:
    """Blocks of deployed models kept on one worker, within ``budget_bytes``.

    Blocks run on the worker's ``device``, except those whose plan device is a CPU
    (``BlockSpec.kind == "cpu"``: a model placed with ``device="cpu"``), which run on the
    CPU with their tiles in host memory, within ``host_budget_bytes`` on a GPU worker.
    """

    def __init__(self, budget_bytes: int, device: torch.device | str = "cpu", address: str = "",
                 host_budget_bytes: int | None = None) -> None:
        self.budget_bytes = int(budget_bytes)
        self.device = torch.device(device)
        self.address = address
        self.host_budget_bytes = int(host_budget_bytes if host_budget_bytes is not None else budget_bytes)
        self._running = threading.local()             # the device of the block this thread runs
        self.programs: dict[tuple[str, int], BlockProgram] = {}
        self.tiles: dict[str, dict[TileKey, torch.Tensor]] = {}
        # NOTE: the tiles' bytes, summed once after tiles come or go (a cache's growth asks for them):
        # (the tiles' generation it was summed at, bytes); the generation moves with every change
        self._tile_gen = 0
        self._tile_bytes = (-1, 0)
        self.tile_crc: dict[str, dict[TileKey, int]] = {}
        self.versions: dict[str, int] = {}
        self.released: set[str] = set()              # model ids are never reused
        self.checkpoint_dirs: dict[str, Path] = {}
        self.runs: dict[tuple[str, int], int] = {}
        self.counters = dict.fromkeys(COUNTERS, 0)
        self._stores: dict[tuple[str, str], WeightStore] = {}     # (model, device type) -> store
        # NOTE: (device, model, tile) -> [bytes, loads, plan version] of the tiles being read to keep
        self._loading: dict[tuple[str, str, TileKey], list[int]] = {}
        self._lock = threading.Lock()
        self.kv = KVStore(self._reserve_cache)         # generation sessions' KV caches

    def device_for(self, spec: BlockSpec) -> torch.device:
        """Where ``spec`` runs here: on the CPU when its plan device is one, else on the worker's device."""
        return torch.device("cpu") if spec.kind == "cpu" else self.device

    def budget_for(self, device: torch.device) -> int:
        """The budget of ``device``'s memory: host memory on a GPU worker has its own."""
        on_host = device.type == "cpu" and self.device.type != "cpu"
        return self.host_budget_bytes if on_host else self.budget_bytes

    def bytes_on(self, device: torch.device) -> tuple[int, int]:
        """(weight tile bytes, KV cache bytes) held in ``device``'s memory (every byte, on a worker
        with one device)."""
        if self.device.type == "cpu":          # NOTE: a CPU worker holds everything in host memory
            return (self.weight_bytes, self.kv.nbytes) if device.type == "cpu" else (0, 0)
        tiles = [t for ts in list(self.tiles.values()) for t in list(ts.values())]
        caches = [c for layers in list(self.kv.caches.values()) for c in list(layers.values())]
        return (sum(tensor_bytes(t) for t in tiles if t.device.type == device.type),
                sum(c.nbytes for c in caches if c.k.device.type == device.type))

    def _reserve_cache(self, nbytes: int, what: str) -> None:
        """Room for ``nbytes`` more of KV cache, within the budget next to the weight tiles."""
        dev = getattr(self._running, "device", None) or self.device
        weights, cache = self.bytes_on(dev)
        budget = self.budget_for(dev)
        if weights + cache + nbytes > budget:
            raise ClusterTooSmall(
                f"worker {self.address} cannot grow {what}: it holds {fmt_bytes(weights)} of weights and "
                f"{fmt_bytes(cache)} of KV cache, {fmt_bytes(nbytes)} more exceeds its budget of "
                f"{fmt_bytes(budget)} ({weights} + {cache} + {nbytes} > {budget} "
                "bytes); close sessions, lower max_new_tokens, or give the model more workers")

    def kv_sessions(self) -> dict[str, int]:
        """Per model: sessions with a KV cache here."""
        out: dict[str, int] = {}
        for model, _ in list(self.kv.caches):
            out[model] = out.get(model, 0) + 1
        return out

    @property
    def weight_bytes(self) -> int:
        """Bytes of weight tiles held for resident blocks, each tile once."""
        gen, (seen, held) = self._tile_gen, self._tile_bytes
        if seen != gen:
            held = sum(tensor_bytes(t) for tiles in list(self.tiles.values()) for t in list(tiles.values()))
            self._tile_bytes = (gen, held)      # NOTE: a change meanwhile moved the generation: summed again
        return held

    @property
    def resident_bytes(self) -> int:
        """Bytes held for deployed models: weight tiles (each once) and KV caches."""
        return self.weight_bytes + self.kv.nbytes

    def bytes_by_model(self) -> dict[str, int]:
        return {m: sum(tensor_bytes(t) for t in list(ts.values())) for m, ts in list(self.tiles.items())}

    # --- loading -------------------------------------------------------------------------
    def _store(self, model: str, device: torch.device) -> WeightStore:
        with self._lock:
            return self._stores.setdefault((model, device.type), WeightStore(device=device))

    def _forget_stores(self, model: str) -> None:
        """Drop ``model``'s open checkpoint handles (lock held)."""
        for k in [k for k in self._stores if k[0] == model]:
            del self._stores[k]

    def _read_tile(self, spec: BlockSpec, name: str, p: ParamSpec,
                   device: torch.device) -> tuple[torch.Tensor, int]:
        """Read one tile and check it against its reference checksum (re-read once on a mismatch)."""
        want = spec.checksums.get(name)
        got = 0
        for attempt in range(2):
            if attempt:     # NOTE: a fresh handle maps the file again (tiles may share its pages)
                with self._lock:
                    self._forget_stores(spec.model)
            t = self._store(spec.model, device).load(p)
            got = crc32(t)
            if want is None or got == want:
                return t, got
            self.counters["corrupt_tiles"] += 1
            logger.warning("tile %s of model %s read with CRC-32 %d, expected %d: reading again",
                           name, spec.model, got, want)
        raise BadCheckpoint(f"tile {name!r} ({p.source.key}{list(p.source.slices or [])} in "
                            f"{p.source.file}) has CRC-32 {got} twice, expected {want}: the weights on "
                            "disk are corrupt")

    def _check_spec(self, spec: BlockSpec) -> None:
        access.check_model_id(spec.model)
        for source in {(p.source.file, p.source.kind): p.source for p in spec.params.values()}.values():
            access.check_source(source)
        if spec.checkpoint_dir and spec.model not in self.checkpoint_dirs:
            self.checkpoint_dirs[spec.model] = writable(spec.checkpoint_dir, self.address)

    def _will_hold(self, key: tuple[str, str, TileKey]) -> bool:
        """Whether a tile being read (``_loading``) is read for the model's current plan (lock held)."""
        entry = self._loading.get(key)
        return entry is not None and entry[2] >= self.versions.get(key[1], -1)

    def load(self, spec: BlockSpec, keep: bool = True) -> BlockProgram:
        """Compile ``spec`` and load its tiles; resident (counted) when ``keep``.

        Tiles already resident are shared; the others are read outside the lock,
        each checked against its checksum.
        """
        self._check_spec(spec)
        dev = self.device_for(spec)
        with self._lock:
            self._retire(spec.model, spec.version)
            have = self.programs.get((spec.model, spec.index))
            if have is not None and have.spec.version == spec.version:
                return have
            # NOTE: a load still running when its model is released must not bring it back
            keep = keep and spec.version == self.versions.get(spec.model) and spec.model not in self.released
            # NOTE: only tiles on this block's device are shared (a block re-pinned from a CPU device)
            tiles = {k: t for k, t in self.tiles.get(spec.model, {}).items() if t.device.type == dev.type}
            todo = {tile_key(p): (n, p) for n, p in spec.params.items() if tile_key(p) not in tiles}
            # NOTE: a tile another load is reading now is counted once, not once per load
            need = sum(p.nbytes for k, (_, p) in todo.items()
                       if not self._will_hold((dev.type, spec.model, k)))
            # NOTE: caches count too; a tile read for an older plan (dropped when its read ends) does
            # not, nor one another load of it has made resident meanwhile
            held = sum(self.bytes_on(dev)) + sum(
                e[0] for key, e in self._loading.items() if key[0] == dev.type and self._will_hold(key)
                and key[2] not in self.tiles.get(key[1], {}))
            budget = self.budget_for(dev)
            if keep and held + need > budget:
                raise ClusterTooSmall(
                    f"worker {self.address} cannot hold block b{spec.index} of model {spec.model}: it "
                    f"holds {fmt_bytes(held)} of shards, the block needs {fmt_bytes(need)} more, and its "
                    f"budget is {fmt_bytes(budget)} ({held} + {need} > {budget} bytes)")
            mine = [(dev.type, spec.model, k) for k in todo] if keep else []
            for k in mine:
                entry = self._loading.setdefault(k, [todo[k[2]][1].nbytes, 0, spec.version])
                entry[1] += 1
                entry[2] = max(entry[2], spec.version)
        fuse = should_fuse(dev, config.get("lower.fuse-tiles"))
        try:
            read = {k: self._read_tile(spec, n, p, dev) for k, (n, p) in todo.items()}
            if fuse:
                read = _packed(spec, read)
            else:       # NOTE: checked as read; held in the order its matmul runs fastest (lower.layout)
                read = {k: (laid_out(t, spec.layouts.get(todo[k][0])), c) for k, (t, c) in read.items()}
        finally:
            with self._lock:
                for k in mine:
                    entry = self._loading[k]
                    entry[1] -= 1
                    if not entry[1]:
                        del self._loading[k]
        with self._lock:
            keep = keep and spec.version == self.versions.get(spec.model) and spec.model not in self.released
            tiles = self.tiles.setdefault(spec.model, {}) if keep else dict(tiles)
            crcs = self.tile_crc.setdefault(spec.model, {})
            for key, (t, c) in read.items():
                tiles.setdefault(key, t)
                crcs.setdefault(key, c)
            self._tile_gen += 1
            program = BlockProgram.load(spec, lambda p: tiles[tile_key(p)].to(dev), dev, fuse)
            if keep:
                self.programs[(spec.model, spec.index)] = program
        return program

    def program(self, model: str, version: int, block: int, fetch: FetchSpec) -> BlockProgram:
        """The block to run: resident, or loaded now from the spec ``fetch`` returns.

        A block of the current plan that this worker owns becomes resident; any
        other (a request in flight when the plan changed, re-pinned here) is loaded
        for this run only and not counted against the budget.
        """
        have = self.programs.get((model, block))
        if have is not None and have.spec.version == version:
            return have
        spec = BlockSpec.from_dict(fetch(model, version, block))
        owner = spec.address in ("", self.address)
        return self.load(spec, keep=owner and version >= self.versions.get(model, -1))

    def sync(self, owned: Mapping[str, Any], model: str) -> int:
        """Hold what the scheduler says this worker owns of ``model`` (``PlacementState.owned``).

        Loads the blocks of the current version, drops older ones, and forgets a
        released model; returns how many blocks were loaded.
        """
        if owned.get("released"):
            self.release(model)
            return 0
        version = int(owned["version"])
        with self._lock:
            self._retire(model, version)
        n = 0
        for d in owned.get("blocks", ()):
            if model in self.released or self.versions.get(model) != version:
                break
            self.load(BlockSpec.from_dict(d))
            n += 1
        self.counters["prefetched_blocks"] += n
        return n

    # --- integrity -------------------------------------------------------------------------
    def verify(self, program: BlockProgram) -> bool:
        """Check a block's tiles every ``verify_every`` runs; on a mismatch drop the model's tiles.

        Returns False when corruption was found (the block must be loaded again).
        """
        every = program.spec.verify_every
        key = (program.spec.model, program.spec.index)
        self.runs[key] = n = self.runs.get(key, 0) + 1
        if every <= 0 or n % every:
            return True
        crcs = self.tile_crc.get(program.spec.model, {})
        for name, p in program.spec.params.items():
            want = crcs.get(tile_key(p))
            if want is not None and crc32(program.weights[name]) != want:
                self.counters["corrupt_tiles"] += 1
                logger.warning("resident tile %s of model %s is corrupt: dropping the model's tiles on %s "
                               "and reading them again", name, program.spec.model, self.address)
                with self._lock:
                    self._drop(program.spec.model)
                    self._forget_stores(program.spec.model)   # NOTE: tiles may share the file's pages
                return False
        return True

    # --- running ---------------------------------------------------------------------------
    def checkpoint_path(self, model: str, version: int, request: int, block: int) -> Path | None:
        d = self.checkpoint_dirs.get(model)
        if d is None or request < 0:
            return None
        name = f"v{int(version)}-b{int(block)}.safetensors"
        return request_folder(d, access.check_model_id(model), request) / name

    def run(self, model: str, version: int, request: int, block: int, inputs: Mapping[str, torch.Tensor],
            deps: Sequence[Mapping[str, torch.Tensor]],
            fetch: FetchSpec) -> tuple[dict[str, torch.Tensor], str]:
        """One block of one request: ``(outputs, "computed" | "resumed")``.

        Outputs come from an intact checkpoint when there is one; a failed
        checkpoint write is logged and the outputs are returned all the same. A checkpoint is
        written only into its request's folder, which the caller makes when it sends the request
        and deletes when the request returns: a block of an attempt the caller gave up on, or a
        generation step (whose blocks also write KV caches, which a checkpoint would not bring
        back), writes none, and nothing is left behind.
        """
        ckpt = self.checkpoint_path(model, version, request, block)
        if ckpt is not None:
            out, why = load_checkpoint(ckpt)
            if out is not None:
                self.counters["resumed_from_checkpoint"] += 1
                return out, "resumed"
            if why != "missing":
                self.counters["corrupt_checkpoints"] += 1
                logger.warning("checkpoint %s not used (%s): running the block again", ckpt, why)
        program = self.program(model, version, block, fetch)
        if not self.verify(program):
            program = self.program(model, version, block, fetch)
        self._running.device = program.device     # NOTE: KV caches grow in the budget of this device
        try:
            with using(self.kv, model, program.spec.kv_context):
                out = run_block(program, inputs, deps)
        finally:
            self._running.device = None
        self.counters["block_runs"] += 1
        ckpt = ckpt or self.checkpoint_path(model, version, request, block)
        if ckpt is not None:
            self._checkpoint(ckpt, out)
        return out, "computed"

    def _checkpoint(self, path: Path, out: Mapping[str, torch.Tensor]) -> None:
        """Write a block's outputs into its request's folder, if that folder is there (``run``)."""
        try:
            save_checkpoint(path, out, make_folder=False)
            self.counters["checkpoints_written"] += 1
        except (OSError, RuntimeError, ValueError) as e:
            if isinstance(e, FileNotFoundError) and not path.parent.is_dir():
                self.counters["checkpoints_skipped"] += 1      # NOTE: no request folder (see ``run``)
                return
            self.counters["checkpoint_write_failures"] += 1
            logger.warning("checkpoint %s not written (%s): serving without it", path, e)

    # --- forgetting ------------------------------------------------------------------------
    def _retire(self, model: str, version: int) -> None:
        """Note ``version`` as seen; a newer version drops the older blocks (lock held)."""
        if version > self.versions.get(model, -1) and model not in self.released:
            self.versions[model] = version
            self._drop(model)

    def _drop(self, model: str) -> int:
        """Forget ``model``'s blocks and tiles (lock held); returns the tile bytes freed."""
        for k in [k for k in self.programs if k[0] == model]:
            del self.programs[k]
        freed = sum(tensor_bytes(t) for t in self.tiles.pop(model, {}).values())
        self._tile_gen += 1         # NOTE: after the change: a sum read meanwhile is read again
        return freed

    def release(self, model: str) -> int:
        """Drop every block and record of ``model``; returns the bytes freed."""
        with self._lock:
            self.released.add(model)
            freed = self._drop(model) + self.kv.drop(model)
            self.versions.pop(model, None)
            self._forget_stores(model)
            self.tile_crc.pop(model, None)
            self.checkpoint_dirs.pop(model, None)
            for k in [k for k in self.runs if k[0] == model]:
                del self.runs[k]
        return freed

    def clear(self) -> None:
        with self._lock:
            self.programs.clear()
            self.tiles.clear()
            self._tile_gen += 1
            self.kv.clear()
            self._stores.clear()


Read = dict[TileKey, tuple[torch.Tensor, int]]      # tile key -> (tile, CRC-32)


def _packed(spec: BlockSpec, read: Read) -> Read:
    """``read`` with the fresh tiles of each linear group laid end to end in one buffer, each tile
    a view of it, so the block runs the group as one kernel on the weights as they are held."""
    shapes = {n: tuple(p.shape) for n, p in spec.params.items()}
    keys = {n: tile_key(p) for n, p in spec.params.items()}
    packed: set[TileKey] = set()
    for g in linear_groups(spec.ops, shapes):
        for names in (g.weights, g.biases):
            ks = [keys[n] for n in names]
            # NOTE: a tile read before, or shared with another group, stays as it is
            if len(ks) < 2 or len(set(ks)) < len(ks) or any(k not in read or k in packed for k in ks):
                continue
            for k, view in zip(ks, pack_rows([read[k][0] for k in ks])):
                read[k] = (view, read[k][1])
            packed.update(ks)
    return read


def writable(folder: str, where: str = "") -> Path:
    """``folder`` inside the roots and writable here, else ``BadCheckpoint`` naming the folder."""
    import tempfile

    p = access.check_path(folder, "checkpoint folder")
    try:
        p.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=p, prefix=".probe-"):
            pass
    except OSError as e:
        raise BadCheckpoint(f"checkpoint folder {folder} cannot be written{' on ' + where if where else ''}: "
                            f"{e}; choose a folder every worker can write, or no checkpoint_dir") from e
    return p

