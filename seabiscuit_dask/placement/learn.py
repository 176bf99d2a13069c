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

Plain Python floats (a fit of two op classes per block run, on the scheduler's event loop:
numpy's calls on arrays this small cost more than the arithmetic); the scheduler plugin feeds
it, tests drive it with synthetic traces.

>>> learner = CostLearner()
>>> _ = learner.observe("w0", {"matmul": 0.010, "other": 0.002}, observed_s=0.018)
>>> learner.scale("w0")["matmul"] > 1
True
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from .. import config
from .cluster import OP_CLASSES

MIN_SCALE, MAX_SCALE = 0.02, 50.0


@dataclass
class DeviceFit:
    """The running least-squares fit of one device: observed / modelled time per op class."""

    normal: list[list[float]] = field(default_factory=lambda: [[0.0] * len(OP_CLASSES) for _ in OP_CLASSES])
    rhs: list[float] = field(default_factory=lambda: [0.0] * len(OP_CLASSES))
    fast_ratio: float = 1.0          # short-window observed / predicted by the plan's scales
    fast_learned: float = 1.0        # short-window observed / predicted by the learned scales
    off_for: int = 0                 # observations in a row the fast ratio is off
    quiet_for: int = 0               # observations left before another change may be raised
    applied: dict[str, float] = field(default_factory=dict)   # the scales the plan now uses
    count: int = 0
    recent: deque[tuple[list[float], float]] = field(default_factory=lambda: deque(maxlen=8))
    scales: dict[str, float] | None = None    # the fit's scales, until it changes


@dataclass
class CostLearner:
    """Learns per-(op class, device) time scales online; see the module docstring.

    ``forget`` is the weight the past keeps per observation, ``prior`` the weight (in
    observations) of the model's own guess (scale 1), ``change`` the factor a device's
    short-window ratio must be off by, ``patience`` observations in a row, to count as a
    speed change, ``cooldown`` the observations a device is then left alone for (these three:
    config ``seabiscuit.learn.*`` unless given).
    """

    forget: float = 0.95
    prior: float = 0.05
    change: float = field(default_factory=lambda: float(config.get("learn.speed-change")))
    patience: int = field(default_factory=lambda: int(config.get("learn.patience")))
    cooldown: int = field(default_factory=lambda: int(config.get("learn.cooldown")))
    fast: float = 0.5
    fits: dict[str, DeviceFit] = field(default_factory=dict)
    errors: deque[float] = field(default_factory=lambda: deque(maxlen=10_000))

    def scale(self, device: str) -> dict[str, float]:
        """Measured over modelled time per op class on ``device`` (1.0 where nothing was seen)."""
        fit = self.fits.get(device)
        if fit is None or not fit.count:
            return dict.fromkeys(OP_CLASSES, 1.0)
        if fit.scales is None:
            a = [[v + (self.prior if i == j else 0.0) for j, v in enumerate(row)]
                 for i, row in enumerate(fit.normal)]
            k = _solve(a, [r + self.prior for r in fit.rhs])
            fit.scales = {c: min(max(v, MIN_SCALE), MAX_SCALE) for c, v in zip(OP_CLASSES, k)}
        return dict(fit.scales)

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
        x = [max(float(modelled.get(c, 0.0)), 0.0) for c in OP_CLASSES]
        total = sum(x)
        if not total > 0 or not math.isfinite(observed_s) or observed_s < 0:
            return None
        fit = self.fits.setdefault(device, DeviceFit())
        before = self.predict_s(device, modelled)
        self.errors.append(abs(before - observed_s) / max(observed_s, 1e-12))
        fit.fast_learned = self.fast * observed_s / max(before, 1e-12) + (1 - self.fast) * fit.fast_learned
        share, ratio = [v / total for v in x], observed_s / total
        fit.normal = [[self.forget * v + share[i] * share[j] for j, v in enumerate(row)]
                      for i, row in enumerate(fit.normal)]
        fit.rhs = [self.forget * r + s * ratio for r, s in zip(fit.rhs, share)]
        fit.scales = None
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
        rel = fit.fast_ratio / statistics.median(peers) if peers else fit.fast_ratio
        off = abs(math.log(max(fit.fast_ratio, 1e-12))) > limit and abs(math.log(max(rel, 1e-12))) > limit
        fit.off_for = fit.off_for + 1 if off else 0
        if fit.off_for < self.patience or fit.quiet_for:
            return None
        fit.quiet_for = self.cooldown
        if abs(math.log(max(fit.fast_learned, 1e-12))) > math.log(self.change) / 2:
            # NOTE: the fit lags too: the speed changed, and what came before says nothing of
            # now. Refit on the runs since the change only.
            since = list(fit.recent)[-fit.off_for:]
            n = len(OP_CLASSES)
            fit.normal = [[sum(x[i] * x[j] for x, _ in since) for j in range(n)] for i in range(n)]
            fit.rhs = [sum(x[i] * y for x, y in since) for i in range(n)]
            fit.scales = None
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


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """``x`` with ``a x = b`` for a small symmetric positive definite ``a`` (the fit's normal matrix
    with its prior on the diagonal): Gaussian elimination in plain floats."""
    n = len(b)
    m = [[*row, b[i]] for i, row in enumerate(a)]
    for i in range(n):
        for j in range(i + 1, n):
            f = m[j][i] / m[i][i]
            m[j] = [u - f * v for u, v in zip(m[j], m[i])]
    x = [0.0] * n
    for i in reversed(range(n)):
        x[i] = (m[i][n] - sum(m[i][k] * x[k] for k in range(i + 1, n))) / m[i][i]
    return x
