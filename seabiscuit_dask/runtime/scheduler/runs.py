"""Block runs counted per model: what ``DistributedModel.runs()`` reports."""

from __future__ import annotations

from ...lower.blocks import Key

KINDS = ("computed", "resumed", "re_executed")


class RunCounts:
    """Per model: blocks computed, read back from checkpoints (``resumed``) and computed more than
    once for the same task (``re_executed``); per live task, the times it was computed (kept as
    long as the task: its key leaves with it)."""

    def __init__(self) -> None:
        self.totals: dict[str, dict[str, int]] = {}
        self.per_task: dict[str, dict[Key, int]] = {}

    def ran(self, model: str, key: Key | None, computed: bool) -> None:
        """A block of ``model`` ran: computed, or read back; ``key``: its live task's (None: no task's,
        as on the data plane, which refuses repeats itself)."""
        totals = self.totals.setdefault(model, dict.fromkeys(KINDS, 0))
        if not computed:
            totals["resumed"] += 1
            return
        if key is not None:
            runs = self.per_task.setdefault(model, {})
            totals["re_executed"] += bool(runs.get(key))
            runs[key] = runs.get(key, 0) + 1
        totals["computed"] += 1

    def of(self, model: str) -> dict[str, int]:
        return dict(self.totals.get(model, dict.fromkeys(KINDS, 0)))

    def task_forgotten(self, model: str, key: Key) -> None:
        self.per_task.get(model, {}).pop(key, None)

    def forget(self, model: str) -> None:
        self.totals.pop(model, None)
        self.per_task.pop(model, None)
