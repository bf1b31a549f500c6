"""Math rule reward: 1.0 when the response's final answer equals the ground truth, else 0.0.

    math_rule_reward("37 + 48 = 85. \\\\boxed{85}", "85")                  # 1.0
    math_rule_reward("so x = \\\\boxed{\\\\frac{3}{4}}", "0.75")             # 1.0 (numeric)
    math_rule_reward("The answer is 2*sqrt(2).", "sqrt(8)")             # 1.0 (symbolic)
    math_rule_reward("... 85", "85", last_number_fallback=True)         # 1.0

The final answer is, in order of preference: the last ``\\boxed{...}`` (nested braces allowed), the
text after the last "answer is" / "answer:", or (only with ``last_number_fallback=True``) the last
number in the response. Both sides are normalised (surrounding ``$``, ``\\text{}``, thousands
commas, a trailing period, spaces, ``\\left``/``\\right``, ``\\dfrac``) and compared exactly, then as
numbers (integers, decimals, ``a/b``, ``\\frac{a}{b}``, ``50%``), then symbolically with sympy on
short, whitelisted expressions. Runaway sympy calls are bounded by the caller's per-sample time
limit (see ``roll.pipeline.rewards.scoring``).
"""

from __future__ import annotations

import re
from fractions import Fraction

# Imported here, not on first use, so the first sympy comparison in a scoring worker does not spend
# its time limit on the import.
import sympy
from sympy.parsing.sympy_parser import (
    implicit_multiplication_application,
    parse_expr,
    standard_transformations,
)

_ANSWER_PHRASE = re.compile(r"(?:final answer|answer)\s*(?:is\s*:?|:)\s*(.+)", re.IGNORECASE)
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:/\d+)?")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
_TEXT_MACRO = re.compile(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}")
_NUMBER_WITH_UNIT = re.compile(r"^(-?[\d.,/]+)\s*[A-Za-z][A-Za-z ]*$")
_FRAC = re.compile(r"^(-?)\\frac\{(-?\d+)\}\{(-?\d+)\}$")
_LATEX_DROPS = ("\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "^\\circ", "^{\\circ}", "\\$")
_SYMPY_NAMES = {"sqrt", "pi", "log", "ln", "exp", "sin", "cos", "tan"}
_MAX_SYMPY_CHARS = 64


def math_rule_reward(
    response: str,
    ground_truth: str,
    *,
    last_number_fallback: bool = False,
    percent_as_fraction: bool = False,
    rel_tol: float = 1e-9,
    use_sympy: bool = True,
) -> float:
    """1.0 when the final answer of ``response`` equals ``ground_truth``, else 0.0.

    ``last_number_fallback``: with no boxed answer and no "answer is", use the last number.
    ``percent_as_fraction``: also accept ``50%`` for a ground truth of ``0.5`` (``50%`` always
    equals ``50``). ``rel_tol``: relative tolerance of the numeric comparison.
    """
    answer = extract_answer(response, last_number_fallback)
    if answer is None:
        return 0.0
    return 1.0 if answers_match(answer, str(ground_truth), percent_as_fraction, rel_tol, use_sympy) else 0.0


def extract_answer(response: str, last_number_fallback: bool = False) -> str | None:
    """The response's final answer text (not normalised), or None when it states none."""
    boxed = last_boxed(response)
    if boxed is not None:
        return boxed
    phrases = _ANSWER_PHRASE.findall(response)
    if phrases:
        return phrases[-1].strip()
    if last_number_fallback:
        numbers = _NUMBER.findall(_THOUSANDS.sub("", response))
        return numbers[-1] if numbers else None
    return None


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), matching nested braces."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth = 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None  # unbalanced: the answer was cut off


