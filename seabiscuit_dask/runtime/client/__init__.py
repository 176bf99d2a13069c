"""The client side: ``deploy`` a plan onto a Dask cluster, ``distribute`` a model in one call.

``deploy(plan, client)`` sends the graph and the plan (its documented JSON, the one wire
format) to the scheduler plugin, which issues the model's id and a token that only this
client holds, and has every worker load the weight tiles of its own blocks from the
checkpoint's slices. ``distribute`` is trace, decompose, ``measure_cluster``, place and deploy.
Both return a ``DistributedModel``, called like the model.

The modules, one concern each:

- ``deployment``: ``deploy``, ``distribute`` and their steps (``place_for_decode``, ``claim``);
- ``layouts``: how the workers hold matmul weights, measured as a model deploys;
- ``limits``: a model's positions and the KV-cache room its sessions take;
- ``model``: ``DistributedModel``, a facade over the parts below;
- ``plans``: the plan a model holds, kept up with the scheduler's (``PlanFollower``);
- ``programs``: the programs built besides the model's own graph (``ProgramCache``);
- ``requests``: sending requests and steps, and waiting for them (``RequestSender``, ``Handle``);
- ``operations``: draining, restoring and budgets, and what a model's runs did;
- ``chat``: ``ChatSession``, a conversation whose KV cache stays on the workers.
"""

from .chat import ChatSession
from .deployment import Progress, claim, deploy, distribute, place_for_decode
from .layouts import matmul_forms, weight_layouts
from .limits import kv_reserve, max_positions
from .model import DistributedModel
from .plans import EVENTS_KEPT, PlanFollower
from .programs import ProgramCache, StepLayout, StepProgram
from .programs import _with_checksums as _with_checksums
from .requests import Handle, RequestSender

__all__ = [
    "EVENTS_KEPT", "ChatSession", "DistributedModel", "Handle", "PlanFollower", "ProgramCache", "Progress",
    "RequestSender", "StepLayout", "StepProgram", "claim", "deploy", "distribute",
    "kv_reserve", "matmul_forms", "max_positions", "place_for_decode", "weight_layouts",
]
