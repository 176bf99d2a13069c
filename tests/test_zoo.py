"""A fast subset of the model-zoo sweep (``benchmarks/zoo.py``): one architecture or two of each
family, and every op this sweep brought into the registry, traced, cut at two budgets and run
equal to eager torch; an architecture that cannot be taken fails with a typed error."""

from __future__ import annotations

import pytest
import torch

from benchmarks.zoo import ZOO, check

CASES = {c.name: c for c in ZOO}
FAST = [
    "llama", "gpt_neo", "mixtral",   # decoders: detach_ in the local attention; experts gathered
    "deberta-v2", "mpnet",           # encoders: detach_, min.other
    "t5",                            # encoder-decoder: min.other in the relative position buckets
    "mobilenet_v2", "vit",           # vision: padding cut into strips
    "wav2vec2",                      # speech: weight norm cut into strips, pow.Scalar
]


@pytest.mark.parametrize("name", FAST)
def test_an_architecture_is_cut_and_runs_equal_to_eager(name: str) -> None:
    row = check(CASES[name], torch.float32)
    assert row["result"] == "pass", row
    assert row["rel_err"] <= 1e-4 and row["micro_ops"] > row["ops"]


def test_a_bfloat16_model_is_cut_and_runs_equal_to_eager_bfloat16() -> None:
    row = check(CASES["qwen2"], torch.bfloat16)
    assert row["result"] == "pass" and row["dtype"] == "bfloat16", row


def test_an_architecture_that_cannot_be_taken_fails_with_a_typed_error_naming_the_op() -> None:
    row = check(CASES["xlm"], torch.float32)       # NOTE: XLM reads a tensor's value into a Python int
    assert row["result"] == "UnsupportedModel", row
    assert "op 'item'" in row["detail"] and "XLMModel" in row["detail"]
