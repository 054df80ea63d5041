"""Draft length ``adaptive``: a cost model measured online per request, maximizing expected
tokens per second, k = 0 (skip drafting: a plain decoding round) included.

Draft tokens are accepted one after the other with probability alpha
(a geometric model), so a round drafting k tokens commits on average

    E[tokens | k] = (1 - alpha^(k+1)) / (1 - alpha)            (bonus included)

and costs ``k * t_draft + t_verify(k + 1)`` seconds, with ``t_verify(n) = t1 * (1 + beta (n-1))``
(one target pass over n tokens; beta is the marginal cost of an extra token, measured).
beta is estimated from two moving averages taken over the same recent rounds, ``v`` of a
drafting round's verification seconds and ``kbar`` of its draft length:
``beta = max(0, (v / t1 - 1) / kbar)`` (the linear model averaged), recomputed whenever ``t1``
or ``v`` moves, so a verification measured at a longer context than an old ``t1`` does not
stay in beta as a cost of drafting once a plain round re-measures ``t1``.
It picks ``argmax_k E[tokens | k] / cost(k)`` over ``0..limit``.

Priced rows (``row_prices: true``, the default).  Where the target verifier measured what its
passes cost by row count (the row probe of a packed CPU model, ``TargetVerifier.row_prices``)
and its passes are whole (no drafter or intermediate verifier has run the target's first
layers for it: the engine gives no prices otherwise), beta is not fitted.  A round drafting k
tokens verifies ``o + 1 + w k`` rows, with o the other requests' rows in the batch's pass (0
at batch 1) and w the rows a drafted token brings (1 for a chain, about the branches for a
tree), both averaged over the request's rounds, and

    t_verify(k) = t1 * price(o + 1 + w k),     a plain round: t1 * price(o + 1)

with the row padding in the price (a pass of at most ``model.min_rows`` rows costs a step).
Why it is the default: one verification's seconds vary by about a third, so beta fitted from
round times swings widely within one request, while the probe's price is one number per
process; in interleaved comparisons on the 1.5B and SmolLM2 it was ahead of the fitted beta
in most.  It is not exact (the probe times the matmuls of four layers, not a whole pass).
Every round measures t1 too, as ``verify_s / price(rows of the pass)``, so no request needs
a plain round to measure it, and a plain round is only ever the policy's choice.

alpha is estimated from the positions tried (a position is tried when every earlier one was
accepted), with a Beta(1, 1) prior and a discount so it follows drift within a request, and
used optimistically (alpha + ``optimism`` standard errors).

With ``acceptance: per_position`` each draft position j = 1, 2, ... has its own rate alpha_j
(the share of drafts whose j-th token was accepted once the first j - 1 were), and

    E[tokens | k] = 1 + sum_{j<=k} prod_{i<=j} alpha_i

A drafter whose second token is accepted far less often than its first (a feature head
drafting from its own predicted features) is over-drafted by the geometric model, which
pools both.  alpha_j is shrunk towards the pooled estimate with ``position_strength``
pseudo-positions, so a position tried rarely (a deep one) behaves as the geometric model
until its own evidence counts.

Per part of the drafter (``Drafter.next_part``): a fallback drafter is two drafters, prompt
lookup where the context has a match and a head or draft model elsewhere, and their drafts
are worth different lengths (a copy, once it matches, is accepted far more often than a
head's token, and costs nothing to draft).  Each request keeps one cost model per part,
chosen with and fed by that part's rounds only, so the copies are asked for at their own
length and the head at its own.  t1 (and with it the plain rounds) is the target's: a plain
round (with priced rows, any round) updates every part's t1; the part that sat out counts a
plain round in its ``plain_streak``.  A drafter of one part has one model.
``by_part: false`` pools every part in one model.

A new request inherits, per part, the previous request's times and, shrunk to
``prior_strength`` positions, its acceptance evidence: short answers would otherwise be over
before the model has learned anything.
After ``probe_every`` plain rounds in a row it drafts one token to re-measure a skipped
drafter (cost: ~1/probe_every of a token); with ``idle_discount < 1`` each plain round also
shrinks the acceptance evidence (pooled and per position) by that factor, so the longer a
drafter sits out, the closer its estimate returns to the optimistic Beta(1, 1) prior and the
sooner the policy tries it again (evidence gathered at a break-even acceptance otherwise
keeps a useful drafter out for the rest of a request).  Without priced rows, each request
runs one plain round early (its second round, or its first when timings are inherited or the
first round is plain anyway: `first_token_plain` below) so
that t1 is measured, not derived: from drafting rounds alone t1 and beta cannot be told
apart, and t1 grows with the context.
A model drafter that is behind (its lazy prefill, tokens committed while it sat idle) must
catch up before it drafts: one pass of its model over the n positions behind, priced

    t_catchup(n) = t_draft + c (n - 1)

(a pass's fixed cost, about a drafted token's, and c seconds per further position).  c is
measured from catch-ups of at least ``CATCHUP_FIT_ROWS`` positions (a prefill, a long idle
spell), as ``(seconds - t_draft) / (n - 1)``: a pass over many rows costs far less per row
than one over two, so the per-position cost of the short catch-ups that follow most drafting
rounds, carried to a prompt's length, would price a useful drafter out of every later
request.  That one-off cost is charged against drafting: the policy resumes only when the
expected saving over the tokens still allowed pays it back, and skips re-probes costing more
than ``probe_budget`` of the remaining time.

With ``first_token_plain`` (the default) a request's first round is plain whenever drafting
would first cost a catch-up, or might (the part has drafted in no request yet, so nothing says
it needs none): the first token then comes after one target pass, as in plain decoding,
instead of after the drafter's prefill too (time to first token), and the drafter catches up
in a later round, at most one round's saving lost.  Prompt lookup, once measured (it never
catches up), drafts the first round.

``forget()`` drops the prior carried from request to request: the runner calls it after its
untimed warm-up, whose fixed prompt says nothing of how often the drafter is right on the
workload (a warm-up draft rejected there kept a drafter out of a whole run).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from specflow.costs import RowPrices
from specflow.errors import ConfigError
from specflow.state import DecodeState, RequestLocal, RoundReport

# Catch-ups of at least this many positions measure a drafter's cost per further position (a
# shorter one, only until one of these is seen): module doc.
CATCHUP_FIT_ROWS = 8


@dataclass
class CostModel:
    """Online estimates of one request (see module doc)."""

    tried: float = 0.0  # discounted count of draft positions tried
    accepted: float = 0.0  # discounted count of those accepted
    t_draft: float | None = None  # seconds per drafted token (EMA)
    t1: float | None = None  # seconds of a one-token target pass (EMA)
    beta: float = 0.1  # marginal cost of an extra verified token, relative to t1
    plain_streak: int = 0  # consecutive rounds without drafting
    t1_measured: bool = False  # a round of this request measured t1 (a plain one, unpriced)
    t_catchup: float | None = None  # c: seconds per further position of a catch-up (EMA)
    synced_at: int | None = None  # sequence length at this request's last drafting round
    verify_draft: float | None = None  # seconds of a drafting round's verification (EMA)
    k_draft: float | None = None  # tokens drafted in a drafting round (EMA, same weights)
    pos_tried: list[float] = field(default_factory=list)  # [j]: position j+1 tried (discounted)
    pos_accepted: list[float] = field(default_factory=list)  # [j]: ... and accepted
    width: float | None = None  # verify rows per drafted depth (EMA; 1: chains; priced rows)
    others: float | None = None  # the other requests' rows in the pass (EMA; priced rows)

    def refit_beta(self) -> None:
        """beta from the drafting rounds' averages against the current t1 (module doc)."""
        if self.t1_measured and self.t1 and self.verify_draft is not None and self.k_draft:
            self.beta = max(0.0, (self.verify_draft / self.t1 - 1.0) / self.k_draft)

    def alpha(self, optimism: float) -> float:
        mean = (self.accepted + 1.0) / (self.tried + 2.0)
        stderr = math.sqrt(mean * (1.0 - mean) / (self.tried + 2.0))
        return min(0.999, mean + optimism * stderr)

    def position_alphas(self, k: int, optimism: float, strength: float) -> list[float]:
        """alpha_1 .. alpha_k (module doc): each position's own evidence plus ``strength``
        pseudo-positions at the pooled mean, used optimistically like ``alpha``."""
        pooled = (self.accepted + 1.0) / (self.tried + 2.0)
        out = []
        for j in range(k):
            n = (self.pos_tried[j] if j < len(self.pos_tried) else 0.0) + strength
            a = self.pos_accepted[j] if j < len(self.pos_accepted) else 0.0
            mean = (a + strength * pooled) / n if n > 0 else pooled
            stderr = math.sqrt(mean * (1.0 - mean) / max(n, 1.0))
            out.append(min(0.999, mean + optimism * stderr))
        return out

    def record_positions(self, drafted: int, accepted: int, discount: float) -> None:
        """A drafting round of ``drafted`` tokens: the evidence of positions 1 .. drafted
        decays by ``discount`` (a deeper position learns nothing from a shorter draft, so it
        keeps its evidence); positions 1 .. min(accepted + 1, drafted) were tried, 1 ..
        accepted accepted."""
        tried = min(accepted + 1, drafted)
        grow = tried - len(self.pos_tried)
        if grow > 0:
            self.pos_tried += [0.0] * grow
            self.pos_accepted += [0.0] * grow
        for j in range(min(drafted, len(self.pos_tried))):
            self.pos_tried[j] = discount * self.pos_tried[j] + (1.0 if j < tried else 0.0)
            self.pos_accepted[j] = discount * self.pos_accepted[j] + (
                1.0 if j < accepted else 0.0)

    def scale_evidence(self, factor: float) -> None:
        """Shrink the acceptance evidence (pooled and per position) by ``factor``."""
        self.tried *= factor
        self.accepted *= factor
        self.pos_tried = [t * factor for t in self.pos_tried]
        self.pos_accepted = [a * factor for a in self.pos_accepted]


