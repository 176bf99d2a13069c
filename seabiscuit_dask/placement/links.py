"""Links learned from real transfers: per-link latency and bandwidth, and the changes that matter.

Every transfer the data plane makes is a sample ``(nbytes, seconds)`` of one directed
link: the sender's time from writing the bytes to the receiver's acknowledgement, less
what the receiver spent before acknowledging (``runtime.dataplane.flow``). So a sample
is ``2 * latency + nbytes / bandwidth``: the bytes one way, the acknowledgement back. The
receiver also says how long the bytes took to come in after their header (``read_s``):
the link is no faster than that, which tells a slower link from a longer one where
every message is of one size.

A sample also holds the time its ends did not run: a receiver whose event loop was busy with a
block's compute (or whose process waited for a core) read the bytes late, and a sender its
acknowledgement. On a loaded host that is most of it: between three worker processes on two busy
cores a 128 KiB activation took 3 to 6 ms at the median (by link) and 34 to 140 at the 99th
percentile where the fastest took 0.4, its bytes read in at 3 GB/s once read. A slower link shows
in the read time too (its bytes come in at its pace); a stall does not. So a sample ``change`` times
slower than the figures predict whose read time took less than half of what it took past them
(``stall``) is a *stall*: counted (``stalls``), and nothing more: not fitted, no part of a change,
no vote. Where the read time is not known (whole messages over UCX or in-process) every sample
counts, as below.

``LinkEstimator`` fits both figures by weighted least squares with forgetting, as
``CostLearner`` fits compute times: each sample weighed by the inverse square of its
predicted time (relative errors, so small and large messages both count), the figures the
plan started with standing in as ``prior`` transfers, and a sample far from the
prediction clipped before it enters the fit (one stall of an event loop is no new link).
It also watches for a change: samples whose time is ``change`` times off the figures the
plan uses (``applied``), ``patience`` in a row (the same way; a message within the band
breaks the row only if it is no smaller than half the median of those off, so a link shaped for
large messages only, a token bucket, is still seen; of the row, the messages no smaller than half
its median count), re-estimate the link from those samples (a row no one link explains slides on).
The new figures are then put to the test: of the next samples that tell the two apart, ``patience``
vote, and only if most are explained better by the new figures does ``observe`` return them; else
the link goes back to its figures before (stalls that the read time cannot tell, where it is not
known, delay a few messages in a row: that is no new link). A change seen within a link's
first ``cooldown`` samples is calibration, not news: probes and the data plane are two
instruments, and the first gap between them is taken without a repair. After a change, for
``cooldown`` samples the link changes again only past ``change`` squared (hysteresis: a noisy
link does not churn the plan). A link only longer (its bytes as fast, its latency more) is a
stall to every sample that knows its read time: the data plane cannot tell the two apart.
``LinkLearner`` keeps an estimator per (sender, receiver) and a history of each for the
dashboard. Plain Python and numpy: the scheduler plugin feeds it, tests drive it with
synthetic traces.

>>> est = LinkEstimator(LinkSpec(1.25e8, 1e-4))
>>> for _ in range(16):
...     _ = est.observe(1 << 20, 2e-4 + (1 << 20) / 2.5e6)     # a 20 Mbit/s link now
>>> round(est.applied.bandwidth_bytes_per_s / 2.5e6, 1)
1.0
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from .cluster import LinkSpec

REF_BYTES = float(1 << 20)     # NOTE: the fit's byte unit, so both figures are of one magnitude
FLOOR_S = 1e-6                 # NOTE: no link is faster than this per message
MAX_BYTES_PER_S = 1e12
TIE = 0.05                     # NOTE: fits whose median log errors differ by less explain samples alike
STALL_SHARE = 2.0              # NOTE: a stall: its time past the expected this many times its slower reads'
HISTORY_EVERY_S = 0.5          # NOTE: at most a history point this often (and one at each change)


def _bw(bytes_per_s: float) -> float:
    return min(max(bytes_per_s, 1.0), MAX_BYTES_PER_S)


def sample_s(link: LinkSpec, nbytes: float) -> float:
    """What a sample of ``nbytes`` takes on ``link``: the bytes one way and the acknowledgement back."""
    return 2 * link.latency_s + nbytes / link.bandwidth_bytes_per_s


def stall(seconds: float, read_s: float, expected_s: float, expected_read_s: float) -> bool:
    """Whether a transfer that took ``seconds`` where ``expected_s`` was expected spent most of the
    time past that other than on its bytes coming in slower than expected (``read_s``, the receiver's
    time from its header to its last byte, against ``expected_read_s``): an end that did not run (its
    event loop busy with a block's compute on a shared core, its process waiting for a core) while the
    bytes waited in its socket, or the acknowledgement in the sender's. A slower link shows in the
    read time: its bytes come in at its pace. False where the read time is not known (0)."""
    return read_s > 0 and seconds - expected_s > STALL_SHARE * max(read_s - expected_read_s, 0.0)


@dataclass
class LinkEstimator:
    """The fit of one directed link, its change detector and its history (see module doc)."""

    prior: LinkSpec
    forget: float = 0.9
    prior_weight: float = 2.0
    change: float = 2.0
    patience: int = 3
    cooldown: int = 8
    history_points: int = 240
    applied: LinkSpec = field(init=False)      # the figures plans use now
    normal: list[float] = field(init=False)     # the 2x2 normal matrix [a, b, c] = [[a, b], [b, c]]
    rhs: list[float] = field(init=False)
    off: list[tuple[float, float, float]] = field(default_factory=list)   # (bytes, s, read s) off in a row
    within: list[tuple[float, float, float]] = field(default_factory=list)   # ... and those in band meanwhile
    off_way: int = 0                            # +1: slower than the figures, -1: faster
    quiet_for: int = 0
    count: int = 0
    stalls: int = 0                             # samples of ``count`` that were stalls (``stalled``)
    bytes_total: float = 0.0
    changes: int = 0
    trial: tuple[LinkSpec, LinkSpec, list[float], list[float], float] | None = None   # see _confirm
    votes: list[int] = field(default_factory=list)   # +1: a sample the new figures explain better
    calibrated: bool = False                    # the first gap to the probes' figures was taken
    trial_at: int = 0                           # the sample that put the figures on trial (``timed``)
    history: deque[tuple[float, float, float]] = field(init=False)   # (time, bytes/s, latency s)
    changed_at: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=64))  # (time, count)

    def __post_init__(self) -> None:
        self.applied = self.prior
        self.history = deque(maxlen=self.history_points)
        self._refit([], self.prior)

    # --- the fit ----------------------------------------------------------------------------
    def _add(self, nbytes: float, seconds: float, weight: float = 1.0) -> None:
        # NOTE: plain floats: a 2x2 fit per transfer, on the scheduler's event loop
        k = 1.0 / max(sample_s(self.applied, nbytes), FLOOR_S)
        x0, x1, y = k, nbytes / REF_BYTES * k, seconds * k
        a, b, c = self.normal
        self.normal = [a + weight * x0 * x0, b + weight * x0 * x1, c + weight * x1 * x1]
        self.rhs = [self.rhs[0] + weight * x0 * y, self.rhs[1] + weight * x1 * y]

    def _refit(self, samples: list[tuple[float, float, float]], anchor: LinkSpec) -> None:
        """Start the fit afresh from ``samples`` and ``anchor``'s figures as ``prior_weight``
        transfers (one message of no bytes, one of ``REF_BYTES``)."""
        self.normal, self.rhs = [0.0, 0.0, 0.0], [0.0, 0.0]
        self._add(0.0, sample_s(anchor, 0.0), self.prior_weight / 2)
        self._add(REF_BYTES, sample_s(anchor, REF_BYTES), self.prior_weight / 2)
        for n, s, _ in samples:
            self._add(n, s)

    def estimate(self) -> LinkSpec:
        """The link's latency and bandwidth as fitted so far."""
        a, b, c = self.normal
        r0, r1 = self.rhs
        det = a * c - b * b
        if det <= 1e-12 * max(a * c, 1e-300):      # NOTE: one size of message only: the prior holds it
            return self.applied
        rtt, per_ref = (c * r0 - b * r1) / det, (a * r1 - b * r0) / det
        per_ref = max(per_ref, REF_BYTES / MAX_BYTES_PER_S)
        return LinkSpec(REF_BYTES / per_ref, max(rtt, FLOOR_S) / 2)

    # --- samples ------------------------------------------------------------------------------
    def observe(self, nbytes: float, seconds: float, now: float | None = None,
                read_s: float = 0.0) -> LinkSpec | None:
        """Take one transfer of ``nbytes`` that took ``seconds`` (``read_s``: the receiver's time from
        its header to its last byte, 0 if not known); returns the link's new figures when it
        changed (see module doc), else None. Samples that are not finite are ignored; a stalled one
        (``stalled``) is counted and nothing more."""
        if not (math.isfinite(nbytes) and math.isfinite(seconds)) or nbytes < 0 or seconds <= 0:
            return None
        read_s = read_s if math.isfinite(read_s) and read_s > 0 else 0.0
        predicted = max(sample_s(self.applied, nbytes), FLOOR_S)
        self.count += 1
        self.bytes_total += nbytes
        now = time.time() if now is None else now
        if self.stalled(nbytes, seconds, predicted, read_s):
            self.stalls += 1
            self._remember(now, False)
            return None
        self.normal = [v * self.forget for v in self.normal]
        self.rhs = [v * self.forget for v in self.rhs]
        # NOTE: clipped to the band of no change: a step past it is the detector's to act on
        self._add(nbytes, min(max(seconds, predicted / self.change), predicted * self.change))
        if self.trial is not None:
            changed = self._confirm(nbytes, seconds)
        else:
            changed = self._changed(nbytes, seconds, predicted, read_s)
        self._remember(now, changed is not None)
        if changed is not None:
            self.changed_at.append((now, self.count))
        return changed

    def stalled(self, nbytes: float, seconds: float, predicted: float, read_s: float) -> bool:
        """Whether a sample ``change`` times slower than ``predicted`` is a stall (``stall``): most of
        what it took past them was not its bytes coming in slower than the figures say, so no link's."""
        return seconds > self.change * predicted and stall(
            seconds, read_s, predicted, nbytes / self.applied.bandwidth_bytes_per_s)

    @property
    def timed(self) -> int:
        """Samples that timed the link (not stalled)."""
        return self.count - self.stalls

    def _changed(self, nbytes: float, seconds: float, predicted: float, read_s: float) -> LinkSpec | None:
        self.quiet_for = max(0, self.quiet_for - 1)
        # NOTE: hysteresis: a link that just changed is left alone unless it changes far more
        band = self.change if not self.quiet_for else self.change ** 2
        ratio = seconds / predicted
        way = 1 if ratio > band else -1 if ratio < 1 / band else 0
        if way == 0:
            # NOTE: an in-band message breaks the row only if it is no smaller than half the median
            # of those off: a token bucket lets small messages through at full speed and slows only
            # large ones (and a stray small one off must not make the small ones after it count)
            if self.off and nbytes >= self._large():
                self.off, self.within = [], []
            elif self.off:
                self.within = [*self.within[-4 * self.patience + 1:], (nbytes, seconds, read_s)]
            return None
        if way != self.off_way:
            if self.off and nbytes < self._large():
                # NOTE: nor does a smaller message off the other way: under a token bucket small ones
                # pass at full speed, faster than a latency fitted from noisy ones may say
                self.within = [*self.within[-4 * self.patience + 1:], (nbytes, seconds, read_s)]
                return None
            self.off, self.within, self.off_way = [], [], way
        self.off = [*self.off[-4 * self.patience + 1:], (nbytes, seconds, read_s)]
        # NOTE: the row's messages no smaller than half its median count: a stray small one off (its
        # time mostly event-loop noise) neither makes a change nor spoils the fit of the large ones'
        large = self._large()
        row = [o for o in self.off if o[0] >= large]
        if len(row) < self.patience:
            return None
        # NOTE: the fit lags a step change: what came before says nothing of now. The figures that
        # best explain the samples off in a row are the link's; the fit starts again from there.
        whole, self.off = self.off, row
        now = self._fit_off(self.estimate())
        if now is None:
            self.off = whole[1:]        # NOTE: no one link explains the row: it slides on
            return None
        # NOTE: the new figures on trial (see _confirm); the fit as it was kept to go back to
        self.trial = (self.applied, now, list(self.normal), list(self.rhs), large)
        self.votes, self.trial_at = [], self.timed
        self.applied = now
        self._refit(self.off + self.within, now)
        self.off, self.within = [], []
        return None

    def _large(self) -> float:
        """The least size of the row's messages that count: half its median (a stray small message, its
        time mostly its event loops' noise, does not; one a few headers smaller than the rest does)."""
        return float(np.median([n for n, _, _ in self.off])) / 2

    def _confirm(self, nbytes: float, seconds: float) -> LinkSpec | None:
        """A sample while new figures are on trial: it votes for them or for the figures before when
        it tells the two apart (its log error under one is smaller by half the band's) and is no
        smaller than half the median of the samples that were off (a token bucket lets small ones by,
        and a small message's time is mostly its event loops' noise); after ``patience`` votes the
        change stands (returned; a link's first, put on trial within its first ``cooldown`` samples
        that were no stalls, is calibration: taken, not returned) or the link goes back to its
        figures and fit before."""
        assert self.trial is not None
        before, now, normal, rhs, large = self.trial
        if nbytes < large:
            return None
        e_now = abs(math.log(seconds / max(sample_s(now, nbytes), FLOOR_S)))
        e_before = abs(math.log(seconds / max(sample_s(before, nbytes), FLOOR_S)))
        if abs(e_now - e_before) >= math.log(self.change) / 2:
            self.votes.append(1 if e_now < e_before else -1)
        if len(self.votes) < self.patience:
            return None
        self.trial = None
        if sum(self.votes) <= 0:
            self.applied, self.normal, self.rhs = before, normal, rhs
            return None
        self.quiet_for = self.cooldown
        first, self.calibrated = not self.calibrated and self.trial_at <= self.cooldown, True
        if first:
            return None
        self.changes += 1
        return now

    def _fit_off(self, before: LinkSpec) -> LinkSpec | None:
        """The figures that explain the samples off in a row best (the smallest mean error, then the
        least change): the bandwidth by the median with the latency kept (no longer than the
        samples allow), the latency by the median with the bandwidth kept, both by least squares
        where the sizes differ, or the bandwidth the receiver saw the bytes come in at with the
        latency the rest. A figure that rose must be told by some sample (its term a quarter of
        the sample's time); the link is no faster than the receiver saw (twice that: it may read
        late). Of those about as good, the one that explains the smaller messages in band meanwhile
        too. None when none explains the samples off within half the band (no one link does: noise,
        not a change)."""
        off = self.off + self.within
        n, s = np.array([x for x, _, _ in self.off]), np.array([y for _, y, _ in self.off])
        lat = min(before.latency_s, float(s.min()) / 4)
        fits = [LinkSpec(_bw(float(np.median(n / np.maximum(s - 2 * lat, FLOOR_S)))), lat),
                LinkSpec(before.bandwidth_bytes_per_s,
                         max(float(np.median(s - n / before.bandwidth_bytes_per_s)) / 2, FLOOR_S / 2))]
        reads = np.array([x / r for x, _, r in self.off if r > 0])
        if len(reads):
            seen = _bw(float(np.median(reads)))
            fits.append(LinkSpec(seen, max(float(np.median(s - n / seen)) / 2, FLOOR_S / 2)))
        n, s = np.array([x for x, _, _ in off]), np.array([y for _, y, _ in off])
        (rtt, per_byte), *_ = np.linalg.lstsq(np.stack([1 / s, n / s], axis=1), np.ones(len(s)), rcond=None)
        if rtt > 0 and per_byte > 0 and n.max() >= 2 * n.min():      # NOTE: one size cannot tell both
            fits.append(LinkSpec(_bw(1.0 / float(per_byte)), max(float(rtt), FLOOR_S) / 2))
        most = 2 * float(np.median(reads)) if len(reads) else math.inf

        def error(link: LinkSpec, samples: list[tuple[float, float, float]] = self.off) -> float:
            return float(np.mean(np.abs(np.log([sample_s(link, x) / y for x, y, _ in samples]))))

        def told(link: LinkSpec) -> bool:
            return bool((link.bandwidth_bytes_per_s <= before.bandwidth_bytes_per_s
                         or (n / link.bandwidth_bytes_per_s >= s / 4).any())
                        and (link.latency_s <= before.latency_s or (2 * link.latency_s >= s / 4).any())
                        and link.bandwidth_bytes_per_s <= most)

        def moved(link: LinkSpec) -> float:
            return (abs(math.log(link.bandwidth_bytes_per_s / before.bandwidth_bytes_per_s))
                    + abs(math.log(max(link.latency_s, FLOOR_S) / max(before.latency_s, FLOOR_S))))

        fits = [f for f in fits if told(f) and error(f) <= math.log(self.change) / 2]
        if not fits:
            return None
        # NOTE: of the fits about as good as the best (one size of message fits many), the one that
        # explains the smaller messages in band too (unless a token bucket lets them by: then none
        # does), then the least change
        least = min(error(f) for f in fits)
        near = [f for f in fits if error(f) <= least + TIE]
        also = min(error(f, off) for f in near)
        return min(near, key=lambda f: (error(f, off) > also + TIE, moved(f)))

    def _remember(self, now: float, changed: bool) -> None:
        """A history point every ``HISTORY_EVERY_S`` at most, and at each change."""
        if self.history and now - self.history[-1][0] < HISTORY_EVERY_S and not changed:
            return
        est = self.estimate()
        self.history.append((now, est.bandwidth_bytes_per_s, est.latency_s))

    def settle(self, link: LinkSpec) -> None:
        """Plans now use ``link`` for this link (a repair, or figures measured again)."""
        self.applied = link


@dataclass
class LinkLearner:
    """A ``LinkEstimator`` per directed link between two workers (see module doc)."""

    forget: float = 0.9
    prior: float = 2.0
    change: float = 2.0
    patience: int = 3
    cooldown: int = 8
    history: int = 240
    links: dict[tuple[str, str], LinkEstimator] = field(default_factory=dict)

    def estimator(self, src: str, dst: str, prior: LinkSpec) -> LinkEstimator:
        """The estimator of ``src -> dst`` (made from ``prior``, the figures the plan uses, if new)."""
        est = self.links.get((src, dst))
        if est is None:
            est = self.links[(src, dst)] = LinkEstimator(prior, self.forget, self.prior, self.change,
                                                         self.patience, self.cooldown, self.history)
        return est

    def observe(self, src: str, dst: str, nbytes: float, seconds: float, prior: LinkSpec,
                now: float | None = None, read_s: float = 0.0) -> LinkSpec | None:
        """Take one transfer from ``src`` to ``dst``; the link's new figures when it changed."""
        return self.estimator(src, dst, prior).observe(nbytes, seconds, now, read_s)

    def estimate(self, src: str, dst: str) -> LinkSpec | None:
        est = self.links.get((src, dst))
        return est.estimate() if est is not None and est.count else None

    def forget_device(self, address: str) -> None:
        for key in [k for k in self.links if address in k]:
            del self.links[key]
