"""A worker's resident blocks (``ResidentBlocks``), driven without a cluster."""

from __future__ import annotations

import logging
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import seabiscuit_dask as sb
from seabiscuit_dask.lower.blocks import BlockSpec, block_specs
from seabiscuit_dask.runtime.worker.resident import ResidentBlocks
from seabiscuit_dask.runtime.worker.store import stored

from . import models as M

MODEL = "0123456789abcdef"


class Owner:
    """Keeps the test's weight store alive."""


@pytest.fixture(scope="module")
def blocks():
    model, x = M.gpt2(), M.ids()
    graph = sb.decompose(sb.trace(model, x), "64KiB")
    owner = Owner()
    graph, _ = stored(graph, model, owner)
    spec = sb.ClusterSpec.synthetic("4xcpu", hosts=3, cpu_memory="2MiB")    # no one device holds it
    spec = sb.ClusterSpec(tuple(replace(d, address=f"tcp://h:{i}") for i, d in enumerate(spec.devices)),
                          spec.links)
    plan = sb.place(graph, spec)
    with torch.no_grad():
        expected = model(x).logits
    yield graph, plan, x, expected, owner


def specs_of(plan, checkpoint_dir: str = "") -> list[BlockSpec]:
    return block_specs(plan, MODEL, 0, checkpoint_dir)


def run_all(r: ResidentBlocks, specs: list[BlockSpec], graph, x, request: int = 0) -> torch.Tensor:
    outs: dict[int, dict[str, torch.Tensor]] = {}
    by_index = {s.index: s for s in specs}

    def fetch(model: str, version: int, block: int):
        return by_index[block].to_dict()

    for s in specs:
        outs[s.index], _ = r.run(MODEL, 0, request, s.index, {graph.inputs[0]: x},
                                 [outs[d] for d in s.deps], fetch)
    return next(o[graph.outputs[0]] for o in outs.values() if graph.outputs[0] in o)


def test_blocks_run_from_their_resident_tiles_within_the_budget(blocks) -> None:
    graph, plan, x, expected, _ = blocks
    specs = specs_of(plan)
    r = ResidentBlocks(64 * 2**20)
    for s in specs:
        r.load(s)
    assert r.resident_bytes == sum({(p.source.key, p.source.slices): p.nbytes
                                    for s in specs for p in s.params.values()}.values())
    out = run_all(r, specs, graph, x)
    assert M.rel_err(out, expected) <= 1e-4
    assert r.counters["block_runs"] == len(specs)
    out.mul_(1.0)           # NOTE: blocks compute in inference mode; what they hand out is writable


def test_a_load_past_the_budget_is_refused_with_the_numbers(blocks) -> None:
    _, plan, _, _, _ = blocks
    big = max(specs_of(plan), key=lambda s: s.weight_bytes)
    r = ResidentBlocks(big.weight_bytes - 1, address="tcp://h:0")
    with pytest.raises(sb.ClusterTooSmall, match=rf"tcp://h:0 cannot hold block b{big.index}.*"
                                                 rf"0 \+ {big.weight_bytes} > {big.weight_bytes - 1} bytes"):
        r.load(big)
    assert r.resident_bytes == 0


def test_tiles_still_read_for_an_older_plan_do_not_count_against_the_newer_one(blocks) -> None:
    """A block of plan v0 being read when v1 arrives: its tiles are dropped when the read ends, so
    v1's loads (which read the same tiles again) fit the budget they fit without it."""
    import dataclasses
    import threading

    _, plan, _, _, _ = blocks
    specs = sorted(specs_of(plan), key=lambda s: -s.weight_bytes)
    big, other = specs[0], next(s for s in specs[1:] if s.weight_bytes)
    r = ResidentBlocks(big.weight_bytes + other.weight_bytes + 1024)
    reading, go = threading.Event(), threading.Event()
    read = r._read_tile

    def slow(spec, name, p, device):
        if spec.version == 0:
            reading.set()
            assert go.wait(30)
        return read(spec, name, p, device)

    r._read_tile = slow     # type: ignore[method-assign]
    old = threading.Thread(target=r.load, args=(big,))
    old.start()
    assert reading.wait(30)
    try:
        for s in (big, other):          # NOTE: refused before: v0's tiles in flight counted twice
            r.load(dataclasses.replace(s, version=1))
    finally:
        go.set()
        old.join(30)
    assert r.versions[MODEL] == 1 and r.weight_bytes <= r.budget_bytes
    assert {k[1] for k in r.programs} == {big.index, other.index} and not r._loading


def test_release_forgets_the_model_and_a_late_load_does_not_bring_it_back(blocks) -> None:
    _, plan, _, _, _ = blocks
    specs = [s for s in specs_of(plan) if s.weight_bytes]
    r = ResidentBlocks(64 * 2**20)
    r.load(specs[0])
    assert r.release(MODEL) > 0 and r.resident_bytes == 0
    r.load(specs[1])                      # e.g. a sync that was still running
    assert r.resident_bytes == 0 and not r.programs and not r.runs


def test_sync_holds_what_the_scheduler_says_and_drops_the_rest(blocks) -> None:
    _, plan, _, _, _ = blocks
    specs = specs_of(plan)
    r = ResidentBlocks(64 * 2**20)
    r.load(specs[0])
    newer = [replace(s, version=1) for s in specs[1:3]]
    assert r.sync({"released": False, "version": 1, "blocks": [s.to_dict() for s in newer]}, MODEL) == 2
    assert {k[1] for k in r.programs} == {s.index for s in newer}
    assert r.sync({"released": True, "version": -1, "blocks": []}, MODEL) == 0
    assert r.resident_bytes == 0


