"""Weights from safetensors: tile-by-tile slices, and clear errors for bad files."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file, save_model

import seabiscuit_dask as sb
from seabiscuit_dask.weights import WeightStore

from . import models as M


@pytest.fixture()
def saved_llama(tmp_path):
    model = M.llama()
    path = tmp_path / "llama.safetensors"
    save_model(model, str(path))
    return model, path


def test_run_from_checkpoint_reads_only_tile_slices(saved_llama) -> None:
    model, path = saved_llama
    x = M.ids()
    skeleton = sb.build_empty(M.llama)
    micro = sb.decompose(sb.trace(skeleton, x, checkpoint=path), "64KiB")
    store = WeightStore()
    got = sb.run_local(micro, x, store=store).logits
    with torch.no_grad():
        expected = model(x).logits
    assert M.rel_err(got, expected) <= 1e-4

    tiled = {p.source.key for p in micro.params.values() if p.is_tile}
    assert "model.embed_tokens.weight" in tiled and "lm_head.weight" in tiled
    full_shapes = {k: tuple(v) for k, v in micro.meta["param_shapes"].items()}
    for key, slices in store.reads:
        if key in tiled:   # a tiled weight is never read whole
            assert slices is not None
            assert tuple(b - a for a, b in slices) != full_shapes[key]
    # every tile is read once, so exactly the model's bytes come off the disk
    read = sum(micro.params[p].nbytes for p in micro.params if micro.params[p].source.kind
               == "safetensors")
    assert read == sum(t.numel() * t.element_size() for t in model.state_dict().values()
                       if t.dtype.is_floating_point)
    from_file = [r for r in store.reads if r[0] in micro.meta["param_shapes"]
                 and r[0] != "model.rotary_emb.inv_freq"]
    assert len(from_file) == sum(1 for p in micro.params.values()
                                 if p.source.kind == "safetensors")


def test_hf_folder_with_tied_weights(tmp_path) -> None:
    model = M.gpt2()
    model.save_pretrained(tmp_path)
    x = M.ids()
    micro = sb.decompose(sb.trace(str(tmp_path), x), "64KiB")
    with torch.no_grad():
        expected = model(x).logits
    assert M.rel_err(sb.run_local(micro, x).logits, expected) <= 1e-4


def test_truncated_checkpoint(saved_llama, tmp_path) -> None:
    _, path = saved_llama
    data = path.read_bytes()
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(data[: len(data) - 1000])
    with pytest.raises(sb.BadCheckpoint, match=r"cut.safetensors.*truncated"):
        sb.trace(sb.build_empty(M.llama), M.ids(), checkpoint=cut)
    tiny = tmp_path / "tiny.safetensors"
    tiny.write_bytes(b"\x01\x02")
    with pytest.raises(sb.BadCheckpoint, match="2 bytes is too short"):
        sb.trace(sb.build_empty(M.llama), M.ids(), checkpoint=tiny)


def test_corrupted_header(saved_llama, tmp_path) -> None:
    _, path = saved_llama
    data = bytearray(path.read_bytes())
    data[8:16] = b"\xff" * 8
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(bytes(data))
    with pytest.raises(sb.BadCheckpoint, match="not valid JSON"):
        sb.trace(sb.build_empty(M.llama), M.ids(), checkpoint=bad)


def test_checkpoint_with_wrong_keys_or_shapes(tmp_path) -> None:
    state = {k: v.contiguous() for k, v in M.llama().state_dict().items()}
    renamed = dict(state)
    renamed["model.norm.scale"] = renamed.pop("model.norm.weight")
    save_file(renamed, str(tmp_path / "keys.safetensors"))
    with pytest.raises(sb.BadCheckpoint, match=r"1 key\(s\) missing: model.norm.weight"):
        sb.trace(sb.build_empty(M.llama), M.ids(), checkpoint=tmp_path / "keys.safetensors")
    reshaped = dict(state)
    reshaped["model.layers.0.mlp.up_proj.weight"] = torch.zeros(100, 128)
    save_file(reshaped, str(tmp_path / "shapes.safetensors"))
    with pytest.raises(sb.BadCheckpoint,
                       match=r"up_proj.weight: checkpoint \(100, 128\), model \(384, 128\)"):
        sb.trace(sb.build_empty(M.llama), M.ids(), checkpoint=tmp_path / "shapes.safetensors")


def test_missing_checkpoint_path(tmp_path) -> None:
    with pytest.raises(sb.BadCheckpoint, match="no safetensors checkpoint"):
        sb.trace(sb.build_empty(M.llama), M.ids(), checkpoint=tmp_path / "nothing")


def _mapped(t: torch.Tensor, path: str) -> bool:
    """Whether ``t``'s bytes lie in a mapping of the file ``path`` (Linux: /proc/self/maps)."""
    p = t.data_ptr()
    with open("/proc/self/maps") as maps:
        for line in maps:
            lo, hi = (int(v, 16) for v in line.split()[0].split("-"))
            if lo <= p < hi:
                return line.rstrip().endswith(path)
    return False


def test_a_tile_of_whole_rows_is_read_into_memory_of_its_own(tmp_path) -> None:
    g = torch.Generator().manual_seed(0)
    tensors = {"w": torch.randn(6, 4, generator=g), "b": torch.randn(5, generator=g).to(torch.bfloat16),
               "x": torch.randint(-9, 9, (3, 2, 2), generator=g, dtype=torch.int8)}
    path = str(tmp_path / "m.safetensors")
    save_file(tensors, path)
    store = WeightStore()

    def load(key: str, slices=None, dtype=None) -> torch.Tensor:
        full = tensors[key]
        shape = tuple(b - a for a, b in slices) if slices else tuple(full.shape)
        return store.load(sb.ParamSpec(key, shape, dtype or str(full.dtype).removeprefix("torch."),
                                       sb.ParamSource("safetensors", key, slices, path)))

    cases = [("w", None), ("w", ((2, 5), (0, 4))), ("b", None), ("b", ((1, 4),)),
             ("x", ((1, 3), (0, 2), (0, 2))), ("w", ((3, 3), (0, 4)))]      # NOTE: the last: no rows at all
    for key, slices in cases:
        got = load(key, slices)
        want = tensors[key][tuple(slice(a, b) for a, b in slices)] if slices else tensors[key]
        assert torch.equal(got, want) and got.dtype == want.dtype and not _mapped(got, path), (key, slices)
    # NOTE: a tile of some columns is read through the file's mapping, and is as right
    cols = load("w", ((0, 6), (1, 3)))
    assert torch.equal(cols, tensors["w"][:, 1:3]) and _mapped(cols, path)
    assert store.reads[-1] == ("w", ((0, 6), (1, 3))) and len(store.reads) == len(cases) + 1
    # a tile past its tensor's rows is no tile of it
    with pytest.raises(sb.BadCheckpoint):
        load("w", ((4, 8), (0, 4)))
