"""Verifiable rewards: answer extraction and checking.

GSM8K-style answers are numbers. From a model completion we take the number after ``####`` if there is
one (after the line's last ``=``: '#### 3 + 4 = 7'), else the last number in the text; commas, ``$`` and
a trailing ``.0`` are normalised away. Model
text is never evaluated (no ``eval``): numbers are parsed with :class:`fractions.Fraction`.

Reward = 1.0 when the extracted number equals the reference, else 0.0, plus an optional small format
reward (``format_reward``, off by default) for completions that use the ``#### <number>`` form.

MATH-style answers (expressions) go through ``math-verify``, always under a timeout so a pathological
expression cannot stall a rollout worker.
"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from fractions import Fraction
from typing import Optional

# a minus sign only where it cannot be a hyphen or a subtraction ('2-3' holds 2 and 3, not -3); commas only
# as thousands separators ('1,234', but '1,2,3' is three numbers)
_SIGN = r"(?:(?<![\w)])-\s?)?"
_NUMBER = _SIGN + r"\$?\s?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|" + _SIGN + r"\$?\s?\.\d+"
_NUMBER_RE = re.compile(_NUMBER)
_HASH_RE = re.compile(r"####\s*(" + _NUMBER + r")")
_HASH_LINE_RE = re.compile(r"####([^\n]*)")
_AFTER_NUMBER_OK = re.compile(r"[.,;:!?)]*")  # what may stick to a marked answer ('#### 12.')


def parse_number(text: str) -> Optional[Fraction]:
    """'1,234' -> 1234, '$5' -> 5, '3.50' -> 7/2, '-2' -> -2; anything else -> None."""
    cleaned = re.sub(r"\$\s*", "", text.strip().replace(",", "")).rstrip(".")
    cleaned = re.sub(r"^-\s+", "-", cleaned)  # ('- 5')
    if not cleaned or not re.fullmatch(r"-?(\d+(\.\d*)?|\.\d+)", cleaned):
        return None
    return Fraction(cleaned)


def extract_answer(completion: str) -> Optional[Fraction]:
    """The number on the last '####' line if there is one (after its last '=', if any), else the last
    number in the completion. A marked answer is that number whole: '#### 3/4' or '#### 1e6' is no
    number (not 3, not 1), and nothing else from the text replaces it."""
    marked = _HASH_LINE_RE.findall(completion)
    if marked:
        line = marked[-1].rsplit("=", 1)[-1]
        found = re.match(r"\s*(" + _NUMBER + r")(\S*)", line)
        if found is None or not _AFTER_NUMBER_OK.fullmatch(found.group(2)):
            return None
        return parse_number(found.group(1))
    numbers = _NUMBER_RE.findall(completion)
    return parse_number(numbers[-1]) if numbers else None


def reference_answer(gsm8k_solution: str) -> Fraction:
    """The reference number of a GSM8K solution (the text after '####'); raises if there is none."""
    marker = gsm8k_solution.rfind("####")
    if marker < 0:
        raise ValueError("GSM8K solution has no '####' answer line")
    value = parse_number(gsm8k_solution[marker + 4 :])
    if value is None:
        raise ValueError(f"GSM8K answer is not a number: {gsm8k_solution[marker + 4:].strip()!r}")
    return value


def numeric_reward(completion: str, reference: str, format_reward: float = 0.0) -> float:
    """1.0 for a numerically equal answer, else 0.0; plus ``format_reward`` for a '#### n' line."""
    expected = parse_number(reference)
    got = extract_answer(completion)
    correct = expected is not None and got is not None and got == expected
    formatted = format_reward if _HASH_RE.search(completion) else 0.0
    return (1.0 if correct else 0.0) + formatted


_VERIFY_POOL: Optional[ThreadPoolExecutor] = None


def math_verify_reward(completion: str, reference: str, timeout_s: float = 5.0) -> float:
    """1.0 if math-verify judges the completion's final expression equal to the reference.

    Runs in a worker thread with a deadline: a timeout counts as wrong (0.0), never as a hang.
    """
    global _VERIFY_POOL
    if _VERIFY_POOL is None:
        _VERIFY_POOL = ThreadPoolExecutor(max_workers=1, thread_name_prefix="math-verify")
    future = _VERIFY_POOL.submit(_math_verify, completion, reference)
    try:
        return 1.0 if future.result(timeout=timeout_s) else 0.0
    except FutureTimeout:
        # The stuck thread cannot be killed; abandon its pool so later checks get a fresh worker.
        _VERIFY_POOL.shutdown(wait=False, cancel_futures=True)
        _VERIFY_POOL = None
        return 0.0


def _math_verify(completion: str, reference: str) -> bool:
    from math_verify import parse, verify

    gold = parse(reference, parsing_timeout=None)
    answer = parse(completion, parsing_timeout=None)
    return bool(gold and answer and verify(gold, answer, timeout_seconds=None))
