"""GGUF files kept quantized: a model's skeleton from a GGUF's metadata, its params bound to the
file's tensors, and tiles read straight from the file's blocks.

``sb.trace`` / ``sb.distribute`` take a ``.gguf`` file as they take a model folder: the model is
built on the meta device from the file's metadata (``transformers`` parses it), and each param
reads its GGUF tensor (``bind_gguf``: ``ParamSource`` kind ``"gguf"``, the tensor's name, and for
llama's attention q and k the heads whose rows llama.cpp stores permuted). A worker reads only the
rows a tile covers, from the file's memory map (``GGUFFile``):

- Q4_0 and Q4_1 blocks (32 weights each, ``d * q + m`` with ``q`` 0..15, ``m = -8 d`` for Q4_0) become
  the int4 tiles of ``quantize="int4"`` (groups of 32) exactly: the same integers, a scale ``d`` and
  the value of 8 ``m + 8 d``, each rounded to bf16 (``int4_rows``); no float copy of them exists;
- any other type (Q8_0, K-quants, F16, F32) is de-quantized row by row (the ``gguf`` package's
  ``dequantize``) where a tile reads it, and quantized as the deployment's scheme says (Q8_0 tables
  and heads to int8 per row: the GGUF's integers are not kept; ``quantize.py``).

A GGUF is data: a tensor is found by its name in the file's own table, within its stored shape.
"""

from __future__ import annotations

import functools
import os
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .errors import BadCheckpoint, UnsupportedModel
from .ir import OpGraph, ParamSource, ParamSpec

EXACT_INT4 = ("Q4_0", "Q4_1")
"""GGUF types whose blocks are int4 tiles of groups of 32 as they are."""
GROUP = 32


def is_gguf(path: Any) -> bool:
    return isinstance(path, (str, os.PathLike)) and os.fspath(path).endswith(".gguf") \
        and os.path.isfile(os.fspath(path))


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF file: its type's name and its ``[rows, columns]`` (a 1-D tensor: one row)."""

    name: str
    type: str
    shape: tuple[int, ...]


