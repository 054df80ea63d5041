"""Selector ``fixed``: always arm ``arm`` of the pool (a baseline: one drafter alone)."""

from __future__ import annotations

from specflow.errors import ConfigError
from specflow.protocols import BanditStats


class FixedSelector:
    """Always choose ``arm`` (0-based, in the pool's order)."""

    def __init__(self, arm: int = 0) -> None:
        if arm < 0:
            raise ConfigError(f"selector.arm must be >= 0, got {arm}")
        self.arm = arm

    def begin(self, num_arms: int) -> BanditStats:
        if self.arm >= num_arms:
            raise ConfigError(
                f"selector.arm={self.arm} but the pool has {num_arms} arms (0..{num_arms - 1})"
            )
        return BanditStats()

    def select(self, stats: BanditStats) -> int:
        return self.arm

    def update(self, stats: BanditStats, arm: int, reward: float) -> None:
        pass