def expected_tokens(alpha: float, k: int) -> float:
    """Mean tokens a k-token round commits under the geometric model, bonus included."""
    return float(k + 1) if alpha >= 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def expected_tokens_by_position(alphas: list[float], k: int) -> float:
    """``1 + sum_{j<=k} prod_{i<=j} alpha_i``: mean tokens of a k-token round, bonus
    included, when position j is accepted with ``alphas[j-1]`` once the earlier ones were."""
    total, reach = 1.0, 1.0
    for a in alphas[:k]:
        reach *= a
        total += reach
    return total


ACCEPTANCE_MODELS = ("geometric", "per_position")


class AdaptiveDraftLength:
    """Choose k each round to maximize expected tokens per second (see module doc).

    Args:
        discount: weight kept by old observations per round (drift within a request).
        optimism: standard errors added to alpha (re-probing a skipped drafter).
        beta_prior: marginal verification cost per extra token before any measurement.
        ema: smoothing of the measured times.
        probe_every: after this many plain rounds in a row, draft one token to re-measure.
        prior_strength: how many draft positions of evidence a new request inherits from
            the previous ones (0: every request starts from the Beta(1, 1) prior).
        probe_budget: a re-probe is skipped while the drafter's catch-up (its prefill, or the
            tokens committed while it sat idle) would cost more than this fraction of the
            request's remaining time at plain-decoding speed.
        idle_discount: weight kept by the acceptance evidence per plain round (1: none
            lost while the drafter sits out; module doc).
        acceptance: ``geometric`` (one alpha for every draft position) or
            ``per_position`` (alpha_j per position, shrunk towards the pooled one; module doc).
        position_strength: with ``per_position``, the pseudo-positions at the pooled mean
            that each position's estimate starts from.
        by_part: one cost model per part of the drafter (``Drafter.next_part``; module
            doc); false: one for all parts, whichever drafts (with priced rows, a part's
            chains and another's trees then share one average width).
        row_prices: price verify rows with the target verifier's measured ``row_prices``
            where it has them (the default; module doc); false: fit beta from the rounds'
            times always.
        first_token_plain: a request's first round is plain where drafting would first
            cost a catch-up, or might (the first token after one target pass; module doc).
    """

    def __init__(
        self,
        discount: float = 0.95,
        optimism: float = 0.5,
        beta_prior: float = 0.1,
        ema: float = 0.3,
        probe_every: int = 16,
        prior_strength: float = 8.0,
        probe_budget: float = 0.05,
        idle_discount: float = 1.0,
        acceptance: str = "geometric",
        position_strength: float = 2.0,
        by_part: bool = True,
        row_prices: bool = True,
        first_token_plain: bool = True,
    ) -> None:
        if acceptance not in ACCEPTANCE_MODELS:
            raise ConfigError(
                f"draft_length.acceptance must be one of {list(ACCEPTANCE_MODELS)}, "
                f"got '{acceptance}'"
            )
        if position_strength < 0:
            raise ConfigError(
                f"draft_length.position_strength must be >= 0, got {position_strength}"
            )
        self.acceptance = acceptance
        self.position_strength = position_strength
        self.by_part = by_part
        self.row_prices = row_prices
        self.first_token_plain = first_token_plain
        self._prices: RowPrices | None = None  # the target's, once given (use_prices)
        if not 0.0 < discount <= 1.0:
            raise ConfigError(f"draft_length.discount must be in (0, 1], got {discount}")
        if not 0.0 < idle_discount <= 1.0:
            raise ConfigError(
                f"draft_length.idle_discount must be in (0, 1], got {idle_discount}"
            )
        self.idle_discount = idle_discount
        self.discount = discount
        self.optimism = optimism
        self.beta_prior = beta_prior
        self.ema = ema
        self.probe_every = probe_every
        self.prior_strength = prior_strength
        self.probe_budget = probe_budget
        # Per part: the model of the latest request that part drafted for (the next
        # request's prior for that part).
        self._last: dict[str, CostModel] = {}
        # Per request: one cost model per part of the drafter (module doc).
        self._models: RequestLocal[dict[str, CostModel]] = RequestLocal(lambda _state: {})

    def begin(self, state: DecodeState) -> None:
        """A new request starts with no part's model; each is made on the part's first
        round (``cost_model``)."""
        self._models.set(state, {})

    def use_prices(self, prices: RowPrices | None) -> None:
        """The target's pass price by row count (kept only with ``row_prices``)."""
        self._prices = prices if self.row_prices else None

    @property
    def prices(self) -> RowPrices | None:
        """The row prices in use (``None``: beta fitted from the rounds' times)."""
        return self._prices

    def verify_seconds(self, m: CostModel, k: int) -> float:
        """Expected seconds of the verification of a round drafting ``k`` tokens (0: a plain
        round): ``t1 * price(o + 1 + w k)`` with priced rows, else ``t1 * (1 + beta k)``
        (module doc)."""
        assert m.t1 is not None
        if self._prices is not None:
            return m.t1 * self._prices((m.others or 0.0) + 1.0 + (m.width or 1.0) * k)
        return m.t1 * (1.0 + m.beta * k)

    def _inherit(self, part: str) -> CostModel:
        """A part's model for a new request: what earlier requests of this run measured
        for that part, the times as they were and the acceptance evidence shrunk to
        ``prior_strength`` positions (a fresh model for a part not seen yet)."""
        prev = self._last.get(part)
        if prev is None:
            return CostModel(beta=self.beta_prior)
        scale = min(1.0, self.prior_strength / prev.tried) if prev.tried > 0 else 0.0
        model = CostModel(
            tried=prev.tried,
            accepted=prev.accepted,
            t_draft=prev.t_draft,
            t1=prev.t1,
            beta=prev.beta,
            t_catchup=prev.t_catchup,
            width=prev.width,
            others=prev.others,
            pos_tried=list(prev.pos_tried),
            pos_accepted=list(prev.pos_accepted),
        )
        model.scale_evidence(scale)
        return model

    def cost_model(self, state: DecodeState, part: str = "") -> CostModel:
        """The request's online estimates for ``part`` of the drafter, made on first use.
        t1 and the batch's other rows are the target's, so a part's new model takes them
        from its siblings (a measured t1; the other rows as last seen)."""
        if not self.by_part:
            part = ""
        models = self._models.get(state)
        model = models.get(part)
        if model is None:
            model = self._inherit(part)
            measured = [m for m in models.values() if m.t1_measured]
            if measured:
                model.t1, model.t1_measured = measured[0].t1, True
                model.refit_beta()
            if model.others is None:  # the batch's other rows, as a sibling saw them
                model.others = next(
                    (m.others for m in models.values() if m.others is not None), None)
            models[part] = model
        return model

    def choose(self, state: DecodeState, limit: int, part: str = "") -> int:
        m = self.cost_model(state, part)
        catchup = self._catchup_cost(state, m)
        if self.first_token_plain and len(state.tokens) == state.prompt_len and (
                m.t_draft is None or catchup > 0.0):
            return 0  # the first token first: the drafter may have to catch up (module doc)
        if m.t1 is None or m.t_draft is None:
            return limit  # measure a drafting round first
        if not m.t1_measured and self._prices is None:
            # One plain round per request measures t1 itself: derived from drafting rounds
            # alone, t1 and beta are confounded (and t1 grows with the context length).
            # With priced rows every round measures t1 (module doc).
            return 0
        remaining = max(0, state.max_len - 1 - len(state.tokens))  # tokens still allowed
        plain_s = self.verify_seconds(m, 0)  # a plain round's seconds (t1 unpriced)
        if m.plain_streak >= self.probe_every:
            # Re-probe a skipped drafter (it may have become useful), unless bringing it up
            # to date would cost more than `probe_budget` of what is left to decode.
            return 1 if catchup <= self.probe_budget * remaining * plain_s else 0
        alpha = m.alpha(self.optimism)
        alphas = (m.position_alphas(limit, self.optimism, self.position_strength)
                  if self.acceptance == "per_position" else [])
        best_k, best_rate = 0, 1.0 / plain_s
        for k in range(1, limit + 1):
            cost = k * m.t_draft + self.verify_seconds(m, k)
            tokens = (expected_tokens_by_position(alphas, k) if alphas
                      else expected_tokens(alpha, k))
            rate = tokens / cost
            if rate > best_rate:
                best_k, best_rate = k, rate
        if best_k and catchup > remaining * (plain_s - 1.0 / best_rate):
            return 0  # drafting would pay per token, but not back the drafter's catch-up
        return best_k

    @staticmethod
    def _catchup_cost(state: DecodeState, m: CostModel) -> float:
        """Expected seconds to bring the drafter up to date before it can draft, for the n
        positions committed since this request's last drafting round (all of them when it
        has not drafted yet: its prefill): ``t_draft + c (n - 1)`` (module doc).  Zero until
        a catch-up was measured (model-free drafters never need one)."""
        if m.t_catchup is None:
            return 0.0
        behind = len(state.tokens) - (m.synced_at or 0)
        return (m.t_draft or 0.0) + m.t_catchup * (behind - 1) if behind > 1 else 0.0

    def forget(self) -> None:
        """Drop the prior carried from request to request: the next request starts as a
        run's first does (module doc)."""
        self._last.clear()

    def observe(self, state: DecodeState, report: RoundReport) -> None:
        drafted, accepted = report.drafted, report.accepted
        draft_s, verify_s, catchup_s = report.draft_s, report.verify_s, report.catchup_s
        part = report.part if self.by_part else ""
        m = self.cost_model(state, part)
        self._last[part] = m
        w = self.ema

        def smooth(old: float | None, new: float) -> float:
            return new if old is None else (1 - w) * old + w * new

        rows = report.rows or drafted + 1
        batch_rows = max(report.batch_rows, rows)
        # A plain round measures t1 (the target's, so every part's), and with priced rows
        # so does every round: seconds of its pass over the price of the pass's rows.
        t1_seen = (verify_s / self._prices(batch_rows) if self._prices is not None
                   else verify_s if drafted == 0 else None)
        if t1_seen is not None:
            for other in self._models.get(state).values():
                other.t1 = t1_seen if not other.t1_measured else smooth(other.t1, t1_seen)
                other.t1_measured = True
                other.refit_beta()
                other.others = smooth(other.others, float(batch_rows - rows))
        if drafted == 0:
            m.plain_streak += 1  # the part that sat out
            m.scale_evidence(self.idle_discount)
            return
        m.plain_streak = 0
        behind = len(state.tokens) - (m.synced_at or 0)
        if catchup_s > 0.0 and behind > 1 and (behind >= CATCHUP_FIT_ROWS or m.t_catchup is None):
            # c from this catch-up, its fixed part taken as this round's drafted token's cost
            further = max(0.0, catchup_s - draft_s / drafted) / (behind - 1)
            m.t_catchup = smooth(m.t_catchup, further)
        m.synced_at = len(state.tokens)
        m.tried = self.discount * m.tried + min(accepted + 1, drafted)
        m.accepted = self.discount * m.accepted + accepted
        m.record_positions(drafted, accepted, self.discount)
        m.t_draft = smooth(m.t_draft, draft_s / drafted)
        m.width = smooth(m.width, (rows - 1) / drafted)
        m.verify_draft = smooth(m.verify_draft, verify_s)
        m.k_draft = smooth(m.k_draft, float(drafted))
        if m.t1 is None:
            m.t1 = verify_s / (1.0 + m.beta * drafted)  # until a plain round measures it
        m.refit_beta()  # once a plain round has measured t1
