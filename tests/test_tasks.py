"""Task-accuracy metrics: GSM8K extraction, sandboxed HumanEval, BLEU/ROUGE, routing."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import pytest

from specflow.tasks import humaneval, text_metrics
from specflow.tasks.gsm8k import extract_final_number, gsm8k_correct, normalize_number
from specflow.tasks.scoring import aggregate_scores, first_reference, score_request

SPECBENCH = Path(__file__).resolve().parents[1] / "specflow/data/specbench/question.dev.jsonl"


# --- GSM8K -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("So it cost 600+400=$<<600+400=1000>>1000 in total.\n#### 1000", "1000"),
        ("#### 1,234", "1234"),
        ("The total is \\boxed{42}.", "42"),
        ("Thus $\\boxed{\\$18}$ dollars.", "18"),
        ("The answer is 7.", "7"),
        ("Therefore, the answer is: $1,250.", "1250"),
        ("She loses 5 dollars, so the answer is -5", "-5"),
        ("It costs $3.50 each.", "3.5"),
        ("Each costs 3.5, so 2 cost 7.00.", "7"),
        ("He had 12 apples, ate 3 and has 9 left.", "9"),
        ("The temperature fell to -12 degrees.", "-12"),
        ("Pages 10-20 were read.", "20"),
        ("He earns 1,000,000 a year.", "1000000"),
        ("A fraction: 0.25 of it.", "0.25"),
        ("First 4, then \\boxed{16}, and later 99.", "16"),
        ("#### 72\nThe answer is 5", "72"),
        ("There is no number here.", None),
        ("", None),
    ],
)
def test_extract_final_number(text: str, expected: str | None) -> None:
    assert extract_final_number(text) == expected


def test_normalize_number() -> None:
    assert normalize_number("3.50") == normalize_number("3.5") == "3.5"
    assert normalize_number("1,000.00") == "1000"
    assert normalize_number("-0") == "0"
    assert normalize_number("abc") is None


def test_gsm8k_correct() -> None:
    reference = "He pays 400*.5=$<<400*.5=200>>200 more.\nSo 600+400=1000 in total.\n#### 1000"
    assert gsm8k_correct("Supplies 400, tickets 600, so the answer is $1,000.", reference)
    assert gsm8k_correct("#### 1000.00", reference)
    assert not gsm8k_correct("Tickets cost 600.", reference)
    assert not gsm8k_correct("I do not know.", reference)
    assert gsm8k_correct("x = 3.50", "#### 3.5")
    assert gsm8k_correct("The answer is -4", "#### -4")
    with pytest.raises(ValueError):
        gsm8k_correct("1", "no number")


def test_specbench_gsm8k_references_parse() -> None:
    """The vendored Spec-Bench dev split's math references parse as GSM8K answers."""
    rows = [json.loads(line) for line in SPECBENCH.read_text().splitlines() if line.strip()]
    refs = [first_reference(r["reference"]) for r in rows if r["category"] == "math_reasoning"]
    assert refs and all(gsm8k_correct(ref, ref) for ref in refs)
    assert gsm8k_correct("The answer is 1000.", refs[0])  # the first dev question: #### 1000


# --- HumanEval ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def problems() -> list[dict]:
    return humaneval.load_problems(limit=3)


def test_load_problems(problems: list[dict]) -> None:
    assert [p["task_id"] for p in problems] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    assert problems[0]["entry_point"] == "has_close_elements"
    assert set(problems[0]) >= {"prompt", "canonical_solution", "test", "entry_point"}


def test_build_prompt(problems: list[dict]) -> None:
    prompt = humaneval.build_prompt(problems[0])
    assert "```python" in prompt and problems[0]["prompt"].strip() in prompt
    assert "has_close_elements" in prompt


def test_canonical_solution_passes(problems: list[dict]) -> None:
    problem = problems[0]
    code = humaneval.extract_code(problem, problem["canonical_solution"])  # raw continuation
    assert humaneval.check_correctness(problem, code)


def test_wrong_solution_fails(problems: list[dict]) -> None:
    problem = problems[0]
    code = humaneval.extract_code(problem, "    return False\n")
    result = humaneval.run_program(humaneval.build_program(problem, code))
    assert not result.passed and result.status == "failed"
    assert "AssertionError" in result.stderr_tail
    assert not humaneval.check_correctness(problem, "def has_close_elements(:\n")  # syntax


