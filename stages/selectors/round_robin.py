"""Selector ``round_robin``: arms 0, 1, ..., n-1, 0, 1, ... (a baseline; restarts per request)."""

from __future__ import annotations

from specflow.errors import ConfigError
from specflow.protocols import BanditStats


class RoundRobinSelector:
    """Cycle through the arms in order, from arm 0 at every request."""

    def begin(self, num_arms: int) -> BanditStats:
        if num_arms < 1:
            raise ConfigError(f"a pool needs at least one arm, got {num_arms}")
        return BanditStats(counts=[0.0] * num_arms, sums=[0.0] * num_arms)

    def select(self, stats: BanditStats) -> int:
        arm = stats.rounds % len(stats.counts)
        stats.rounds += 1
        return arm

    def update(self, stats: BanditStats, arm: int, reward: float) -> None:
        pass
