"""Time to first token and time per output token after it (TTFT / TPOT), as vLLM reports
them: the scheduler stamps the round that commits a request's first token; records,
summaries and the console table carry both, for the method and for plain decoding."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specflow.engine import SpeculativePipeline
from specflow.results.measure import decode_times
from specflow.results.records import RunMeta
from specflow.results.run_folder import RunFolder, format_table
from specflow.runner import Runner
from specflow.sampling import SamplingParams
from specflow.scheduler import Generation, generate
from specflow.settings import RunSettings
from specflow.state import RoundStats, StageTimes
from specflow.workload import Request
from stages.acceptors.standard import StandardAcceptor
from stages.drafters.pld import PLDDrafter
from stages.verifiers.full import FullVerifier
from tests.conftest import CharTokenizer

PREFILL_S, ROUND_S = 5.0, 1.0


class ModelClock:
    """Seconds that pass only while the target works: 5 per prefill, 1 per verify pass."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class TimedVerifier:
    """The full verifier, advancing a ``ModelClock`` as it prefills and scores."""

    def __init__(self, lm, clock: ModelClock) -> None:
        self.inner, self.clock = FullVerifier(lm), clock
        self.info = self.inner.info

    def uses(self):
        return self.inner.uses()

    def row_prices(self, states):
        return None

    def begin(self, states):
        self.clock.now += PREFILL_S
        self.inner.begin(states)

    def score(self, states, drafts):
        self.clock.now += ROUND_S
        return self.inner.score(states, drafts)


def _pipe(lm, drafter=None) -> tuple[SpeculativePipeline, ModelClock]:
    clock = ModelClock()
    return SpeculativePipeline(TimedVerifier(lm, clock), StandardAcceptor(), drafter=drafter,
                               clock=clock), clock


def test_ttft_is_the_prefill_and_the_first_round(tiny_target):
    """Plain decoding of 6 tokens: TTFT = prefill + one round = 6 s, the 5 later tokens
    one round each: decode 5 s, TPOT 1 s."""
    _, lm = tiny_target
    pipe, _ = _pipe(lm)
    gen = generate(pipe, [1, 2, 3], 6, stop_token_ids=())
    assert gen.ttft_s == PREFILL_S + ROUND_S
    assert gen.total_s == PREFILL_S + 6 * ROUND_S
    assert gen.decode_s == 5 * ROUND_S
    times = decode_times([gen])
    assert (times.ttft_s, times.decode_s, times.decode_tokens, times.tpot_s) == (6.0, 5.0, 5, 1.0)


def test_speculation_changes_tpot_only(tiny_target):
    """Prompt lookup on a repeating prompt commits several tokens a round: the same TTFT
    as plain decoding (one prefill, one round), TPOT = (rounds - 1) / (tokens - 1)."""
    _, lm = tiny_target
    prompt = [4, 5, 6, 7] * 4
    pipe, _ = _pipe(lm, PLDDrafter(k=4))
    gen = generate(pipe, prompt, 12, stop_token_ids=())
    assert gen.ttft_s == PREFILL_S + ROUND_S
    assert gen.stats.rounds < 12
    assert decode_times([gen]).tpot_s == pytest.approx(
        (gen.stats.rounds - 1) * ROUND_S / (len(gen.tokens) - 1))


def test_decode_times_over_turns_and_unknown_ttft():
    """Two turns: TTFT their mean, decode seconds and tokens summed; a turn of one token
    adds none; a cached baseline without a TTFT leaves the times unknown."""
    a = Generation([1, 2, 3], RoundStats(), StageTimes(), 10.0, "length", ttft_s=4.0)
    b = Generation([1, 2], RoundStats(), StageTimes(), 3.0, "length", ttft_s=2.0)
    one = Generation([9], RoundStats(), StageTimes(), 2.0, "eos", ttft_s=2.0)
    times = decode_times([a, b, one])
    assert (times.ttft_s, times.decode_s, times.decode_tokens) == (pytest.approx(8 / 3), 7.0, 3)
    assert times.tpot_s == pytest.approx(7 / 3)
    cached = Generation([1, 2], RoundStats(), StageTimes(), 3.0, "cached")
    assert decode_times([a, cached]).tpot_s is None


def test_records_summary_and_table_report_ttft_and_tpot(tiny_target, tmp_path: Path):
    """Through the runner, side by side with plain decoding on the same clock: every record
    has the method's and plain's TTFT and decode time, the summary pools TPOT and its
    speed-up, and the console table shows them."""
    _, lm = tiny_target
    pipe, _ = _pipe(lm, PLDDrafter(k=4))
    runner = Runner(pipe, CharTokenizer(), RunSettings(max_new_tokens=10, warmup=False),
                    SamplingParams())
    requests = [Request("r", "qa", ("abcdabcdabcdabcd",)), Request("s", "qa", ("qqqq",))]
    summary = runner.run(requests, RunFolder(tmp_path, resume=False), RunMeta(method="pld"))
    for line in (tmp_path / "requests.jsonl").read_text().splitlines():
        m = json.loads(line)["metrics"]
        assert m["ttft_s"] == m["baseline_ttft_s"] == PREFILL_S + ROUND_S
        assert m["decode_tokens"] == m["baseline_decode_tokens"] == m["new_tokens"] - 1
        assert m["baseline_decode_s"] == m["baseline_decode_tokens"] * ROUND_S
        assert m["tpot_s"] == m["decode_s"] / m["decode_tokens"]
        assert m["tpot_speedup"] == pytest.approx(ROUND_S / m["tpot_s"])
    agg = summary.overall
    decode_s = sum(json.loads(x)["metrics"]["decode_s"]
                   for x in (tmp_path / "requests.jsonl").read_text().splitlines())
    assert agg.ttft_s == agg.baseline_ttft_s == PREFILL_S + ROUND_S
    assert agg.baseline_tpot_s == ROUND_S
    assert agg.tpot_s == pytest.approx(decode_s / (agg.new_tokens - 2))
    assert agg.tpot_speedup == pytest.approx(ROUND_S / agg.tpot_s) and agg.tpot_speedup > 1.0
    row = format_table(summary).splitlines()[-1].split()
    assert row[0] == "ALL" and float(row[5]) == pytest.approx(6000.0)  # ttft_ms
    assert float(row[7]) == pytest.approx(agg.tpot_speedup, abs=1e-3)