def test_chat_answer_code_block(problems: list[dict]) -> None:
    problem = problems[2]  # truncate_number
    answer = (
        "Here is the implementation:\n\n```python\ndef truncate_number(number: float) -> float:\n"
        "    return number % 1.0\n```\n\nAnd an example:\n```\n>>> truncate_number(3.5)\n```"
    )
    code = humaneval.extract_code(problem, answer)
    assert code.startswith(problem["prompt"].rstrip()) and "number % 1.0" in code
    assert code.endswith("    return number % 1.0\n") and "```" not in code  # not the example
    assert score_request("humaneval", answer, None, problem=problem) == {"task/pass@1": 1.0}
    wrong = "```python\ndef truncate_number(number: float) -> float:\n    return number\n```"
    assert score_request("humaneval", wrong, None, problem=problem) == {"task/pass@1": 0.0}


def test_raw_completion_stops_at_stop_sequences(problems: list[dict]) -> None:
    problem = problems[2]
    code = humaneval.extract_code(problem, "    return number % 1.0\n\nprint('junk')\n")
    assert code == problem["prompt"] + "    return number % 1.0\n"
    assert humaneval.check_correctness(problem, code)


def test_infinite_loop_is_killed(problems: list[dict]) -> None:
    problem = problems[2]
    code = humaneval.extract_code(problem, "    while True:\n        pass\n")
    start = time.monotonic()
    result = humaneval.run_program(humaneval.build_program(problem, code), timeout_s=1.0)
    assert time.monotonic() - start < 5.0
    assert not result.passed and result.status in ("timeout", "failed")  # wall or CPU limit
    start = time.monotonic()
    assert not humaneval.check_correctness(problem, "import time\ntime.sleep(60)\n", timeout_s=1.0)
    assert time.monotonic() - start < 5.0


