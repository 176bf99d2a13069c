from __future__ import annotations

import dask.config
import pytest
import torch

from seabiscuit_dask import templates


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory: pytest.TempPathFactory):
    """Every test writes templates to a private folder and starts with an empty memory cache."""
    d = tmp_path_factory.mktemp("sbcache")
    templates.clear_memory()
    with dask.config.set({"seabiscuit.cache.directory": str(d)}):
        yield
    templates.clear_memory()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
