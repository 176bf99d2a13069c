"""Costs learned from observed runs: per-(op class, device) corrections, and speed changes.

The cost model predicts each block's time from its ops (``Workload.times``). The
workers time every block they run; ``CostLearner`` fits, per device, the factor by
which each op class's modelled time must be scaled to match (recursive least
squares with forgetting, pulled toward 1 until there is evidence), and watches a
short-window ratio of observed to predicted time to detect a device whose speed
changed (a competing process, thermal throttling): ``observe`` then returns the new
scales, which the scheduler turns into a ``CapacityChanged`` repair. A change counts
only against the device's peers: when every device slows down alike (the whole
machine is busy) no plan would do better, so none is asked for; after a change, a
device is left alone for ``cooldown`` runs, so a noisy device cannot churn the plan.

Plain Python and numpy; the scheduler plugin feeds it, tests drive it with
synthetic traces.

>>> learner = CostLearner()
>>> _ = learner.observe("w0", {"matmul": 0.010, "other": 0.002}, observed_s=0.018)
>>> learner.scale("w0")["matmul"] > 1
True
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from .cluster import OP_CLASSES

MIN_SCALE, MAX_SCALE = 0.02, 50.0


@dataclass
class DeviceFit:
    """The running least-squares fit of one device: observed / modelled time per op class."""

    normal: np.ndarray = field(default_factory=lambda: np.zeros((len(OP_CLASSES), len(OP_CLASSES))))
    rhs: np.ndarray = field(default_factory=lambda: np.zeros(len(OP_CLASSES)))
    fast_ratio: float = 1.0          # short-window observed / predicted by the plan's scales
    fast_learned: float = 1.0        # short-window observed / predicted by the learned scales
    off_for: int = 0                 # observations in a row the fast ratio is off
    quiet_for: int = 0               # observations left before another change may be raised
    applied: dict[str, float] = field(default_factory=dict)   # the scales the plan now uses
    count: int = 0
    recent: deque[tuple[np.ndarray, float]] = field(default_factory=lambda: deque(maxlen=8))


@dataclass
class CostLearner:
    """Learns per-(op class, device) time scales online; see the module docstring.

    ``forget`` is the weight the past keeps per observation, ``prior`` the weight (in
    observations) of the model's own guess (scale 1), ``change`` the factor a device's
    short-window ratio must be off by, ``patience`` observations in a row, to count as a
    speed change.
    """

    forget: float = 0.95
    prior: float = 0.05
    change: float = 1.5
    patience: int = 3
    cooldown: int = 12
    fast: float = 0.5
    fits: dict[str, DeviceFit] = field(default_factory=dict)
    errors: deque[float] = field(default_factory=lambda: deque(maxlen=10_000))

    def scale(self, device: str) -> dict[str, float]:
        """Measured over modelled time per op class on ``device`` (1.0 where nothing was seen)."""
        fit = self.fits.get(device)
        if fit is None or not fit.count:
            return dict.fromkeys(OP_CLASSES, 1.0)
        a = fit.normal + self.prior * np.eye(len(OP_CLASSES))
        k = np.linalg.solve(a, fit.rhs + self.prior * np.ones(len(OP_CLASSES)))
        return {c: float(np.clip(v, MIN_SCALE, MAX_SCALE)) for c, v in zip(OP_CLASSES, k)}

    def predict_s(self, device: str, modelled: Mapping[str, float]) -> float:
        """A block's time on ``device`` from its modelled time per op class, as learned so far."""
        s = self.scale(device)
        return float(sum(s[c] * float(modelled.get(c, 0.0)) for c in OP_CLASSES))

    def observe(self, device: str, modelled: Mapping[str, float],
                observed_s: float) -> dict[str, float] | None:
        """Take one block's observed time; returns the device's new scales if its speed changed.

        ``modelled`` is the block's time per op class by the cost model before any
        correction (scale 1). Observations of blocks with no modelled time are ignored.
        """
        x = np.array([max(float(modelled.get(c, 0.0)), 0.0) for c in OP_CLASSES])
        total = float(x.sum())
        if not total > 0 or not math.isfinite(observed_s) or observed_s < 0:
            return None
        fit = self.fits.setdefault(device, DeviceFit())
        before = self.predict_s(device, modelled)
        self.errors.append(abs(before - observed_s) / max(observed_s, 1e-12))
        fit.fast_learned = self.fast * observed_s / max(before, 1e-12) + (1 - self.fast) * fit.fast_learned
        share, ratio = x / total, observed_s / total
        fit.normal = self.forget * fit.normal + np.outer(share, share)
        fit.rhs = self.forget * fit.rhs + share * ratio
        fit.count += 1
        fit.recent.append((share, ratio))
        return self._changed(device, fit, modelled, observed_s)

    def _changed(self, device: str, fit: DeviceFit, modelled: Mapping[str, float],
                 observed_s: float) -> dict[str, float] | None:
        applied = fit.applied or dict.fromkeys(OP_CLASSES, 1.0)
        planned = sum(applied.get(c, 1.0) * float(modelled.get(c, 0.0)) for c in OP_CLASSES)
        r = observed_s / max(planned, 1e-12)
        fit.fast_ratio = self.fast * r + (1 - self.fast) * fit.fast_ratio
        fit.quiet_for = max(0, fit.quiet_for - 1)
        limit = math.log(self.change)
        peers = [f.fast_ratio for d, f in self.fits.items() if d != device and f.count]
        # NOTE: relative to its peers: a device slower only because all are is no reason to move
        rel = fit.fast_ratio / float(np.median(peers)) if peers else fit.fast_ratio
        off = abs(math.log(max(fit.fast_ratio, 1e-12))) > limit and abs(math.log(max(rel, 1e-12))) > limit
        fit.off_for = fit.off_for + 1 if off else 0
        if fit.off_for < self.patience or fit.quiet_for:
            return None
        fit.quiet_for = self.cooldown
        if abs(math.log(max(fit.fast_learned, 1e-12))) > math.log(self.change) / 2:
            # NOTE: the fit lags too: the speed changed, and what came before says nothing of
            # now. Refit on the runs since the change only.
            since = list(fit.recent)[-fit.off_for:]
            fit.normal = sum((np.outer(x, x) for x, _ in since), np.zeros_like(fit.normal))
            fit.rhs = sum((x * y for x, y in since), np.zeros_like(fit.rhs))
        fit.off_for, fit.fast_ratio, fit.fast_learned = 0, 1.0, 1.0
        fit.applied = self.scale(device)
        return dict(fit.applied)

    def applied(self, device: str, scale: Mapping[str, float]) -> None:
        """Note the scales the current plan uses for ``device`` (as after a repair)."""
        self.fits.setdefault(device, DeviceFit()).applied = {c: float(scale.get(c, 1.0)) for c in OP_CLASSES}

    def settle(self, device: str) -> None:
        """The change raised for ``device`` moved nothing: no cool-down is needed."""
        fit = self.fits.get(device)
        if fit is not None:
            fit.quiet_for = 0

    def forget_device(self, device: str) -> None:
        self.fits.pop(device, None)

    def mean_error(self, last: int) -> float:
        """Mean relative error of the last ``last`` predictions, each made before its observation."""
        recent = list(self.errors)[-last:]
        return float(np.mean(recent)) if recent else float("nan")
