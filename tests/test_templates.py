"""Templates: one trace and decomposition serve every parameter set of an architecture."""

from __future__ import annotations

import dask.config
import torch
import torch.nn as nn

import seabiscuit_dask as sb
from seabiscuit_dask import config, templates

from . import models as M


def test_same_architecture_other_weights_reuses_the_template() -> None:
    x = M.ids()
    a, b = M.gpt2(seed=0), M.gpt2(seed=1)
    misses = templates.stats["misses"]
    ga = sb.decompose(sb.trace(a, x), "64KiB")
    assert templates.stats["misses"] == misses + 2            # one trace, one decomposition
    hits = templates.stats["memory_hits"]
    gb = sb.decompose(sb.trace(b, x), "64KiB")
    assert templates.stats["memory_hits"] == hits + 2
    assert gb is ga
    with torch.no_grad():
        ya, yb = a(x).logits, b(x).logits
    assert M.rel_err(sb.run_local(ga, x, weights=a).logits, ya) <= 1e-4
    assert M.rel_err(sb.run_local(gb, x, weights=b).logits, yb) <= 1e-4
    assert M.rel_err(ya, yb) > 1e-2                            # the weights really differ


def test_templates_survive_the_process_on_disk() -> None:
    x = M.ids()
    g = sb.decompose(sb.trace(M.llama(), x), "64KiB")
    files = list((config.cache_dir() / "templates").glob("*.json"))
    assert len(files) == 2
    templates.clear_memory()
    disk = templates.stats["disk_hits"]
    again = sb.decompose(sb.trace(M.llama(seed=3), x), "64KiB")
    assert templates.stats["disk_hits"] == disk + 2
    assert again == g


def test_other_shapes_or_architectures_are_traced_afresh() -> None:
    g4 = sb.trace(M.gpt2(), M.ids(seq=4))
    g6 = sb.trace(M.gpt2(), M.ids(seq=6))
    assert g4.meta["template_key"] != g6.meta["template_key"]
    assert sb.trace(M.llama(), M.ids()).meta["template_key"] != g4.meta["template_key"]


def test_damaged_cache_file_is_ignored() -> None:
    x = M.ids()
    g = sb.trace(M.bert(), x)
    for f in (config.cache_dir() / "templates").glob("*.json"):
        f.write_text("{broken")
    templates.clear_memory()
    assert sb.trace(M.bert(), x) == g


def test_cache_can_be_disabled() -> None:
    with dask.config.set({"seabiscuit.cache.enabled": False}):
        sb.trace(M.bert(), M.ids())
    assert not (config.cache_dir() / "templates").exists()


def test_module_settings_missing_from_repr_change_the_key() -> None:
    x = torch.randn(1, 1, 8, 8)
    a = sb.trace(nn.AvgPool2d(3, 2, 1), (x,))
    b = sb.trace(nn.AvgPool2d(3, 2, 1, count_include_pad=False), (x,))
    assert a.meta["template_key"] != b.meta["template_key"]
    model = nn.AvgPool2d(3, 2, 1, count_include_pad=False)
    assert torch.equal(sb.run_local(b, x, weights=model), model(x))


class _Calls(nn.Module):
    """Its forward reads a function and a plain tensor attribute (no buffer): both are baked
    into a trace, and neither shows in its repr."""

    def __init__(self, fn, scale: torch.Tensor) -> None:
        super().__init__()
        self.fn, self.scale = fn, scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x) * self.scale


def test_functions_and_tensor_attributes_change_the_key() -> None:
    x = torch.randn(4, 8)
    one = torch.ones(8)
    models = [_Calls(torch.relu, one), _Calls(torch.tanh, one), _Calls(lambda t: t + 1, one),
              _Calls(lambda t: t - 1, one), _Calls(torch.relu, 2 * one)]
    graphs = [sb.trace(m, (x,)) for m in models]
    assert len({g.meta["template_key"] for g in graphs}) == len(models)
    for g, m in zip(graphs, models):                # each runs as its own module, none as another's
        torch.testing.assert_close(sb.run_local(g, x, weights=m), m(x))
    again = sb.trace(_Calls(torch.relu, torch.ones(8)), (x,))      # equal values: the same template
    assert again.meta["template_key"] == graphs[0].meta["template_key"]


def test_other_tracing_or_decomposition_code_makes_new_templates(monkeypatch) -> None:
    """A template is reused only by the code that made it: an op kind or rule changed within one
    version must not be answered from a cache written before the change."""
    x = M.ids()
    g = sb.decompose(sb.trace(M.gpt2(), x), "256KiB")
    monkeypatch.setattr(templates, "_tracer_hash", lambda: "another tracer")
    traced = sb.trace(M.gpt2(), x)
    monkeypatch.undo()
    assert traced.meta["template_key"] != sb.trace(M.gpt2(), x).meta["template_key"]
    monkeypatch.setattr(templates, "_decomposer_hash", lambda: "other rules")
    assert sb.decompose(sb.trace(M.gpt2(), x), "256KiB").meta["template_key"] != g.meta["template_key"]
