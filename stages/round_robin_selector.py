"""Selector ``round_robin``: arms 0, 1, ..., n-1, 0, 1, ... (a baseline; restarts per request)."""

from __future__ import annotations

from specflow.errors import ConfigError


class RoundRobinSelector:
    """Cycle through the arms in order, from arm 0 at every request."""

    def __init__(self) -> None:
        self.num_arms = 1
        self.next = 0

    def begin(self, num_arms: int) -> None:
        if num_arms < 1:
            raise ConfigError(f"a pool needs at least one arm, got {num_arms}")
        self.num_arms = num_arms
        self.next = 0

    def select(self) -> int:
        arm = self.next
        self.next = (arm + 1) % self.num_arms
        return arm

    def update(self, arm: int, reward: float) -> None:
        pass