def test_a_failed_checkpoint_write_is_logged_and_the_request_served(blocks, tmp_path, caplog) -> None:
    graph, plan, x, expected, _ = blocks
    specs = specs_of(plan, str(tmp_path))
    r = ResidentBlocks(64 * 2**20)
    r.load(specs[0])                                       # the folder is checked here
    (tmp_path / MODEL).write_text("a file where the model's folder should be")
    with caplog.at_level(logging.WARNING):
        got = run_all(r, specs, graph, x)
    assert M.rel_err(got, expected) <= 1e-4
    assert r.counters["checkpoint_write_failures"] == len(specs) and r.counters["checkpoints_written"] == 0
    assert "serving without it" in caplog.text


def test_blocks_checkpoint_only_into_the_folder_their_request_was_sent_with(blocks, tmp_path) -> None:
    """The caller makes a request's folder when it sends it and deletes it when the request returns;
    a block of that request that runs later (an attempt given up on after a worker died) writes no
    checkpoint and makes no folder, so nothing is left behind."""
    graph, plan, x, expected, _ = blocks
    specs = specs_of(plan, str(tmp_path))
    r = ResidentBlocks(64 * 2**20)
    r.load(specs[0])
    sent = tmp_path / MODEL / "r3"
    sent.mkdir(parents=True)
    assert M.rel_err(run_all(r, specs, graph, x, request=3), expected) <= 1e-4
    assert sorted(p.name for p in sent.iterdir()) == sorted(f"v0-b{s.index}.safetensors" for s in specs)
    assert r.counters["checkpoints_written"] == len(specs) and r.counters["checkpoints_skipped"] == 0
    assert M.rel_err(run_all(r, specs, graph, x, request=3), expected) <= 1e-4
    assert r.counters["resumed_from_checkpoint"] == len(specs)
    shutil.rmtree(sent)                   # NOTE: request 3 returned; request 4 was never sent so
    for request in (3, 4):
        assert M.rel_err(run_all(r, specs, graph, x, request=request), expected) <= 1e-4
    assert r.counters["checkpoints_skipped"] == 2 * len(specs)
    assert r.counters["checkpoints_written"] == len(specs) and not r.counters["checkpoint_write_failures"]
    assert [p.name for p in (tmp_path / MODEL).iterdir()] == []


def test_checkpoints_and_weights_must_lie_inside_the_roots(blocks, tmp_path) -> None:
    _, plan, _, _, _ = blocks
    s = next(s for s in specs_of(plan) if s.weight_bytes)
    r = ResidentBlocks(64 * 2**20)
    with pytest.raises(sb.AccessDenied, match="outside the folders SeaBiscuit may use"):
        r.load(replace(s, checkpoint_dir="/etc/seabiscuit-ckpt"))
    p = next(iter(s.params.values()))
    forged = replace(p, source=replace(p.source, file="/etc/passwd"))
    with pytest.raises(sb.AccessDenied, match="weights file '/etc/passwd'"):
        r.load(replace(s, params={p.name: forged}))
    with pytest.raises(sb.AccessDenied, match="not a model id"):
        r.load(replace(s, model="../../etc"))
    assert not Path("/etc/seabiscuit-ckpt").exists()


def test_a_view_no_smaller_than_its_source_is_made_again_by_the_block_that_reads_it() -> None:
    """Each layer's view of the rotary tables (an unsqueeze, an expand) is one another block would
    otherwise send: the block that reads one makes it again from the table it is a view of."""
    from seabiscuit_dask.lower.blocks import _remakes

    model, x = M.llama(), M.ids()
    graph = sb.decompose(sb.trace(model, x), "64KiB")
    owner = Owner()
    graph, _ = stored(graph, model, owner)
    plan = sb.place(graph, sb.ClusterSpec.synthetic("4xcpu", hosts=3, cpu_memory="2MiB"))
    specs = specs_of(plan)
    made_in = {t: b for op, b in zip(graph.ops, plan.block_of.tolist()) for t in op.outputs}
    producer = {t: op for op in graph.ops for t in op.outputs}
    remade = [op for s in specs for op in s.ops if made_in[op.outputs[0]] != s.index]
    assert remade and all(_remakes(graph, op) for op in remade)
    for s in specs:
        imported_views = [t for t in s.imports if t in producer and _remakes(graph, producer[t])]
        assert not imported_views, (s.index, imported_views)
        for i, op in enumerate(s.ops):    # every tensor a block reads is its own, imported or an input
            assert all(t in s.imports or any(t in o.outputs for o in s.ops[:i]) for t in op.inputs)
            # and no view is left that nothing reads (its readers all make it again)
            read = any(t in s.exports or t in later.inputs for later in s.ops[i + 1:] for t in op.outputs)
            assert read or not _remakes(graph, op), (s.index, op.name)
    # a slice is smaller than its source: the block that reads it imports it as before
    sliced = next(op for op in graph.ops if op.target == "aten.slice.Tensor"
                  and graph.tensors[op.outputs[0]].nbytes < graph.tensors[op.inputs[0]].nbytes)
    assert not _remakes(graph, sliced)
    with torch.no_grad():
        expected = model(x).logits
    r = ResidentBlocks(1 << 30)
    r.versions[MODEL] = 0
    assert M.rel_err(run_all(r, specs, graph, x), expected) <= 1e-4
