"""What a client holds stays bounded however long it serves: records of the scheduler's events."""

from __future__ import annotations

import pytest
import torch

import seabiscuit_dask as sb
from seabiscuit_dask.runtime.client import EVENTS_KEPT
from seabiscuit_dask.runtime.client.events import TOPIC

from .clusters import seabiscuit_cluster, wait_for

pytestmark = [pytest.mark.filterwarnings("ignore::ResourceWarning")]

X = torch.zeros(2, 8)


def test_a_model_keeps_the_latest_scheduler_events_not_every_one() -> None:
    """Every plan, link and stranding event about a model was appended to ``dm.events`` for as long
    as the model lived (a server's model grew by every drain, restore and link change); now the
    latest ``EVENTS_KEPT`` are kept, oldest first."""
    n = EVENTS_KEPT + 50
    with seabiscuit_cluster(1, 64 * 2**20, processes=False) as client:
        with sb.distribute(torch.nn.Linear(8, 4), client, X) as dm:
            for i in range(n):      # NOTE: as the scheduler plugin publishes a link that changed
                client.log_event(TOPIC, {"action": "link-slow", "model": dm.model_id, "reason": f"link {i}"})
            wait_for(lambda: dm.events and dm.events[-1].get("reason") == f"link {n - 1}", "the last event")
            assert len(dm.events) == EVENTS_KEPT
            assert [e["reason"] for e in dm.events] == [f"link {i}" for i in range(n - EVENTS_KEPT, n)]
