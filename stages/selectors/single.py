"""Selector ``single``: always the one drafter there is (arm 0)."""

from __future__ import annotations

from specflow.protocols import BanditStats


class SingleSelector:
    """The trivial selector: one arm, always chosen."""

    def begin(self, num_arms: int) -> BanditStats:
        return BanditStats()

    def select(self, stats: BanditStats) -> int:
        return 0

    def update(self, stats: BanditStats, arm: int, reward: float) -> None:
        pass
