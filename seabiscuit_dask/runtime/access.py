"""What an RPC may name: ids SeaBiscuit issued, its deployer's token, paths inside roots, real budgets.

RPC payloads are data from any peer of the cluster. Model ids are issued by the
scheduler at deploy (16 hex digits) and a token goes back to the deploying
client only; paths (weight files, checkpoint folders) must lie inside the
folders of config ``seabiscuit.roots`` (plus the system's temporary folder, the
template cache and the configured store and checkpoint folders); a budget must
be one the machine can have.
"""

from __future__ import annotations

import hmac
import os
import re
import secrets
import tempfile
from pathlib import Path
from typing import Any

from .. import config
from ..errors import AccessDenied
from ..ir import OpGraph, ParamSource, fmt_bytes

MODEL_ID = re.compile(r"[0-9a-f]{16}")


def new_model_id(key: str) -> str:
    """A model id: 8 random hex digits and 8 of their HMAC under ``key`` (the one the workers hold:
    ``issued``), so a worker tells an id the scheduler issued from a made-up one without asking."""
    nonce = secrets.token_hex(4)
    return nonce + _signature(key, nonce)


def issued(model: str, key: str) -> bool:
    """Whether ``model`` (of the form ``check_model_id`` checks) was issued under ``key``."""
    return hmac.compare_digest(model[8:], _signature(key, model[:8]))


def _signature(key: str, nonce: str) -> str:
    return hmac.new(key.encode(), f"model:{nonce}".encode(), "sha256").hexdigest()[:8]


def new_token() -> str:
    return secrets.token_hex(16)


def check_model_id(model: Any) -> str:
    """``model`` if it has the form of an id SeaBiscuit issues, else ``AccessDenied``."""
    if not isinstance(model, str) or not MODEL_ID.fullmatch(model):
        raise AccessDenied(f"{model!r} is not a model id SeaBiscuit issued (16 hex digits, from deploy)")
    return model


def same_token(expected: str, given: Any) -> bool:
    return bool(expected) and isinstance(given, str) and hmac.compare_digest(expected, given)


def peer_proof(key: str, nonce: str, sender: str, receiver: str) -> str:
    """What worker ``sender`` shows ``receiver`` to open a data-plane stream: an HMAC, under the key
    the scheduler plugin gives only its workers, of the receiver's fresh ``nonce`` and both
    addresses (so it proves nothing to another worker, nor a second time)."""
    return hmac.new(key.encode(), f"{nonce}|{sender}|{receiver}".encode(), "sha256").hexdigest()


def roots() -> list[Path]:
    """Folders SeaBiscuit may read weights from and write checkpoints to, resolved."""
    found = [tempfile.gettempdir(), config.cache_dir(), *(config.get("roots") or [])]
    for key in ("runtime.store-directory", "checkpoint.directory"):
        if config.get(key):
            found.append(config.get(key))
    return [Path(os.fspath(r)).expanduser().resolve() for r in dict.fromkeys(map(str, found))]


def check_path(path: Any, what: str) -> Path:
    """``path`` resolved, if it lies inside one of ``roots()``; else ``AccessDenied`` saying what to do."""
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise AccessDenied(f"{what} must be a path, got {path!r}")
    p = Path(os.fspath(path)).expanduser().resolve()
    allowed = roots()
    if not any(p == r or p.is_relative_to(r) for r in allowed):
        raise AccessDenied(f"{what} {os.fspath(path)!r} is outside the folders SeaBiscuit may use "
                           f"({', '.join(map(str, allowed))}); add its folder to the config list "
                           "`seabiscuit.roots` of the scheduler and workers (e.g. "
                           "DASK_SEABISCUIT__ROOTS='[\"/data/models\"]') or move it inside one")
    return p


def check_source(source: ParamSource) -> None:
    """A param's weights file lies inside the roots; a ``raw`` one (bytes at an offset, no header
    to check) must be an ONNX model's external data: its folder, or one of the three above it
    that is not itself a root, holds an ``.onnx`` file. So a payload cannot read arbitrary bytes
    of other files there."""
    if not source.file:
        return
    p = check_path(source.file, "weights file")
    if source.kind != "raw":
        return
    tops = set(roots())
    for folder in p.parents[:4]:
        if folder in tops or not any(folder.is_relative_to(r) for r in tops):
            break
        if any(folder.glob("*.onnx")):
            return
    raise AccessDenied(f"weights file {source.file!r} is read as raw bytes, which only an ONNX model's "
                       "external data may be: no folder holding it has an .onnx model; load the model "
                       "with sb.trace / sb.distribute from its .onnx file")


def check_graph_paths(graph: OpGraph) -> None:
    """Every weight file the graph names lies inside the roots (``check_source``)."""
    seen: set[tuple[str, str]] = set()
    for p in graph.params.values():
        if p.source.file and (p.source.file, p.source.kind) not in seen:
            seen.add((p.source.file, p.source.kind))
            check_source(p.source)


def check_budget(memory_bytes: Any, machine_bytes: int, where: str) -> int:
    """A positive byte count no larger than the machine's memory."""
    if isinstance(memory_bytes, bool) or not isinstance(memory_bytes, int) or memory_bytes <= 0:
        raise AccessDenied(f"budget for {where} must be a positive byte count, got {memory_bytes!r}")
    if machine_bytes and memory_bytes > machine_bytes:
        raise AccessDenied(f"budget for {where} of {fmt_bytes(memory_bytes)} ({memory_bytes} bytes) is more "
                           f"than the machine has ({fmt_bytes(machine_bytes)}, {machine_bytes} bytes)")
    return memory_bytes


def readable(folders: list[str]) -> Any:
    """A config context in which an embedded cluster may read these model folders (added to
    ``seabiscuit.roots``: set it before the cluster starts, its workers inherit it)."""
    import dask.config

    have = list(config.get("roots") or [])
    tops = [os.path.dirname(os.path.abspath(f)) if os.path.isfile(f) else os.path.abspath(f) for f in folders]
    more = [t for t in dict.fromkeys(tops) if t not in have]
    return dask.config.set({"seabiscuit.roots": have + more})
