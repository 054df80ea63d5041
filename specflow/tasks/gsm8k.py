"""GSM8K exact match: extract a model's final number and compare it with the ``#### N`` answer.

GSM8K (Cobbe et al., 2021) is MIT-licensed (OpenAI); the references used here come from the
Spec-Bench data (category ``math_reasoning``), whose answers end with ``#### N``.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

# A number: optional minus (not when it is a hyphen between digits), then either a
# thousands-grouped integer ("1,234,567") or plain digits, then an optional decimal part.
# The decimal part needs a digit after the point, so a sentence's full stop is left out.
_NUM = r"(?<!\d)-?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|(?<!\d)-?\.\d+"
_NUM_RE = re.compile(_NUM)
_HASH_RE = re.compile(r"####\s*(.*)")
_BOXED_RE = re.compile(r"\\boxed\s*\{((?:[^{}]|\{[^{}]*\})*)\}")
_ANSWER_RE = re.compile(r"\banswer\b(?:\s+is)?[^0-9\n\-]{0,20}?(" + _NUM + ")", re.IGNORECASE)


def normalize_number(text: str) -> str | None:
    """Canonical string form of a number: no commas, no trailing zeros (``"3.50"`` -> ``"3.5"``,
    ``"1,000.00"`` -> ``"1000"``, ``"-0"`` -> ``"0"``); None when it is not a number."""
    try:
        value = Decimal(text.replace(",", "").strip())
    except InvalidOperation:
        return None
    if not value.is_finite():
        return None
    if value == value.to_integral_value():
        return str(int(value))
    return format(value.normalize(), "f")


def _last_number(text: str) -> str | None:
    matches = _NUM_RE.findall(text)
    return normalize_number(matches[-1]) if matches else None


def _first_number(text: str) -> str | None:
    match = _NUM_RE.search(text)
    return normalize_number(match.group(0)) if match else None


def extract_final_number(text: str) -> str | None:
    """The final numeric answer in ``text``, normalised, or None when there is no number.

    Looks, in order, for the last ``#### N`` (GSM8K's own format), the last ``\\boxed{N}``,
    the last "the answer is N" / "Answer: N", and otherwise takes the last number in the text.
    Commas, currency signs and a trailing full stop are ignored; ``3.50`` and ``3.5`` agree.
    """
    hashes = _HASH_RE.findall(text)
    if hashes:
        number = _first_number(hashes[-1])
        if number is not None:
            return number
    boxed = _BOXED_RE.findall(text)
    if boxed:
        number = _first_number(boxed[-1])
        if number is not None:
            return number
    answers = _ANSWER_RE.findall(text)
    if answers:
        number = normalize_number(answers[-1])
        if number is not None:
            return number
    return _last_number(text)


def reference_answer(reference: str) -> str | None:
    """The normalised answer of a GSM8K reference solution (the number after ``####``)."""
    return extract_final_number(reference)


def gsm8k_correct(output: str, reference: str) -> bool:
    """True when the model's final number equals the reference's ``#### N`` answer."""
    expected = reference_answer(reference)
    if expected is None:
        raise ValueError(f"GSM8K reference has no final number: {reference[-80:]!r}")
    predicted = extract_final_number(output)
    return predicted is not None and predicted == expected
