"""What a target pass costs, in the units a draft-length policy and a drafter plan with.

``RowPrices`` is the price of a verification pass by row count against a one-token step.
The CPU's row probe fills it in (``specflow.cpu.row_padding.row_prices``); a target
verifier hands it to the draft-length policy and the token-tree drafter through
``TargetVerifier.row_prices``.  This module holds the arithmetic only and imports nothing
of the models or the CPU probe, so the stage protocols and the stages can name it without
reaching into either.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RowPrices:
    """What one target pass over n rows costs relative to a one-token decoding step, as the
    row probe measured it on the model's own packed matmuls
    (``specflow.cpu.row_padding.row_prices``).

    With row padding m (``model.min_rows``) a pass of n rows multiplies max(n, m) rows, and a
    decoding step m, so

        price(n) = S(max(n, m)) / S(max(1, m))

    where S(r) is the probe's median seconds at r rows: measured where r was timed, linear
    between two timed counts, and beyond the largest one continued along the line through
    the two largest (never downwards).  A pass of more rows is never priced below one of
    fewer: S is taken as its running maximum from the step's row count up, so the probe's
    noise (or a kernel that runs 3 rows faster than 2) never makes a longer draft look
    cheaper than a shorter one.  It prices the matmuls, which are most of a CPU pass; the
    rest (norms, RoPE, attention, the ops' dispatch) is measured as a whole pass only.  On
    the Qwen2.5-1.5B (AVX2-capped EPYC) a pass's true price rose a little slower than this
    (a round of 4.09 rows: 1.11 steps, the probe about 1.14); on SmolLM2-135M, where that rest is
    about a quarter of a step, faster (4.21 rows: 1.24, the probe about 1.15).  Invariants:
    price(1) = 1, price(n) >= 1, price non-decreasing in n.

    Attributes:
        seconds: the probe's median seconds by row count (at least two counts, 1 included,
            every one > 0).
        min_rows: the model's row padding in effect (>= 1).
    """

    seconds: dict[int, float]
    min_rows: int

    def __post_init__(self) -> None:
        if len(self.seconds) < 2 or 1 not in self.seconds:
            raise ValueError("RowPrices needs the probe's seconds at 1 row and one more count")
        if min(self.seconds.values()) <= 0 or self.min_rows < 1:
            raise ValueError(f"RowPrices needs seconds > 0 and min_rows >= 1, got "
                             f"{self.seconds} and {self.min_rows}")

    def _seconds_at(self, rows: float) -> float:
        """S(rows) before the running maximum: measured, interpolated or extrapolated."""
        counts = sorted(self.seconds)
        if rows in self.seconds:
            return self.seconds[int(rows)]
        below = [c for c in counts if c < rows]
        above = [c for c in counts if c > rows]
        if not above:  # beyond the largest count: the line through the two largest, rising
            lo, hi = counts[-2], counts[-1]
            slope = max(0.0, (self.seconds[hi] - self.seconds[lo]) / (hi - lo))
            return self.seconds[hi] + slope * (rows - hi)
        lo, hi = below[-1], above[0]  # 1 is a count, so a row count >= 1 has one below
        return self.seconds[lo] + (self.seconds[hi] - self.seconds[lo]) * (rows - lo) / (hi - lo)

    def __call__(self, rows: float) -> float:
        """The price of a pass over ``rows`` (>= 1; a mean over rounds may be fractional)
        rows, a one-token step being 1."""
        base_rows = float(self.min_rows)
        base = self._seconds_at(base_rows)
        top = max(float(rows), base_rows)
        # the running maximum of S over [base_rows, top]: its timed counts and both ends
        points = [top] + [float(c) for c in self.seconds if base_rows < c < top]
        return max(1.0, max(self._seconds_at(r) for r in points) / base)