class GGUFFile:
    """A GGUF file's tensor table and rows (memory-mapped: a read touches only the rows it takes)."""

    def __init__(self, path: str) -> None:
        try:
            import gguf
        except ImportError as e:     # pragma: no cover - an extra of the package
            raise UnsupportedModel("reading a GGUF file needs the gguf package (pip install gguf)") from e
        self.path = path
        try:
            self.reader = gguf.GGUFReader(path)
        except Exception as e:
            raise BadCheckpoint(f"{path}: cannot be read as GGUF: {e}") from e
        self._gguf = gguf
        self.tensors = {t.name: t for t in self.reader.tensors}

    def info(self, name: str) -> GGUFTensor:
        t = self._tensor(name)
        return GGUFTensor(name, t.tensor_type.name, tuple(int(d) for d in reversed(t.shape.tolist())))

    def _tensor(self, name: str) -> Any:
        t = self.tensors.get(name)
        if t is None:
            raise BadCheckpoint(f"{self.path}: no tensor {name!r} (it has {len(self.tensors)}, e.g. "
                                f"{', '.join(list(self.tensors)[:4])})")
        return t

    def _raw(self, name: str, rows: tuple[int, int], heads: int) -> tuple[Any, np.ndarray]:
        """The stored bytes (or values) of a tensor's rows ``[a, b)`` as the model numbers them."""
        t = self._tensor(name)
        n = int(t.shape[-1]) if len(t.shape) > 1 else 1
        if not (0 <= rows[0] <= rows[1] <= n):
            raise BadCheckpoint(f"{self.path}: rows {rows[0]}:{rows[1]} of {name!r} are outside its {n} rows")
        data = t.data if len(t.shape) > 1 else t.data.reshape(1, -1)
        index = stored_rows(n, heads)[rows[0]:rows[1]] if heads else slice(*rows)
        return t, np.asarray(data[index])

    def rows(self, name: str, rows: tuple[int, int], heads: int = 0,
             cols: tuple[int, int] | None = None) -> torch.Tensor:
        """Rows ``[a, b)`` (and columns ``[c, d)``) de-quantized to float32 (a 1-D tensor: its one
        row). Only the blocks the columns lie in are de-quantized."""
        t, raw = self._raw(name, rows, heads)
        k = int(t.shape[0])
        c0, c1 = cols if cols is not None else (0, k)
        if not (0 <= c0 <= c1 <= k):
            raise BadCheckpoint(f"{self.path}: columns {c0}:{c1} of {name!r} are outside its {k} columns")
        block, size = self._gguf.GGML_QUANT_SIZES[t.tensor_type]
        if raw.dtype == np.uint8 and raw.shape[-1] != k:      # NOTE: ``block`` columns in ``size`` bytes
            b0, b1 = c0 // block, -(-c1 // block)
            raw, c0, c1 = raw[:, b0 * size:b1 * size], c0 - b0 * block, c1 - b0 * block
        else:
            raw, c0, c1 = raw[:, c0:c1], 0, c1 - c0
        values = np.array(self._gguf.quants.dequantize(raw, t.tensor_type), dtype=np.float32)   # NOTE: owned
        values = values.reshape(raw.shape[0], -1)[:, c0:c1]
        return torch.from_numpy(np.ascontiguousarray(values))

    def int4_rows(self, name: str, rows: tuple[int, int], cols: tuple[int, int],
                  heads: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """A Q4_0 / Q4_1 tensor's rows ``[a, b)`` and columns ``[c, d)`` (whole blocks of 32) as
        (integers 0..15 ``[b - a, d - c]`` uint8, bf16 ``[(d - c) / 32, b - a, 2]`` scales and values of
        8), the form ``quantize.quantize_groups`` gives: ``w = (q - 8) * d + (m + 8 d)``."""
        t, raw = self._raw(name, rows, heads)
        kind = t.tensor_type.name
        if kind not in EXACT_INT4 or cols[0] % GROUP or cols[1] % GROUP:
            raise BadCheckpoint(f"{self.path}: {name!r} is {kind}, columns {cols[0]}:{cols[1]}: int4 tiles "
                                f"are read from {' or '.join(EXACT_INT4)} blocks of {GROUP} columns")
        size = 20 if kind == "Q4_1" else 18
        blocks = raw.reshape(raw.shape[0], -1, size)[:, cols[0] // GROUP:cols[1] // GROUP]
        d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32) if kind == "Q4_1" else -8 * d
        qs = blocks[..., size - 16:]
        q = np.concatenate([qs & 15, qs >> 4], axis=-1).reshape(raw.shape[0], -1)     # NOTE: ggml's order
        scale = torch.from_numpy(np.ascontiguousarray(d)).to(torch.bfloat16)
        zero = torch.from_numpy(np.ascontiguousarray(m + 8 * d)).to(torch.bfloat16)
        sz = torch.stack([scale, zero], dim=2).transpose(0, 1).contiguous()
        return torch.from_numpy(np.ascontiguousarray(q)), sz


FOUR_BIT = ("Q4_0", "Q4_1", "Q4_K", "IQ4_NL", "IQ4_XS", "Q3_K", "Q2_K", "IQ3_S", "IQ3_XXS", "IQ2_S",
            "IQ2_XS", "IQ2_XXS", "IQ1_S", "IQ1_M", "TQ1_0", "TQ2_0")
"""GGUF types of 4 bits a weight or fewer: a file of them is kept as int4 tiles."""
FLOAT_TYPES = ("F32", "F16", "BF16", "F64")


@dataclass(frozen=True)
class Kept:
    """How a GGUF's weights are held when it is served as it is (``kept_scheme``): the scheme, how many
    tensors are int4 tiles as the file's own blocks, and each quantized type held otherwise (de-quantized
    and quantized again), with its tensor count."""

    scheme: str | None
    blocks: int
    requantized: tuple[tuple[str, int], ...]

    def notice(self, file: str) -> str:
        """One line naming what is not held as the file holds it ("" when all is)."""
        if not self.requantized:
            return ""
        kinds = ", ".join(f"{k} ({n} tensor{'s' if n > 1 else ''})" for k, n in self.requantized)
        if self.scheme == "int4":
            how = "int4 (linear) or int8 per row (embeddings, heads, weights not in whole 64-row blocks)"
        else:
            how = "int8 per row" if self.scheme == "int8" else "float32"
        return f"{os.path.basename(file)}: {kinds} de-quantized and held as {how}, not as the file's blocks"


def kept_scheme(path: str) -> Kept:
    """The scheme that keeps a GGUF's weights quantized: ``"int4"`` when most of its layers' 2-D
    weights take 4 bits or fewer (Q4_0 / Q4_1 blocks of linear weights in whole 64-row blocks are then
    its tiles as they are; tables and heads are int8, as ``quantize.py`` holds them), ``"int8"``
    when they take 5 to 8 bits (Q5_*, Q6_K, Q8_0), None when they are floats; with the quantized
    types that scheme de-quantizes and quantizes again (a notice names them)."""
    f = open_gguf(path)
    flat = [t for t in f.reader.tensors if len(t.shape) > 1]
    layers = [t.tensor_type.name for t in flat if t.name.startswith("blk.")] or \
        [t.tensor_type.name for t in flat]
    counts: dict[str, int] = {}
    for k in layers:
        counts[k] = counts.get(k, 0) + 1
    most = max(counts, key=lambda k: counts[k]) if counts else "F32"
    scheme = None if most in FLOAT_TYPES else "int4" if most in FOUR_BIT else "int8"
    blocks = 0
    again: dict[str, int] = {}
    for t in flat:
        kind = t.tensor_type.name
        cols, rows = (int(d) for d in t.shape.tolist()[:2])      # NOTE: stored columns first
        if scheme == "int4" and kind in EXACT_INT4 and rows % 64 == 0 and cols % GROUP == 0 \
                and t.name not in ("token_embd.weight", "output.weight"):
            blocks += 1
        elif kind not in FLOAT_TYPES:
            again[kind] = again.get(kind, 0) + 1
    return Kept(scheme, blocks, tuple(sorted(again.items())))


def stored_rows(n: int, heads: int) -> np.ndarray:
    """Which stored row each of a llama attention q or k weight's ``n`` rows is: llama.cpp stores
    each head's rotary pairs interleaved (``transformers`` undoes it the same way on load)."""
    dim = n // heads // 2
    return np.arange(n).reshape(heads, dim, 2).swapaxes(1, 2).reshape(n)


_files: dict[tuple[str, int, int, int], GGUFFile] = {}
_files_lock = threading.Lock()


def open_gguf(path: str) -> GGUFFile:
    """The ``GGUFFile`` of ``path``, opened once a process for each version of the file (by inode, size
    and modification time: a file replaced at the same path is read afresh, never at stale offsets)."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise BadCheckpoint(f"GGUF file {path!r} cannot be read: {e}") from e
    key = (path, st.st_ino, st.st_size, st.st_mtime_ns)
    f = _files.get(key)
    if f is None:
        f = GGUFFile(path)           # NOTE: parsed outside the lock; the first one kept
        with _files_lock:
            for old in [k for k in _files if k[0] == path and k != key]:
                del _files[old]
            f = _files.setdefault(key, f)
    return f


def config_of(path: str) -> tuple[Any, Any]:
    """(transformers config, its GGUF tensor processor) of a GGUF file's metadata, read once for each
    version of the file (its tokenizer's fields take seconds to parse)."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise BadCheckpoint(f"GGUF file {path!r} cannot be read: {e}") from e
    return _config(path, st.st_ino, st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _config(path: str, *version: int) -> tuple[Any, Any]:
    import transformers as tf
    from transformers import modeling_gguf_pytorch_utils as gu

    try:
        parsed = gu.load_gguf_checkpoint(path, return_tensors=False)
        config = tf.AutoConfig.for_model(**parsed["config"])
    except Exception as e:
        raise UnsupportedModel(f"{path}: transformers cannot read its architecture: {e}") from e
    arch = str(gu.read_field(open_gguf(path).reader, "general.architecture")[0])
    return config, gu.TENSOR_PROCESSORS.get(arch, gu.TensorProcessor)(config=parsed.get("config", {}))


def not_in_place(path: str) -> str:
    """Why a GGUF file cannot be read in place ("" when it can): transformers changes the tensors of
    some architectures on load (gemma's norms, bloom's fused qkv, ...), and only llama's permuted rows
    are read here as transformers reads them."""
    from transformers import modeling_gguf_pytorch_utils as gu

    _, processor = config_of(path)
    if type(processor) in (gu.TensorProcessor, gu.LlamaTensorProcessor):
        return ""
    return f"transformers' {type(processor).__name__} changes its tensors on load"


_MAPS: dict[tuple[Any, ...], dict[str, tuple[str, int]]] = {}
_MAPS_KEPT = 8


def weights_map(path: str, model: torch.nn.Module | None = None) -> dict[str, tuple[str, int]]:
    """HF param name -> (GGUF tensor name, heads whose rows are stored permuted, or 0). Made once for
    each version of the file and each model class and set of names (transformers takes 4 s to make it
    for SmolLM2, and every step program a deployment traces binds to the file again)."""
    from transformers import modeling_gguf_pytorch_utils as gu

    config, processor = config_of(path)
    try:
        st = os.stat(path)
    except OSError as e:
        raise BadCheckpoint(f"GGUF file {path!r} cannot be read: {e}") from e
    # NOTE: no model: the file's own architecture's names (its skeleton made only when not known yet)
    whose = (type(model).__qualname__, tuple(model.state_dict(keep_vars=True))) if model is not None else ()
    key = (path, st.st_ino, st.st_size, st.st_mtime_ns, *whose)
    with _files_lock:
        known = _MAPS.get(key)
    if known is not None:
        return dict(known)
    if model is None:
        import transformers as tf

        with torch.device("meta"):
            model = tf.AutoModelForCausalLM.from_config(config)
    out = _weights_map(path, model, config, processor, gu)
    with _files_lock:
        while len(_MAPS) >= _MAPS_KEPT:
            del _MAPS[next(iter(_MAPS))]
        _MAPS[key] = out
    return dict(out)


def _weights_map(path: str, model: torch.nn.Module, config: Any, processor: Any,
                 gu: Any) -> dict[str, tuple[str, int]]:
    to_hf = gu.get_gguf_hf_weights_map(model, processor)
    permuted = type(processor).__name__ == "LlamaTensorProcessor"
    why = not_in_place(path)
    if why:
        raise UnsupportedModel(f"{path}: {why}, in ways SeaBiscuit does not read in place; serve it "
                               "de-quantized (--dequantize), or load it with transformers and pass the "
                               "module")
    out: dict[str, tuple[str, int]] = {}
    for g, hf in to_hf.items():
        heads = 0
        # NOTE: llama.cpp permutes q and k (weights' rows, biases' elements) per head
        if permuted and ".attn_q." in g:
            heads = config.num_attention_heads
        elif permuted and ".attn_k." in g:
            heads = config.num_key_value_heads or config.num_attention_heads
        out[hf] = (g, heads)
    return out


def bind_gguf(graph: OpGraph, path: str | os.PathLike[str], kinds: tuple[str, ...] = ("model", "safetensors"),
              model: torch.nn.Module | None = None) -> OpGraph:
    """``graph`` with each param of ``kinds`` reading its tensor of the GGUF file at ``path`` (by its
    name, a tied alias, or the file's map of names), checked against the tensor's stored shape;
    ``BadCheckpoint`` lists what is missing or of another shape."""
    file = os.path.abspath(os.fspath(path))
    table = open_gguf(file)
    names = weights_map(file, model)
    aliases: dict[str, Any] = dict(graph.meta.get("aliases", {}))
    full_shapes = {k: tuple(v) for k, v in graph.meta.get("param_shapes", {}).items()}
    params: dict[str, ParamSpec] = {}
    missing: list[str] = []
    mismatched: list[str] = []
    for name, p in graph.params.items():
        src = p.source
        if src.kind not in kinds:
            params[name] = p
            continue
        hit = next((names[k] for k in (src.key, *aliases.get(src.key, ())) if k in names
                    and names[k][0] in table.tensors), None)
        if hit is None:
            missing.append(src.key)
            continue
        info = table.info(hit[0])
        whole: tuple[int, ...] = tuple(src.whole or ()) if src.quant is not None \
            else tuple(full_shapes.get(src.key, p.shape))
        if whole != info.shape:
            mismatched.append(f"{src.key}: GGUF {hit[0]} {list(info.shape)}, model {list(whole)}")
            continue
        params[name] = ParamSpec(name, p.shape, p.dtype,
                                 ParamSource("gguf", hit[0], src.slices, file, quant=src.quant,
                                             whole=src.whole, heads=hit[1]))
    if missing or mismatched:
        parts = []
        if missing:
            uniq = sorted(set(missing))
            parts.append(f"{len(uniq)} key(s) missing: {', '.join(uniq[:5])}"
                         + (" ..." if len(uniq) > 5 else ""))
        if mismatched:
            uniq = sorted(set(mismatched))
            parts.append(f"{len(uniq)} shape mismatch(es): {'; '.join(uniq[:5])}")
        raise BadCheckpoint(f"GGUF {file} does not match {graph.meta.get('name', 'the model')}: "
                            + "; ".join(parts))
    return OpGraph(graph.ops, graph.tensors, params, graph.inputs, graph.outputs,
                   {**dict(graph.meta), "checkpoint": file}, graph.tilings)


def load(spec: ParamSpec) -> torch.Tensor:
    """A float param (or tile) of kind ``"gguf"``: its rows, and of them the blocks its columns lie in,
    de-quantized (a column tile of a large table never holds whole rows in float), its columns cut."""
    src = spec.source
    f = open_gguf(src.file or "")
    info = f.info(src.key)
    if len(info.shape) not in (1, 2):
        raise UnsupportedModel(f"{f.path}: {src.key!r} has {len(info.shape)} dims {list(info.shape)}; "
                               "SeaBiscuit reads GGUF tensors of 1 or 2 dims (no stacked experts)")
    if len(info.shape) == 1:
        span = src.slices[0] if src.slices is not None else (0, info.shape[0])
        if src.heads:           # NOTE: a q or k bias: its elements stored permuted per head
            return f.rows(src.key, (0, 1))[0, stored_rows(info.shape[0], src.heads)][span[0]:span[1]]
        return f.rows(src.key, (0, 1), 0, span)[0]
    rows = src.slices[0] if src.slices is not None else (0, info.shape[0])
    cols = src.slices[1] if src.slices is not None and len(src.slices) > 1 else None
    return f.rows(src.key, rows, src.heads, cols)
