"""Building models without their weights.

``build_empty(fn)`` runs a model constructor with every large allocation on the
``meta`` device, keeps the true values of the small non-persistent buffers that
checkpoints do not carry (rotary frequencies, position ids) in
``model.sb_buffers``, and returns the model entirely on ``meta``. A 40 GB model
builds in well under a gigabyte.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from ..errors import UnsupportedModel

_FACTORIES = {torch.empty, torch.zeros, torch.ones, torch.full, torch.rand, torch.randn,
              torch.empty_strided}


class _EmptyWeightsMode(TorchFunctionMode):
    def __init__(self, threshold_bytes: int) -> None:
        super().__init__()
        self.threshold = threshold_bytes

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        if func in _FACTORIES and kwargs.get("device") is None:
            size = args[0] if args and isinstance(args[0], (tuple, list, torch.Size)) else \
                [a for a in args if isinstance(a, int)]
            dtype = kwargs.get("dtype") or torch.get_default_dtype()
            if math.prod(size) * dtype.itemsize >= self.threshold:
                kwargs["device"] = "meta"
        return func(*args, **kwargs)


@contextmanager
def empty_weights(threshold_bytes: int = 1 << 20) -> Iterator[None]:
    """Context manager: allocations of at least ``threshold_bytes`` go to ``meta``.

    Examples
    --------
    >>> with empty_weights():                                    # doctest: +SKIP
    ...     model = LlamaForCausalLM(big_config)   # no RAM for the weights
    """
    with _EmptyWeightsMode(threshold_bytes):
        yield


def load_hf_skeleton(folder: str | os.PathLike[str]) -> torch.nn.Module:
    """The model of a Hugging Face folder (``config.json``) or of a GGUF file's metadata, built without
    its weights."""
    from ..gguf import is_gguf

    if is_gguf(folder):
        return load_gguf_skeleton(folder)
    path = Path(folder)
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise UnsupportedModel(f"{path}: not a model folder (no config.json); pass an "
                               "nn.Module, or a folder saved by save_pretrained")
    try:
        import transformers
    except ImportError as e:  # pragma: no cover - transformers is a dependency
        raise UnsupportedModel("loading a model folder needs the transformers package") from e
    try:
        archs = json.loads(cfg_file.read_text()).get("architectures") or []
        config = transformers.AutoConfig.from_pretrained(str(path))
    except Exception as e:
        raise UnsupportedModel(f"{cfg_file}: cannot be read as a transformers config: {e}") from e
    cls = getattr(transformers, archs[0], None) if archs else None
    if cls is None:
        raise UnsupportedModel(f"{cfg_file}: architecture {archs[:1] or 'missing'} is not a "
                               "transformers model class")
    return build_empty(lambda: cls(config)).eval()


def build_empty(build: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    """Build a model with all its tensors on ``meta``, keeping small buffers' values.

    The values of non-persistent buffers created while building (which no
    checkpoint holds) are kept in ``model.sb_buffers`` for the tracer.
    """
    with empty_weights():
        model = build()
    kept: dict[str, torch.Tensor] = {}
    for prefix, module in model.named_modules():
        for name in getattr(module, "_non_persistent_buffers_set", ()):
            b = module._buffers.get(name)
            if b is not None and not b.is_meta:
                kept[f"{prefix}.{name}" if prefix else name] = b.detach().clone()
    model = model.to("meta")
    model.sb_buffers = kept  # type: ignore[assignment]
    return model


def load_gguf_skeleton(path: str | os.PathLike[str]) -> Any:
    """The causal LM a GGUF file describes, built on the meta device (no weights)."""
    import transformers as tf

    from ..gguf import config_of

    config, _ = config_of(os.fspath(path))
    model: Any = build_empty(lambda: tf.AutoModelForCausalLM.from_config(config)).eval()
    head = model.get_output_embeddings()
    if getattr(config, "tie_word_embeddings", False) and head is not None:
        # NOTE: one tensor in the file (no output.weight): one param, as transformers ties it on load
        head.weight = model.get_input_embeddings().weight
    return model
