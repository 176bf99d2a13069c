"""What the scheduler's state reads of ``seabiscuit.*``: read once, when the state is built."""

from __future__ import annotations

from dataclasses import dataclass, replace

from ... import config
from ...placement.reroute import RepairPolicy
from ..watch import seconds


@dataclass(frozen=True)
class StateSettings:
    """``PlacementState``'s settings (``seabiscuit.yaml`` holds every default): the cost learner's
    (``learn.*``), the link learner's and the repair a changed link gets (``routing.*``), and how
    long a deploy claim waits for its deploy (``runtime.sync-timeout``)."""

    speed_change: float
    learn_patience: int
    learn_cooldown: int
    learn_repair: bool                # a worker whose speed changed gets a repaired plan
    link_forget: float
    link_prior: float
    link_change: float
    link_patience: int
    link_cooldown: int
    link_history: int
    reroute: RepairPolicy             # NOTE: min_gain infinite when routing.repair is off: learned only
    claim_ttl_s: float

    @classmethod
    def from_config(cls) -> StateSettings:
        policy = RepairPolicy.from_config()
        if not config.get("routing.repair"):
            policy = replace(policy, min_gain=float("inf"))
        return cls(speed_change=float(config.get("learn.speed-change")),
                   learn_patience=int(config.get("learn.patience")),
                   learn_cooldown=int(config.get("learn.cooldown")),
                   learn_repair=bool(config.get("learn.repair")),
                   link_forget=float(config.get("routing.forget")),
                   link_prior=float(config.get("routing.prior")),
                   link_change=float(config.get("routing.change")),
                   link_patience=int(config.get("routing.patience")),
                   link_cooldown=int(config.get("routing.cooldown")),
                   link_history=int(config.get("routing.history")),
                   reroute=policy, claim_ttl_s=seconds("runtime.sync-timeout"))