def test_side_effects_stay_in_the_subprocess(
    problems: list[dict], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    problem = problems[2]
    main_cwd = tmp_path / "main_cwd"
    main_cwd.mkdir()
    monkeypatch.chdir(main_cwd)
    monkeypatch.delenv("SPECFLOW_SANDBOX_MARK", raising=False)
    solution = (  # the proof goes to stderr: the sandbox refuses writes outside its folder
        "import json, os, sys\n"
        "os.environ['SPECFLOW_SANDBOX_MARK'] = '1'\n"
        "os.system('echo hi > from_shell.txt')\n"
        "open('from_python.txt', 'w').write('x')\n"
        "print('PROOF' + json.dumps({'pid': os.getpid(), 'cwd': os.getcwd(),"
        " 'files': sorted(os.listdir('.'))}), file=sys.stderr)\n"
        "os.chdir('/')\n"
        "def truncate_number(number):\n"
        "    return number % 1.0\n"
    )
    code = problem["prompt"] + "    pass\n\n" + solution
    assert humaneval.check_correctness(problem, code)
    result = humaneval.run_program(humaneval.build_program(problem, code))
    assert result.passed
    seen = json.loads(result.stderr_tail.split("PROOF", 1)[1].splitlines()[0])
    assert seen["pid"] != os.getpid()
    assert {"from_shell.txt", "from_python.txt", "program.py"} <= set(seen["files"])
    assert not Path(seen["cwd"]).exists()  # the temporary directory is gone
    assert Path.cwd() == main_cwd and list(main_cwd.iterdir()) == []
    assert "SPECFLOW_SANDBOX_MARK" not in os.environ


def test_memory_limit() -> None:
    result = humaneval.run_program("x = bytearray(8 * 1024**3)\n", timeout_s=5.0)
    assert not result.passed and "MemoryError" in result.stderr_tail


# --- text metrics ------------------------------------------------------------------------


def test_bleu() -> None:
    sentence = "The quick brown fox jumps over the lazy dog ."
    assert text_metrics.sentence_bleu(sentence, sentence) == pytest.approx(100.0)
    assert text_metrics.corpus_bleu([sentence], [sentence]) == pytest.approx(100.0)
    assert text_metrics.sentence_bleu("alpha beta gamma delta", "one two three four") < 1e-6
    assert text_metrics.corpus_bleu(["alpha beta gamma delta"], ["one two three four"]) == 0.0
    # Brevity penalty only: every n-gram matches, hypothesis 4 tokens vs reference 5.
    assert text_metrics.sentence_bleu("a b c d", ["a b c d e", "x y"]) == pytest.approx(
        100 * math.exp(1 - 5 / 4)
    )
    assert text_metrics.corpus_bleu(["a b c d", "a b c d"], [["a b c d", "q"], ["a b c d"]]) == (
        pytest.approx(100.0)
    )


def test_rouge() -> None:
    text = "The cat sat on the mat."
    assert text_metrics.rouge_l(text, text) == pytest.approx(1.0)
    scores = text_metrics.rouge("the cat sat", "the cat sat on the mat")
    assert scores["rougeL"] == pytest.approx(2 / 3)  # P = 1, R = 1/2
    assert scores["rouge1"] == pytest.approx(2 / 3)
    assert scores["rouge2"] == pytest.approx(2 * 1 * 0.4 / 1.4)  # P = 2/2, R = 2/5
    assert text_metrics.rouge_l("alpha beta", "gamma delta") == 0.0


def test_answer_match() -> None:
    assert text_metrics.answer_match("It was W. Edwards Deming.", ["W. Edwards Deming"])
    assert text_metrics.answer_match("In the 1840s, gold ...", ["1840s", "the 1840s"])
    assert not text_metrics.answer_match("In 1850.", ["1840s"])
    assert not text_metrics.answer_match("Panthers", "the")  # an article alone matches nothing


# --- routing and aggregation -------------------------------------------------------------


def test_score_request_routing() -> None:
    assert score_request("math_reasoning", "The answer is 18.", ["... #### 18"]) == {
        "task/gsm8k_exact": 1.0
    }
    assert score_request("math_reasoning", "17", "#### 18") == {"task/gsm8k_exact": 0.0}
    assert score_request("translation", "a b c d", ["a b c d"]) == {
        "task/bleu": pytest.approx(100.0)
    }
    assert score_request("summarization", "the cat sat", "the cat sat on the mat") == {
        "task/rouge_l": pytest.approx(2 / 3)
    }
    assert score_request("rag", "Dustin Johnson won.", [["Dustin Johnson"]]) == {
        "task/answer_match": 1.0
    }
    for category in ("writing", "qa", "coding", "math", "reasoning", "unknown"):
        assert score_request(category, "anything", None) == {}
    with pytest.raises(ValueError):
        score_request("humaneval", "code", None)
    with pytest.raises(TypeError):
        score_request("translation", "text", None)


def test_aggregate_scores() -> None:
    records = [
        ("math_reasoning", {"task/gsm8k_exact": 1.0}, "#### 3", "#### 3"),
        ("math_reasoning", {"task/gsm8k_exact": 0.0}, "#### 4", "#### 3"),
        ("math_reasoning", {"task/gsm8k_exact": 1.0}, "#### 5", "#### 5"),
        ("translation", {"task/bleu": 100.0}, "a b c d", ["a b c d"]),
        ("translation", {"task/bleu": 100 * math.exp(1 - 5 / 4)}, "e f g h", "e f g h i"),
        ("writing", {}, "essay", None),
    ]
    summary = aggregate_scores(records)
    assert set(summary) == {
        "task/gsm8k_exact",
        "task/bleu",
        "task/bleu_corpus",
        "task/n/math_reasoning",
        "task/n/translation",
    }
    assert summary["task/gsm8k_exact"] == pytest.approx(2 / 3)
    assert summary["task/n/math_reasoning"] == 3.0 and summary["task/n/translation"] == 2.0
    assert summary["task/bleu"] == pytest.approx((100 + 100 * math.exp(-0.25)) / 2)
    # Corpus BLEU: all n-grams match, brevity penalty over 8 hypothesis vs 9 reference tokens.
    assert summary["task/bleu_corpus"] == pytest.approx(100 * math.exp(1 - 9 / 8))
    assert aggregate_scores([]) == {}
