"""Selectors ``ucb`` and ``discounted_ucb``: bandits over a drafter pool (MetaSD).

Each round the pool asks ``select(stats)`` for a request's arm (a drafter), and after
verification reports ``update(stats, arm, reward)`` with a reward in [0, 1] (see
``stages.drafters.pool``).  ``begin(num_arms)`` starts a request with fresh statistics (MetaSD
resets per request), unless ``reset=False``: then every request of the run shares one
``BanditStats``, so what earlier (and concurrent) requests taught carries over, and the
exploration of the first rounds is paid once per run instead of once per request.

**UCB1** (Auer, Cesa-Bianchi & Fischer 2002).  Every arm is tried once (in order), then
round t picks

    argmax_i  mean_i + c * sqrt(2 ln t / n_i)

with ``n_i`` the pulls of arm i, ``mean_i`` its mean reward and ``t = sum_i n_i``.  With
c = 1 the expected pulls of an arm with gap Delta_i are <= 8 ln T / Delta_i^2 + 1 + pi^2/3,
so the regret grows as O(log T).

**Discounted UCB** (Garivier & Moulines 2011), for rewards that drift within a request:
every past observation is weighted by ``gamma^(age)``:

    N_i = sum_s gamma^(t-s) [I_s = i],   mean_i = sum_s gamma^(t-s) X_s [I_s = i] / N_i,
    index_i = mean_i + c * sqrt(2 ln (sum_j N_j) / N_i)

so an arm not pulled for a while regains a large bonus and is re-explored.  gamma = 1 is
UCB1.  Ties go to the lowest arm index.

**Warm start** (``prior = m > 0``, with ``reset``): a request starts from what the run's
earlier rounds taught, shrunk so that it weighs at most m pulls per arm (an empirical-Bayes
prior; each arm keeps its run mean):

    n_i(0) = min(N_i, m),   s_i(0) = S_i * n_i(0) / N_i

(N_i, S_i: the run's pulls and summed rewards of arm i, undiscounted, every request's).  The
request's own rounds then outweigh the prior after a few pulls, so it still adapts to its
prompt (a code question favours a model drafter, a summary prompt lookup), but arms the run
found weak are not re-explored from scratch by every request: MetaSD resets per request
and pays that exploration each time.  An arm the run never pulled is still tried first.
"""

from __future__ import annotations

import math

from specflow.errors import ConfigError
from specflow.protocols import BanditStats


def ucb_index(sums: list[float], counts: list[float], c: float) -> list[float]:
    """``mean_i + c * sqrt(2 ln t / n_i)`` with ``t = sum_i n_i`` (``inf`` where n_i = 0)."""
    total = sum(counts)
    log_t = math.log(total) if total > 1 else 0.0
    return [
        s / n + c * math.sqrt(2.0 * log_t / n) if n > 0 else math.inf
        for s, n in zip(sums, counts, strict=True)
    ]


def argmax(values: list[float]) -> int:
    """Index of the largest value; ties go to the lowest index."""
    return max(range(len(values)), key=lambda i: (values[i], -i))


def _check_arms(num_arms: int) -> None:
    if num_arms < 1:
        raise ConfigError(f"a bandit needs at least one arm, got {num_arms}")


class UCBSelector:
    """UCB1, or discounted UCB with ``gamma < 1`` (see module doc).

    Args:
        c: exploration scale (1.0 = UCB1; 0 = greedy after one pull of each arm).
        gamma: discount per round in (0, 1]; 1 = UCB1, about 1 - 1/(rounds remembered)
            otherwise (0.95: ~20).
        reset: forget everything at each request (MetaSD); False keeps the statistics
            across the requests of a run.
        prior: with ``reset``, start each request from the run's statistics shrunk to at
            most this many pulls per arm (warm start, see module doc); 0 = MetaSD's fresh
            start.

    ``BanditStats.counts``: (discounted) pulls per arm (n_i / N_i); ``sums``: (discounted)
    summed rewards per arm.
    """

    def __init__(
        self, c: float = 1.0, gamma: float = 1.0, reset: bool = True, prior: float = 0.0
    ) -> None:
        if c < 0:
            raise ConfigError(f"selector.c must be >= 0, got {c}")
        if not 0.0 < gamma <= 1.0:
            raise ConfigError(f"selector.gamma must be in (0, 1], got {gamma}")
        if prior < 0:
            raise ConfigError(f"selector.prior must be >= 0 (pulls per arm), got {prior}")
        if prior > 0 and not reset:
            raise ConfigError(
                f"selector.prior={prior} warm-starts each request from the run's statistics, "
                "but selector.reset=false already shares them: set one of the two"
            )
        self.c = c
        self.gamma = gamma
        self.reset = reset
        self.prior = prior
        self._shared: BanditStats | None = None  # the run's statistics when reset=False
        self._run: BanditStats | None = None  # every round of the run (warm start)

    def begin(self, num_arms: int) -> BanditStats:
        _check_arms(num_arms)
        if self.reset and self.prior > 0:
            if self._run is None or len(self._run.counts) != num_arms:
                self._run = BanditStats(counts=[0.0] * num_arms, sums=[0.0] * num_arms)
            counts = [min(n, self.prior) for n in self._run.counts]
            sums = [
                s * m / n if n > 0 else 0.0
                for s, m, n in zip(self._run.sums, counts, self._run.counts, strict=True)
            ]
            return BanditStats(counts=counts, sums=sums, teaches=self._run)
        if self.reset:
            return BanditStats(counts=[0.0] * num_arms, sums=[0.0] * num_arms)
        if self._shared is None or len(self._shared.counts) != num_arms:
            self._shared = BanditStats(counts=[0.0] * num_arms, sums=[0.0] * num_arms)
        return self._shared  # carry the run's statistics over

    def select(self, stats: BanditStats) -> int:
        stats.rounds += 1
        index = ucb_index(stats.sums, stats.counts, self.c)  # untried arms first (inf)
        if stats.penalties:  # a pool's switch costs (stages.drafters.pool)
            index = [u - p for u, p in zip(index, stats.penalties, strict=True)]
        return argmax(index)

    def update(self, stats: BanditStats, arm: int, reward: float) -> None:
        if self.gamma < 1.0:
            stats.counts = [n * self.gamma for n in stats.counts]
            stats.sums = [s * self.gamma for s in stats.sums]
        stats.counts[arm] += 1.0
        stats.sums[arm] += reward
        if stats.teaches is not None:  # warm start: the run learns from every request
            stats.teaches.counts[arm] += 1.0
            stats.teaches.sums[arm] += reward


def DiscountedUCBSelector(  # noqa: N802
    gamma: float = 0.95, c: float = 1.0, reset: bool = True, prior: float = 0.0
) -> UCBSelector:
    """Selector ``discounted_ucb``: ``UCBSelector`` with a discount (drift within a request)."""
    return UCBSelector(c=c, gamma=gamma, reset=reset, prior=prior)
