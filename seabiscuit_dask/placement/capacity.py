"""Memory limits the partitioners respect, and the infeasibility errors."""

from __future__ import annotations

import numpy as np

from ..config import get, to_bytes
from ..errors import ClusterTooSmall
from ..ir import fmt_bytes
from .cluster import ClusterSpec
from .workload import Workload


def weight_capacity(spec: ClusterSpec) -> np.ndarray:
    """[D] bytes of weights each device may hold: its memory less an activation reserve."""
    reserve = to_bytes(get("placement.activation-reserve"), "placement.activation-reserve")
    mem = np.array([d.memory_bytes for d in spec.devices], dtype=np.float64)
    return mem - np.minimum(reserve, mem // 8)


def check_fits(w: Workload, spec: ClusterSpec, cap: np.ndarray) -> None:
    """Raise ``ClusterTooSmall`` when the model cannot fit, naming the shortfall or the op."""
    total = float(w.weight_bytes.sum())
    if total > cap.sum():
        raise ClusterTooSmall(
            f"model weights need {fmt_bytes(total)} but the cluster's {len(spec.devices)} devices hold "
            f"{fmt_bytes(cap.sum())} for weights: short by {fmt_bytes(total - cap.sum())} "
            f"({int(total - cap.sum())} bytes)")
    need = w.act_bytes + w.weight_bytes
    biggest = int(np.argmax(w.weight_bytes))
    if w.weight_bytes[biggest] > cap.max():
        raise ClusterTooSmall(
            f"op {w.names[biggest]!r} needs {fmt_bytes(w.weight_bytes[biggest])} of weights but the largest "
            f"device ({spec.names[int(np.argmax(cap))]!r}) holds {fmt_bytes(cap.max())}")
    mem = np.array([d.memory_bytes for d in spec.devices], dtype=np.float64)
    worst = int(np.argmax(need))
    if need[worst] > mem.max():
        raise ClusterTooSmall(
            f"op {w.names[worst]!r} has a working set of {fmt_bytes(need[worst])}, larger than every "
            f"device (largest: {spec.names[int(np.argmax(mem))]!r}, {fmt_bytes(mem.max())})")
