"""Spatial strips with halos: convolutions and pooling whose activations are many times the
budget decompose into strips that fit, and give the model's results."""

from __future__ import annotations

import math
import re

import dask.config
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import seabiscuit_dask as sb
from seabiscuit_dask.decompose import Decomposer, bounds_for
from seabiscuit_dask.decompose.rules import conv, pool
from seabiscuit_dask.decompose.rules.conv import Window
from seabiscuit_dask.ir import verify
from seabiscuit_dask.lower.kernels import KERNELS

BUDGET = 64 * 1024


def seeded(model: nn.Module) -> nn.Module:
    """``model`` in eval mode, batch norms given running statistics that are not the identity."""
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.running_mean.uniform_(-1, 1)
            m.running_var.uniform_(0.5, 2)
    return model.eval()


class Net2d(nn.Module):
    """Padding, stride, dilation, groups, "same"/"valid", batch norm, ReLU, max and avg pools."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(1, 6, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(6)
        self.smooth = nn.AvgPool2d(3, stride=1, padding=1)          # count_include_pad
        self.mp = nn.MaxPool2d(3, stride=2, padding=1)
        self.c2 = nn.Conv2d(6, 16, 3, padding=2, dilation=2, groups=2)
        self.c3 = nn.Conv2d(16, 16, 5, padding="same", groups=16)
        self.c4 = nn.Conv2d(16, 8, 3, stride=2, padding="valid")
        self.ap = nn.AvgPool2d(2, divisor_override=3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn1(self.c1(x)))
        x = self.mp(self.smooth(x) + x)
        x = self.c3(torch.relu(self.c2(x)))
        return self.ap(self.c4(x))


class Net1d(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv1d(1, 16, 5, padding=2)
        self.mp = nn.MaxPool1d(3, stride=2, padding=1, ceil_mode=True)
        self.ap = nn.AvgPool1d(3, stride=1, padding=1)
        self.c2 = nn.Conv1d(16, 16, 4, padding="same")      # pads one before, two after
        self.c3 = nn.Conv1d(16, 8, 4, stride=3, dilation=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c3(self.c2(self.ap(self.mp(torch.relu(self.c1(x))))))


class Net3d(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv3d(1, 8, 3, padding=1)
        self.bn = nn.BatchNorm3d(8)
        self.mp = nn.MaxPool3d(2)
        self.c2 = nn.Conv3d(8, 4, 3, padding=(0, 1, 1), stride=(1, 2, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c2(self.mp(torch.relu(self.bn(self.c1(x)))))


def decomposed(model: nn.Module, x: torch.Tensor, budget: int = BUDGET) -> sb.OpGraph:
    """``model`` traced and cut at ``budget`` (at most a quarter of its largest activation);
    every micro-op fits and the result is the model's."""
    graph = sb.trace(model, (x,))
    assert max(t.nbytes for t in graph.tensors.values()) >= 4 * budget
    micro = sb.decompose(graph, budget)
    verify(micro, budget)
    with torch.no_grad():
        expected = model(x)
    torch.testing.assert_close(sb.run_local(micro, x, weights=model), expected, rtol=1e-4, atol=1e-5)
    return micro


def targets(graph: sb.OpGraph) -> set[str]:
    return {op.target for op in graph.ops}


def test_conv_net_2d_in_strips_fits_and_is_exact() -> None:
    g = decomposed(seeded(Net2d()), torch.randn(1, 1, 96, 128))
    assert {"sb.conv_strip", "sb.max_pool_strip", "sb.avg_pool_strip"} <= targets(g)
    assert any(op.kind == "norm" and ".s" in op.name for op in g.ops)   # batch norm in strips too


@pytest.mark.parametrize("model, shape", [(Net1d, (1, 1, 4096)), (Net3d, (1, 1, 8, 32, 32))])
def test_conv_nets_1d_and_3d_in_strips(model, shape) -> None:
    g = decomposed(seeded(model()), torch.randn(*shape))
    assert "sb.conv_strip" in targets(g)   # pools may go by channels, aligned with the conv tiles


def test_strips_too_big_for_their_weights_are_cut_again_by_channels() -> None:
    model = nn.Sequential(nn.Conv2d(1, 64, 3, padding=1), nn.ReLU(), nn.Conv2d(64, 64, 3, padding=1))
    g = decomposed(model.eval(), torch.randn(1, 1, 32, 32))
    strips = [op.name for op in g.ops if op.target == "sb.conv_strip"]
    recut = [n for n in strips if re.search(r"\.s\d+\.[ci]\d+$", n)]
    assert recut, "no strip was cut again by the channels of its weight"


