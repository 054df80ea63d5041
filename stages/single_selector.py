"""Selector ``single``: always the one drafter there is (arm 0)."""

from __future__ import annotations


class SingleSelector:
    """The trivial selector: one arm, always chosen."""

    def begin(self, num_arms: int) -> None:
        pass

    def select(self) -> int:
        return 0

    def update(self, arm: int, reward: float) -> None:
        pass