def normalize(answer: str) -> str:
    """Canonical text of an answer: no ``$``, ``\\text{}``, thousands commas, spaces or trailing period."""
    s = answer.strip()
    s = s.strip("$").removeprefix("\\(").removesuffix("\\)").removeprefix("\\[").removesuffix("\\]")
    s = _TEXT_MACRO.sub(r"\1", s)
    for drop in _LATEX_DROPS:
        s = s.replace(drop, "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").replace("\\%", "%")
    s = _THOUSANDS.sub("", s).strip().rstrip(".").strip()
    unit = _NUMBER_WITH_UNIT.match(s)
    if unit:  # "85 marbles" -> "85"
        s = unit.group(1)
    if re.match(r"^[A-Za-z]\s*=", s):  # "x = 5" -> "5"
        s = s.split("=", 1)[1]
    return re.sub(r"\s+", "", s).rstrip(".")


def to_number(s: str) -> Fraction | None:
    """Exact value of a normalised integer, decimal, fraction (``3/4``, ``\\frac{3}{4}``) or percentage."""
    frac = _FRAC.match(s)
    if frac:
        sign, num, den = frac.groups()
        s = f"{sign}{num}/{den}"
    if s.endswith("%"):
        s = s[:-1]
    if not re.fullmatch(r"[-+]?(\d+(\.\d*)?|\.\d+)(/[-+]?\d+)?", s):
        return None
    try:
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def answers_match(
    answer: str,
    ground_truth: str,
    percent_as_fraction: bool = False,
    rel_tol: float = 1e-9,
    use_sympy: bool = True,
) -> bool:
    a, b = normalize(answer), normalize(ground_truth)
    if not a:
        return False
    if a == b:
        return True
    x, y = to_number(a), to_number(b)
    if x is not None and y is not None:
        candidates = [x, x / 100] if percent_as_fraction and a.endswith("%") else [x]
        return any(abs(c - y) <= rel_tol * max(1, abs(y)) for c in candidates)
    return use_sympy and sympy_equal(a, b)


def _to_sympy_text(s: str) -> str | None:
    """Rewrite a small LaTeX/plain expression into sympy syntax; None when it is not whitelisted."""
    for _ in range(4):  # innermost first, so \frac{1}{\sqrt{2}} and \sqrt{\frac{1}{2}} both work
        s = re.sub(r"\\frac\{([^{}]*)\}\{([^{}]*)\}", r"((\1)/(\2))", s)
        s = re.sub(r"\\sqrt\{([^{}]*)\}", r"sqrt(\1)", s)
    s = s.replace("\\cdot", "*").replace("\\times", "*").replace("\\pi", "pi").replace("\\ln", "ln")
    s = s.replace("\\log", "log").replace("^", "**").replace("{", "(").replace("}", ")")
    if len(s) > _MAX_SYMPY_CHARS or not re.fullmatch(r"[0-9A-Za-z+\-*/().]*", s):
        return None
    if s.count("**") > 1 or re.search(r"\.(?!\d)", s):  # no towers of powers, no attribute access
        return None
    words = set(re.findall(r"[A-Za-z]+", s))
    if any(len(w) > 1 and w not in _SYMPY_NAMES for w in words):
        return None
    return s


def sympy_equal(a: str, b: str) -> bool:
    """Whether two whitelisted expressions are symbolically equal (False when either does not parse)."""
    sa, sb = _to_sympy_text(a), _to_sympy_text(b)
    if sa is None or sb is None:
        return False
    try:
        names = {c: sympy.Symbol(c) for c in "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"}
        names.update({"pi": sympy.pi, "e": sympy.E, "sqrt": sympy.sqrt, "log": sympy.log, "ln": sympy.log})
        names.update({"exp": sympy.exp, "sin": sympy.sin, "cos": sympy.cos, "tan": sympy.tan})
        transforms = (*standard_transformations, implicit_multiplication_application)
        ea = parse_expr(sa, local_dict=names, transformations=transforms)
        eb = parse_expr(sb, local_dict=names, transformations=transforms)
        return bool(sympy.simplify(ea - eb) == 0)
    except Exception:  # sympy raises many types on odd input; an unparsable answer is just wrong
        return False