def test_avg_pool_not_counting_padding_is_not_cut_in_strips() -> None:
    model = nn.Sequential(nn.Conv2d(1, 16, 1), nn.AvgPool2d(3, stride=1, padding=1, count_include_pad=False))
    g = decomposed(model.eval(), torch.randn(1, 1, 32, 64), budget=32 * 1024)
    assert "sb.avg_pool_strip" not in targets(g)


def test_adaptive_pools_are_left_to_channel_strips() -> None:
    model = nn.Sequential(nn.Conv2d(1, 16, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten())
    g = decomposed(model.eval(), torch.randn(1, 1, 66, 66))
    assert all("strip" not in op.target for op in g.ops if op.kind == "pool")


def test_unbatched_pooling_is_cut_along_its_spatial_dims() -> None:
    model, x = nn.MaxPool2d(3, stride=1, padding=1), torch.randn(1, 64, 64)   # (C, H, W)
    micro = sb.decompose(sb.trace(model, (x,)), 24 * 1024)
    verify(micro, 24 * 1024)
    assert "sb.max_pool_strip" in targets(micro)
    torch.testing.assert_close(sb.run_local(micro, x), model(x))


@pytest.mark.parametrize("module, shape, rule", [
    (nn.Conv2d(3, 5, 3, stride=2, padding=1, dilation=2), (1, 3, 37, 21), conv.spatial_strips),
    (nn.MaxPool2d(3, stride=2, padding=1, ceil_mode=True), (1, 3, 36, 21), pool.spatial_strips),
])
def test_strip_working_set_bounds_every_tile(module, shape, rule) -> None:
    """``ws(k)`` of the split is at least the working set of each of its ``k`` tiles."""
    graph = sb.trace(module, (torch.randn(*shape),))
    d = Decomposer(graph, 1)
    split = rule(d, graph.ops[0])
    assert split is not None and split.dim == 2
    for k in range(2, split.n + 1):
        bounds = bounds_for(split.n, k)
        tiles = []
        for i in range(k):
            args, kwargs, target, spec = split.piece(i, bounds[i], bounds[i + 1], [])
            tiles.append(d.make(f"t{k}.{i}", target, args, kwargs, f"y{k}.{i}", spec, ""))
        assert max(d.ws(t) for t in tiles) <= split.ws(k)


# --- the kernels, strip by strip, against torch ------------------------------------------------

def window(size: int, n: int, k: int, stride: int, pad: int, dilation: int = 1) -> Window:
    return Window(size, n, stride, dilation * (k - 1) + 1, pad, pad)


def by_strips(run, x: torch.Tensor, rows: Window, cols: Window) -> torch.Tensor:
    """``run(strip, pads)`` on three strips of output rows (dim 2), concatenated."""
    b = bounds_for(rows.n, 3)
    parts = []
    for lo, hi in zip(b[:-1], b[1:]):
        start, stop, before, after = rows.rows(lo, hi)
        parts.append(run(x[:, :, start:stop], [[before, after], cols.pads]))
    return torch.cat(parts, 2)


@pytest.mark.parametrize("stride, padding, dilation, groups",
                         [(2, 1, 1, 1), (1, 2, 2, 2), (2, 3, 2, 4), (3, 0, 1, 1)])
def test_conv_strip_kernel_matches_torch(stride, padding, dilation, groups) -> None:
    x, w, bias = torch.randn(2, 4, 23, 9), torch.randn(8, 4 // groups, 3, 3), torch.randn(8)
    expected = F.conv2d(x, w, bias, stride, padding, dilation, groups)
    rows, cols = (window(s, n, 3, stride, padding, dilation) for s, n in zip((23, 9), expected.shape[2:]))
    got = by_strips(lambda strip, pads: KERNELS["sb.conv_strip"](strip, w, bias, [stride] * 2, pads,
                                                                 [dilation] * 2, groups), x, rows, cols)
    torch.testing.assert_close(got, expected)


def test_conv_strip_same_padding_with_an_even_kernel() -> None:
    x, w = torch.randn(1, 3, 17), torch.randn(2, 3, 4)
    expected = F.conv1d(x, w, None, 1, "same")
    win = Window(17, 17, 1, 4, 1, 2)     # NOTE: total padding 3: one before, two after
    b = bounds_for(17, 3)
    parts = []
    for lo, hi in zip(b[:-1], b[1:]):
        start, stop, before, after = win.rows(lo, hi)
        parts.append(KERNELS["sb.conv_strip"](x[..., start:stop], w, None, [1], [[before, after]], [1], 1))
    torch.testing.assert_close(torch.cat(parts, -1), expected)


@pytest.mark.parametrize("k, stride, padding, dilation, ceil_mode",
                         [(3, 2, 1, 1, False), (3, 2, 1, 1, True), (2, 2, 0, 2, True), (3, 1, 1, 2, False)])
def test_max_pool_strip_kernel_matches_torch(k, stride, padding, dilation, ceil_mode) -> None:
    x = torch.randn(2, 3, 19, 12)
    expected = F.max_pool2d(x, k, stride, padding, dilation, ceil_mode)
    rows, cols = (window(s, n, k, stride, padding, dilation) for s, n in zip((19, 12), expected.shape[2:]))
    got = by_strips(lambda strip, pads: KERNELS["sb.max_pool_strip"](strip, [k, k], [stride] * 2, pads,
                                                                     [dilation] * 2), x, rows, cols)
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("k, stride, padding, divisor",
                         [(3, 2, 1, None), (3, 1, 1, None), (2, 2, 0, 3), (3, 3, 1, 5)])
def test_avg_pool_strip_kernel_matches_torch(k, stride, padding, divisor) -> None:
    x = torch.randn(1, 2, 21, 10)
    expected = F.avg_pool2d(x, k, stride, padding, divisor_override=divisor)
    rows, cols = (window(s, n, k, stride, padding) for s, n in zip((21, 10), expected.shape[2:]))
    got = by_strips(lambda strip, pads: KERNELS["sb.avg_pool_strip"](strip, [k, k], [stride] * 2, pads,
                                                                     divisor), x, rows, cols)
    torch.testing.assert_close(got, expected)


def test_pool_reader_refuses_inexact_average_pooling() -> None:
    def read(module: nn.Module, shape: tuple[int, ...]) -> pool.Pool | None:
        # NOTE: no template cache: the modules' reprs omit count_include_pad and ceil_mode
        with dask.config.set({"seabiscuit.cache.enabled": False}):
            graph = sb.trace(module, (torch.randn(*shape),))
        return pool.read(Decomposer(graph, 1), graph.ops[0])

    assert read(nn.AvgPool2d(3, 2, 1), (1, 2, 9, 9)) is not None
    assert read(nn.AvgPool2d(3, 2, 1, count_include_pad=False), (1, 2, 9, 9)) is None
    assert read(nn.AvgPool2d(3, 2, 0, count_include_pad=False), (1, 2, 9, 9)) is not None
    assert read(nn.AvgPool2d(2, 2, 0, ceil_mode=True), (1, 2, 9, 9)) is None    # a partial last window
    assert read(nn.AvgPool2d(2, 2, 0, ceil_mode=True), (1, 2, 8, 8)) is not None
    assert read(nn.AdaptiveAvgPool2d(3), (1, 2, 9, 9)) is None


def test_flops_of_strips_add_up_to_the_whole() -> None:
    model = seeded(nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.MaxPool2d(3, 1, 1)))
    graph = sb.trace(model, (torch.randn(1, 1, 64, 128),))
    micro = decomposed(model, torch.randn(1, 1, 64, 128))
    for kind in ("conv", "pool"):
        whole = sum(op.flops for op in graph.ops if op.kind == kind)
        parts = sum(op.flops for op in micro.ops if op.kind == kind)
        assert whole == parts and whole > 0
    assert graph.ops[1].flops == math.prod(graph.tensors[graph.ops[1].outputs[0]].shape) * 9


def test_bounds_with_a_quantum_are_whole_groups_and_never_more_pieces() -> None:
    from seabiscuit_dask.decompose.split import largest_piece

    for n in range(1, 260):
        for k in range(1, n + 1):
            for q in (1, 16):
                b = bounds_for(n, k, q)
                sizes = [hi - lo for lo, hi in zip(b, b[1:])]
                assert b[0] == 0 and b[-1] == n and min(sizes) > 0 and len(sizes) <= k
                assert max(sizes) == largest_piece(n, k, q) or q == 1
                if q > 1 and largest_piece(n, k, q) >= q:
                    assert all(s % q == 0 for s in sizes[:-1])
                assert k == 1 or len(sizes) > 1
