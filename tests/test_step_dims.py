"""Step programs of any shape (``lower.dims``): one general program per kind (decode, prefill)
is exactly the program traced at each shape it serves, and runs any of them as it would."""

from __future__ import annotations

import pytest
import torch

from seabiscuit_dask.decompose import decompose
from seabiscuit_dask.errors import BadInput
from seabiscuit_dask.ir import thaw
from seabiscuit_dask.lower.dims import Dims, NotGeneral, at_shape, generalize, over_budget, value
from seabiscuit_dask.lower.kvcache import KVStore, using
from seabiscuit_dask.runtime.generation.inputs import step_inputs
from seabiscuit_dask.runtime.local import run_local
from seabiscuit_dask.trace.decoder import trace_step

from .models import llama

DECODE = Dims(8, 1, 8)
PREFILL = Dims(8, 32, 64)


def step(model, rows: int, length: int, budget: str = "16MiB"):
    return decompose(trace_step(model, rows, length), budget)


@pytest.fixture(scope="module")
def model():
    return llama()


@pytest.fixture(scope="module")
def general(model):
    return {True: generalize(step(model, 1, 1), (1, 1), step(model, 2, 1), (2, 1), DECODE),
            False: generalize(step(model, 1, 17), (1, 17), step(model, 2, 19), (2, 19), PREFILL)}


@pytest.mark.parametrize("rows,length", [(3, 1), (8, 1), (1, 5), (3, 12), (2, 32), (8, 8)])
def test_a_general_program_is_the_program_traced_at_each_shape_it_serves(model, general, rows: int,
                                                                         length: int) -> None:
    got = at_shape(general[length == 1], rows, length)
    want = step(model, rows, length)
    assert [op.name for op in got.ops] == [op.name for op in want.ops]
    assert [thaw(op.attrs) for op in got.ops] == [thaw(op.attrs) for op in want.ops]
    assert {n: t.shape for n, t in got.tensors.items()} == {n: t.shape for n, t in want.tensors.items()}
    sized = [op for op in general[length == 1].ops if "sb_dim" in repr(thaw(op.attrs))]
    assert sized and all("sb_valid" in op.inputs for op in sized)    # NOTE: each reads the step's shape


def test_a_general_program_runs_steps_of_new_shapes_as_their_own_programs_do(model, general) -> None:
    """Prefill 3 rows of other lengths, then decode them, with the general programs (sizes read
    at run time) and with programs traced at those shapes: the same logits, bit for bit."""
    prompts = [[5, 9, 14, 2, 7, 1, 3], [11, 4, 8, 12, 6], [2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]]
    outs = []
    for programs in (general, None):
        store, got = KVStore(), []
        feed = step_inputs([(s, 0, p) for s, p in enumerate(prompts)], 3, 11)
        with using(store, "m"):
            g = programs[False] if programs else step(model, 3, 11)
            got.append(run_local(g, *[feed[n] for n in g.inputs], weights=model))
            for k in range(3):
                feed = step_inputs([(s, len(p) + k, [k + 1]) for s, p in enumerate(prompts)], 3, 1)
                g = programs[True] if programs else step(model, 3, 1)
                got.append(run_local(g, *[feed[n] for n in g.inputs], weights=model))
        outs.append(got)
    assert all(torch.equal(a, b) for a, b in zip(*outs))
    ref = model(torch.tensor([prompts[2]])).logits[0, -1]
    torch.testing.assert_close(outs[0][0][2, -1], ref, rtol=1e-4, atol=1e-4)


def test_a_step_past_what_a_general_program_serves_is_refused(model, general) -> None:
    feed = step_inputs([(0, 0, list(range(1, 40)))], 1, 40)
    with using(KVStore(), "m"), pytest.raises(BadInput, match="1 row.*40 token.*past what this program"):
        run_local(general[False], *[feed[n] for n in general[False].inputs], weights=model)


def test_traces_cut_differently_are_not_one_program(model) -> None:
    """At a budget that cuts activations, a longer step is cut into more micro-ops: no general program."""
    with pytest.raises(NotGeneral, match="other ops"):
        generalize(step(model, 1, 17, "64KiB"), (1, 17), step(model, 2, 19, "64KiB"), (2, 19), PREFILL)


def test_a_size_is_the_one_product_of_rows_and_length_both_traces_give(model, general) -> None:
    sizes = [a for op in general[False].ops for a in thaw(op.attrs)["args"][1:2]
             if isinstance(a, list) and any(isinstance(x, dict) for x in a)]
    assert sizes
    for shape in sizes:
        for rows, length in [(1, 17), (2, 19), (4, 9)]:
            got = [value(x, rows, length) if isinstance(x, dict) else x for x in shape]
            assert rows in got or rows * length in got
    with pytest.raises(NotGeneral, match="no product"):
        generalize(*_with_view(step(model, 1, 17), 100), (1, 17), *_with_view(step(model, 2, 19), 333),
                   (2, 19), PREFILL)


def _with_view(graph, n: int):
    """``graph`` with its first view's first size set to ``n``."""
    from seabiscuit_dask.ir import Op, OpGraph

    ops = list(graph.ops)
    i = next(i for i, op in enumerate(ops) if op.target == "aten.view.default")
    args = thaw(ops[i].attrs)
    args["args"][1][0] = n
    op = ops[i]
    ops[i] = Op(op.name, op.kind, op.target, op.inputs, op.outputs, op.params, args, op.scope, op.flops)
    return (OpGraph(tuple(ops), graph.tensors, graph.params, graph.inputs, graph.outputs, graph.meta,
                    graph.tilings),)


def test_a_general_program_past_the_budget_at_its_largest_step_says_which_op(model) -> None:
    a, b = step(model, 1, 17, "1MiB"), step(model, 2, 19, "1MiB")
    wide = Dims(512, 256, 512 * 256)
    over = over_budget(generalize(a, (1, 17), b, (2, 19), wide), a, 1 << 20, wide)
    assert over and over[0][1] > 1 << 20 and over[0][2:] in wide.corners()
    assert not over_budget(generalize(a, (1, 17), b, (2, 19), PREFILL), a, 1 << 20, PREFILL)


def test_the_corners_of_the_shapes_served_are_within_every_bound() -> None:
    assert Dims(64, 1, 32).corners() == [(32, 1)]      # NOTE: a decode program of fewer tokens: fewer rows
    assert Dims(16, 256, 256).corners() == [(1, 256), (16, 16)]
    assert all(r * n <= d.tokens and r <= d.rows and n <= d.length
               for d in (Dims(64, 1, 32), Dims(16, 256, 256), Dims(8, 32, 64)) for r, n in d.corners())
    assert Dims(64, 1, 32).covers(32, 1) and not Dims(64, 1, 32).covers(33, 1)
