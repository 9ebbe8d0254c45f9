"""Rule-based reward verifiers for math answers.

A verifier is a callable ``(response: str, ground_truth: str) -> float`` that
returns exactly ``1.0`` (correct) or ``0.0`` (wrong or no answer).  Verifiers
live in a name registry so that configs can refer to them by name::

    from megatron_cegrpo.rewards import get_verifier
    reward = get_verifier("numeric")("... so the answer is \\boxed{43}.", "43.0")

Division of labour:

* Symbolic / LaTeX equivalence is delegated to HuggingFace's ``math-verify``
  (``math_verify.parse`` / ``math_verify.verify``), the maintained library for
  this job; the numeric verifier also uses it to evaluate a boxed LaTeX
  number (``\\frac{1}{2^{80}}``, ``\\sqrt{2}``, ``12 \\text{ cm}^2``).
* This module adds what math-verify does not do: answer *extraction* (the
  GSM8K ``#### N`` marker, "The answer is N" phrases, the last bare number of
  a response, a cut-off last ``\\boxed{`` meaning "no answer"); reading plain
  numbers exactly (thousands separators, e-notation, which math-verify takes
  for Euler's e, ``2^{10}``, unit exponents, percent); and the comparison of
  two numbers (:func:`_close`: exact whole numbers, otherwise a relative
  tolerance, where math-verify rounds to 6 decimals and calls 1e-8 == 2e-8).

Error policy: a malformed *ground truth* is a data bug and raises
``ValueError`` naming the value; a *response* without an extractable answer is
a normal model failure and scores ``0.0``.  So does a box that math-verify
would read only in part (its LaTeX parser cannot read the box whole and a
fallback takes a number from it, ``3\\sqrt(5)`` read as 3), unless its whole
text is the answer's: a WARNING on this module's logger names the box
(:func:`_parse_box`).  A policy learns to write such boxes when they score.
Stray ``$`` inside a box are ignored.
"""

from __future__ import annotations

import json
import logging
import math
import re
import threading
from fractions import Fraction
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

import sympy

from math_verify import LatexExtractionConfig
from math_verify import parse as _mv_parse
from math_verify import verify as _mv_verify

__all__ = [
    "Verifier",
    "register_verifier",
    "get_verifier",
    "available_verifiers",
    "extract_boxed",
    "last_boxed",
    "extract_numeric_answer",
    "parse_number",
    "numeric_verifier",
    "gsm8k_verifier",
    "boxed_verifier",
    "olympiad_list_verifier",
    "REL_TOL",
]

Verifier = Callable[[str, str], float]

_log = logging.getLogger(__name__)

_VERIFIERS: Dict[str, Verifier] = {}

#: Relative tolerance for numeric comparison (43 == 43.0 == 43.00).
REL_TOL = 1e-4
#: Absolute tolerance used only when the ground truth is (close to) zero.
ABS_TOL = 1e-9


# --------------------------------------------------------------------------
# Registry
# --------------------------------------------------------------------------
def register_verifier(name: str) -> Callable[[Verifier], Verifier]:
    """Decorator registering ``fn`` as verifier ``name`` (duplicate names raise)."""

    if not isinstance(name, str) or not name:
        raise ValueError(f"verifier name must be a non-empty string, got {name!r}")

    def deco(fn: Verifier) -> Verifier:
        if name in _VERIFIERS and _VERIFIERS[name] is not fn:
            raise ValueError(f"verifier {name!r} is already registered")
        _VERIFIERS[name] = fn
        return fn

    return deco


def get_verifier(name: str) -> Verifier:
    """Return the verifier registered as ``name``; ValueError lists valid names."""
    try:
        return _VERIFIERS[name]
    except KeyError:
        raise ValueError(
            f"unknown verifier {name!r}; valid names: {', '.join(available_verifiers())}"
        ) from None


def available_verifiers() -> List[str]:
    """Sorted names of all registered verifiers."""
    return sorted(_VERIFIERS)


# --------------------------------------------------------------------------
# Extraction helpers (the part math-verify does not do)
# --------------------------------------------------------------------------
_BOXED_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")


def _scan_boxes(text: str) -> Tuple[List[str], bool]:
    """(contents of every complete box in order, whether the *last* box opener
    is unterminated).  Braces are matched with a depth counter; escaped
    braces (``\\{``, ``\\}``) do not count."""
    out: List[str] = []
    cut = False
    for m in _BOXED_RE.finditer(text):
        depth, i = 1, m.end()
        while i < len(text) and depth:
            c = text[i]
            if c == "\\" and i + 1 < len(text):  # skip escaped chars such as \{ \}
                i += 2
                continue
            if c == "{":
                depth += 1
            elif c == "}":
                depth -= 1
            i += 1
        cut = depth != 0
        if not cut:
            out.append(text[m.end() : i - 1].strip())
    return out, cut


def extract_boxed(text: str) -> List[str]:
    """Contents of every complete ``\\boxed{...}`` / ``\\fbox{...}`` in ``text``, in order.

    Braces are matched with a depth counter, so nested groups such as
    ``\\boxed{\\frac{1}{2}}`` come out whole.  An unterminated box is not
    listed (same rule as the Minerva / Hendrycks MATH
    ``last_boxed_only_string`` helper); the verifiers treat a response whose
    *last* box is unterminated as having no answer (see
    :func:`extract_numeric_answer`).
    """
    return _scan_boxes(text)[0]


def last_boxed(text: str) -> Optional[str]:
    """Content of the last complete, non-empty ``\\boxed{...}`` in ``text`` or
    ``None``.  Empty boxes are skipped: small models echo the instruction
    "put your final answer within \\boxed{}" verbatim.  This helper does not
    look at an unterminated box after it; the verifiers do."""
    boxes = [b for b in extract_boxed(text) if b]
    return boxes[-1] if boxes else None


def _final_box_cut_off(text: str) -> bool:
    """True if the response's last ``\\boxed{`` is never closed: the final
    answer was cut off (``max_new_tokens``) or is malformed.  Earlier boxes
    were then superseded ("\\boxed{5}. Wait, recheck: \\boxed{7"), so the
    response has no answer."""
    return _scan_boxes(text)[1]


# A number: optional sign, digits with optional thousands separators ("1,000"
# but not "3,4"), optional decimals, optional exponent ("1.5e-3"), optional
# "/denominator"; or ".5".
_EXP = r"(?:[eE][-+]?\d+)?"
_NUM = (
    r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?" + _EXP + r"(?:\s*/\s*\d+(?:\.\d+)?)?"
    r"|-?\.\d+" + _EXP
)
# a number and whether a percent sign follows it
_NUM_RE = re.compile(r"(?<![\w.])(?P<num>" + _NUM + r")(?P<pct>\s*%)?")
_NUM_FULL_RE = re.compile(r"\s*(?P<num>" + _NUM + r")(?P<pct>\s*%)?\s*")
# Final-answer anchors: GSM8K's "#### N" and the CoT phrases
# "The (final) answer is N" / "Answer: N".
_ANCHOR_RE = re.compile(r"####|answer\s+is\b|answer\s*:", re.IGNORECASE)
_LATEX_FRAC_RE = re.compile(r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}")
_TEXT_RE = re.compile(r"\\(?:text|textrm|textit|textbf|mathrm|mathbf|mathit|operatorname)\s*\{([^{}]*)\}")
_DEGREE_RE = re.compile(r"\^\s*\{?\s*\\circ\s*\}?|\\circ|\\degree|°")
# an integer exponent: ^3, ^-2, ^{10}, ^{-3}
_POW = r"\s*\^\s*(?:\{\s*(?P<e1>[-+]?\d+)\s*\}|(?P<e2>[-+]?\d+))"
# "1.5 \times 10^{-3}", "3 x 10^8", "2\cdot10^5"
_SCI_RE = re.compile(r"(?<![\w.])(?P<m>-?\d+(?:\.\d+)?)\s*(?:\\times|\\cdot|×|\*|x)\s*10" + _POW)
# "2^{10}", "3^2" (a number to an integer power)
_NUM_POW_RE = re.compile(r"(?<![\w.])(?P<m>\d+(?:\.\d+)?)" + _POW)
# a unit's exponent ("cm^2", "m^{3}", "s^{-2}"): not a number
_UNIT_POW_RE = re.compile(r"(?P<u>[A-Za-z])" + _POW)
#: exponents beyond this are left unevaluated (no 10^(10^9) integers)
_MAX_EXP = 1000

Num = Union[Fraction, float]


class _Value(NamedTuple):
    """A parsed answer: the number as written, and whether a % sign followed."""

    value: Num
    percent: bool


def _exact_text(v: Fraction) -> str:
    return str(v.numerator) if v.denominator == 1 else f"{v.numerator}/{v.denominator}"


def _eval_power(m: re.Match, scale: Optional[int]) -> str:
    """Replacement text for a matched power: exact ``p`` or ``p/q``; the match
    itself if the exponent is too large to evaluate."""
    e = int(m.group("e1") or m.group("e2"))
    if abs(e) > _MAX_EXP:
        return m.group(0)
    base = Fraction(m.group("m"))
    try:
        val = base * Fraction(10) ** e if scale == 10 else base**e
    except ZeroDivisionError:
        return m.group(0)
    return _exact_text(val)


def _clean_number_text(s: str) -> str:
    """Strip the decoration around a final answer and evaluate the powers a
    number can carry, so that only the answer's own numbers are left.

    Removes $, \\$, LaTeX spacing, \\text{...} / \\mathrm{...} wrappers
    (their content stays), bold markers, degree signs, trailing '.';
    normalises \\% to % and the Unicode minus sign to '-'; removes unit
    exponents ("cm^2", "m^{-1}": the 2 is not a number); rewrites
    "1.5 \\times 10^{-3}" and "2^{10}" to their exact values ("3/2000",
    "1024") and "\\frac{a}{b}" to "a/b".
    """
    s = s.strip()
    s = _TEXT_RE.sub(r" \1 ", s)
    s = s.replace("\\$", "").replace("$", "").replace("\\%", "%")
    s = s.replace("\\!", "").replace("\\,", "").replace("\\ ", " ").replace("{,}", ",")
    s = s.replace("**", "").replace("\u2212", "-")  # U+2212 MINUS SIGN
    s = _DEGREE_RE.sub("", s)
    s = _SCI_RE.sub(lambda m: _eval_power(m, 10), s)
    s = _NUM_POW_RE.sub(lambda m: _eval_power(m, None), s)
    s = _UNIT_POW_RE.sub(r"\g<u>", s)
    s = _LATEX_FRAC_RE.sub(r"\1/\2", s)
    s = s.replace("\\left", "").replace("\\right", "")
    return s.strip().rstrip(".").strip()


def _to_float(v: Num) -> float:
    try:
        return float(v)
    except OverflowError:  # a Fraction beyond the float range
        return math.inf if v > 0 else -math.inf


def _dec(tok: str) -> Fraction:
    m = re.search(r"[eE]([-+]?\d+)$", tok)
    if m and abs(int(m.group(1))) > _MAX_EXP:
        raise ValueError(tok)
    return Fraction(tok)


def _tok_value(tok: str) -> Optional[Fraction]:
    """Exact value of a number token matched by ``_NUM``."""
    tok = tok.replace(",", "").replace(" ", "")
    try:
        if "/" in tok:
            num, den = tok.split("/", 1)
            return _dec(num) / _dec(den)
        return _dec(tok)
    except (ValueError, ZeroDivisionError):
        return None


def _parse_exact(text: str) -> Optional[_Value]:
    """The value of a string that *is* one number (after cleaning), else None."""
    m = _NUM_FULL_RE.fullmatch(_clean_number_text(str(text)))
    if not m:
        return None
    v = _tok_value(m.group("num"))
    return None if v is None else _Value(v, bool(m.group("pct")))


def parse_number(text: str) -> Optional[float]:
    """Parse a string that *is* a number ("1,000", "$43.00", "-3/4",
    "\\frac{3}{4}", "72.", "45%" (-> 45), "1.5e-3", "1.5 \\times 10^{-3}",
    "2^{10}") to a float (``inf`` beyond the float range); ``None`` if it is
    anything else, such as a number with a unit ("12 \\text{ cm}^2")."""
    v = _parse_exact(text)
    return None if v is None else _to_float(v.value)


def _number_tokens(text: str) -> List[_Value]:
    out = []
    for m in _NUM_RE.finditer(_clean_number_text(text)):
        v = _tok_value(m.group("num"))
        if v is not None:
            out.append(_Value(v, bool(m.group("pct"))))
    return out


# Line-initial list markers ("7. Therefore", "Step 3:", "2)") are not answers.
_ENUM_RE = re.compile(r"^(\s*(?:[-*]\s*)?(?:step\s*)?)\d+\s*[.):](?=\s|$)", re.IGNORECASE | re.MULTILINE)


def _strip_enumerators(text: str) -> str:
    return _ENUM_RE.sub(r"\1", text)


def _number_after_anchor(segment: str) -> Optional[_Value]:
    """Number stated right after an answer anchor.

    Uses the rest of the anchor's sentence (up to a line break or a '.'
    that ends a sentence, not a decimal point); if it is an equation
    ("The answer is 7 + 7 = 14.") the first number after the last '=' is
    used, otherwise the first number.
    """
    line = segment.strip().split("\n", 1)[0] if segment.strip() else ""
    line = re.split(r"\.(?=\s|$)", line, maxsplit=1)[0]
    if "=" in line:
        nums = _number_tokens(line.rsplit("=", 1)[1])
        if nums:
            return nums[0]
    nums = _number_tokens(line)
    return nums[0] if nums else None


_WORD_RE = re.compile(r"[A-Za-z]{2,}[.,;:!?]*")


def _box_value(box: str) -> Optional[_Value]:
    """The number a box holds, or None.

    In order: a plain number (:func:`parse_number` rules); the value after the
    last '=' ("x = 14"); math-verify's reading of a LaTeX expression that is
    one finite real number ("\\frac{1}{2^{80}}", "\\sqrt{2}", "-2^{3}",
    "14 \\text{ apples}"), read whole (:func:`_parse_box`); a single number
    among plain words ("\\text{14 apples}").  "2x", "3 \\text{ and } 4" or
    "\\{1, 2\\}" hold no single number.  Stray ``$`` change nothing: every rule
    reads the box without them.  A box that math-verify cannot read whole and
    no other rule reads ("3\\sqrt(5)", whose part "3" math-verify's fallback
    took) holds no number, and a WARNING names it.
    """
    v = _parse_exact(box)
    if v is not None:
        return v
    if "=" in box:
        return _box_value(box.rsplit("=", 1)[1])
    parsed, why = _parse_box(box)
    v = _mv_number(parsed)
    if v is not None:
        return v
    tokens = _clean_number_text(box).split()
    nums = [t for t in tokens if _NUM_FULL_RE.fullmatch(t)]
    if len(nums) == 1 and all(t in nums or _WORD_RE.fullmatch(t) for t in tokens):
        return _parse_exact(nums[0])
    if why:
        _log.warning("%s: no number; the response scores 0", why)
    return None


def _extract_answer(response: str) -> Optional[_Value]:
    if not response or _final_box_cut_off(response):
        return None
    box = last_boxed(response)
    if box is not None:
        return _box_value(box)
    anchors = list(_ANCHOR_RE.finditer(response))
    if anchors:
        val = _number_after_anchor(response[anchors[-1].end() :])
        if val is not None:
            return val
    nums = _number_tokens(_strip_enumerators(response))
    return nums[-1] if nums else None


def extract_numeric_answer(response: str) -> Optional[float]:
    """The model's final numeric answer, or ``None``.

    Rule order (Qwen2.5-Math evaluation / GSM8K conventions):

    0. if the last ``\\boxed{`` is unterminated (the final answer was cut
       off by ``max_new_tokens``), there is no answer: an earlier box or a
       stated number was superseded by the unfinished one;
    1. the content of the last ``\\boxed{...}`` (a boxed answer is binding:
       if it holds no number, there is no answer), read as in
       :func:`_box_value` (plain number, value after '=', math-verify for
       LaTeX such as ``\\frac{1}{2^{80}}``, a lone number among words; a box
       math-verify would read only in part holds none);
    2. else the number after the last anchor "####" (GSM8K), "answer is" or
       "Answer:" (CoT phrasing);
    3. else the last number anywhere in the response, not counting
       line-initial list markers ("7. Therefore," in a cut-off response).

    An empty box is skipped; an anchor followed by no number ("The answer is
    N.", a parroted instruction) falls through to rule 3.

    Commas, ``$``, ``%`` and trailing periods are stripped; unit exponents
    ("cm^2") are not numbers; ``a/b``, ``\\frac{a}{b}``, ``1.5e-3``,
    ``1.5 \\times 10^{-3}`` and ``2^{10}`` become their values.
    """
    v = _extract_answer(response)
    return None if v is None else _to_float(v.value)


def _numeric_ground_truth(ground_truth) -> _Value:
    gt = str(ground_truth).strip()
    if "####" in gt:  # tolerate a raw GSM8K answer field
        gt = gt.rsplit("####", 1)[1].strip()
    val = _parse_exact(gt)
    if val is None and gt:
        val = _mv_number(_parse_answer(gt))
    if val is None or not math.isfinite(_to_float(val.value)):
        raise ValueError(
            f"numeric ground truth {ground_truth!r} is not a number "
            "(expected e.g. '43', '43.0', '1,000', '3/4', '1.5e-3' or '\\frac{1}{2^{10}}')"
        )
    return val


def _close(pred: Num, gt: Num) -> bool:
    """A whole ground truth needs an equal answer when both are exact;
    otherwise relative tolerance ``REL_TOL`` (absolute ``ABS_TOL`` only when
    the ground truth is 0).

    The integer rule keeps counts honest: with 1e-4 alone a GSM8K response
    of 70001 would pass for the ground truth 70000 (test row 3), and 27.00001
    for an AIME answer 27.  It applies to exact values (parsed text, sympy
    rationals) of any size, so 2^80 + 1 != 2^80.  The relative rule keeps
    tiny values apart (2^-80 != 2^-81), where an absolute tolerance would
    call every value below it equal, and lets 0.33333 pass for 1/3.
    """
    if isinstance(pred, Fraction) and isinstance(gt, Fraction) and gt.denominator == 1:
        return pred == gt
    p, g = _to_float(pred), _to_float(gt)
    if not (math.isfinite(p) and math.isfinite(g)):
        return False
    if g == 0.0:
        return abs(p) <= ABS_TOL
    return math.isclose(p, g, rel_tol=REL_TOL)


def _readings(v: _Value) -> List[Num]:
    """'45%' may mean 45 (the question asked for a percentage) or 0.45."""
    return [v.value, v.value / 100] if v.percent else [v.value]


def _values_match(pred: _Value, gt: _Value) -> bool:
    return any(_close(p, g) for p in _readings(pred) for g in _readings(gt))


# --------------------------------------------------------------------------
# math-verify wrappers
# --------------------------------------------------------------------------
def _timeout() -> Optional[int]:
    # math-verify's timeout uses signal.alarm, which only works in the main
    # thread; elsewhere run without it (its docs recommend exactly this).
    return 5 if threading.current_thread() is threading.main_thread() else None


def _mv_parse_safe(text: str, extraction_config=None) -> list:
    """``math_verify.parse`` (its default extraction, or ``extraction_config``); [] if it raises."""
    kwargs = {} if extraction_config is None else {"extraction_config": extraction_config}
    try:
        return _mv_parse(text, parsing_timeout=_timeout(), **kwargs)
    except Exception:  # math-verify raises on pathological LaTeX / timeouts
        return []


def _mv_equal(gold: list, pred: list) -> bool:
    if not gold or not pred:
        return False
    try:
        return bool(_mv_verify(gold, pred, timeout_seconds=_timeout()))
    except Exception:
        return False


def _mv_number(parsed: list) -> Optional[_Value]:
    """The finite real number a math-verify parse result is, or None (a
    symbol, a set, an equation, a complex or infinite value).  Rationals
    stay exact; other values (sqrt(2), pi, 2^-80 as a power) become floats."""
    if not parsed or not isinstance(parsed[0], sympy.Basic):
        return None
    expr = parsed[0]
    text = next((p for p in reversed(parsed) if isinstance(p, str)), "")
    percent = "%" in text
    try:
        if not expr.is_number:
            return None
        if expr.has(sympy.UnevaluatedExpr):  # latex2sympy writes "45%" as 45 * (1/100)
            expr = expr.doit()
            if percent:
                expr = expr * 100
        if expr.is_Rational:
            return _Value(Fraction(int(expr.p), int(expr.q)), percent)
        if expr.is_Float:
            val: Num = Fraction(str(expr))
        else:
            f = expr.evalf(30)
            if not (f.is_real and f.is_finite):
                return None
            val = float(f)
    except Exception:  # sympy can raise on odd expressions
        return None
    return _Value(val, percent) if math.isfinite(_to_float(val)) else None


def _answers_equal(gold: list, pred: list) -> bool:
    """Two parsed answers are equal.  Two numbers compare by :func:`_close`
    (exact whole numbers, else ``REL_TOL`` relative), as in the numeric
    verifier: math-verify rounds floats to 6 decimals and chops tiny
    differences, so for it 1e-8 == 2e-8 and 2^-80 == 2^-81, while
    3.0000001e-9 != 3e-9.  Anything else (expressions, sets, equations,
    intervals) is ``math_verify.verify``."""
    g, p = _mv_number(gold), _mv_number(pred)
    if g is not None and p is not None:
        return _values_match(p, g)
    return _mv_equal(gold, pred)


# "4.5e33" is Euler's e to math-verify (4.5 * e * 33): write it as a power of 10
_E_NOTATION_RE = re.compile(r"(?<![\w.\\])(\d+(?:\.\d+)?|\.\d+)[eE]([-+]?\d+)(?![\w.])")
# "1\,000" is a thousands separator, not 1 times 000
_THIN_THOUSANDS_RE = re.compile(r"(?<=\d)\\,(?=\d{3}(?!\d))")


def _normalise_numbers(text: str) -> str:
    """Write numbers so that math-verify reads them as numbers: e-notation
    becomes ``\\times 10^{k}`` and ``1\\,000`` becomes ``1000``."""
    text = _E_NOTATION_RE.sub(r"\1\\times 10^{\2}", text)
    return _THIN_THOUSANDS_RE.sub("", text)


def _mv_parse_response(response: str) -> list:
    """math-verify's own extraction of an answer from a whole response."""
    return _mv_parse_safe(_normalise_numbers(response))


def _latex_for_parse(expr: str) -> str:
    """Prepare a bare answer for math-verify's LaTeX extractor: numbers as in
    :func:`_normalise_numbers`, and the answer wrapped in ``$...$`` (answers
    that already contain ``$``/``\\(`` keep their delimiters)."""
    expr = _normalise_numbers(expr.strip())
    if "$" in expr or "\\(" in expr or "\\[" in expr:
        return expr
    return f"${expr}$"


def _parse_answer(expr: str) -> list:
    """math-verify parse of one data set answer (a response's box is read by
    :func:`_parse_box`).  If it holds stray ``$`` signs that break the parse
    (Minerva line 73 boxes ``...+$ $\\dot{x}_0...``), retry with them removed."""
    parsed = _mv_parse_safe(_latex_for_parse(expr))
    if not parsed and "$" in expr:
        parsed = _mv_parse_safe(_latex_for_parse(expr.replace("$", " ")))
    return parsed


# a '$' that is not the dollar sign '\$': inside a box, already math, it only splits the box in pieces
_STRAY_DOLLAR_RE = re.compile(r"(?<!\\)\$")
_LATEX_ONLY = [LatexExtractionConfig()]


def _parse_box(box: str) -> Tuple[list, str]:
    """math-verify's reading of a box's whole content: ``(parsed, "")``, or
    ``(text, why)`` when math-verify would read only a part of it.

    The box is read as one ``$...$`` span with its stray ``$`` removed (not
    ``\\$``): kept, they made math-verify pick one piece, the last number of
    ``12 $ and $13`` (13).  A value counts only from math-verify's LaTeX parse
    of the whole span.  When that parse fails, math-verify's plain-expression
    fallback finds a number in the text and returns it: a part of the box
    (``3\\sqrt(5)``: its normalisation writes ``3\\\\sqrt{5}``, the LaTeX parse
    fails and the fallback gives 3, which scored 1 against the answer 3;
    ``3 ) 5``: 5): such a box has no value, only its whole text, which
    ``math_verify.verify`` compares as a string (as it does for a box that
    math-verify reads no value from at all, ``np.arcsin(10/13)``, a Minerva
    answer), and ``why`` names it.

    Args:
        box: a box's content (:func:`extract_boxed`).
    Returns:
        (parsed, why): math-verify's parse list (a sympy value first, or only
        the box's normalised text) and "" or, for a box math-verify would read
        in part, the box's normalised text ([] or one string) and one line
        naming the box and the part.
    """
    text = _STRAY_DOLLAR_RE.sub(" ", box).strip()
    if not text:
        return [], ""
    span = f"${_normalise_numbers(text)}$"
    parsed = _mv_parse_safe(span, _LATEX_ONLY)
    if parsed and not isinstance(parsed[0], str):
        return parsed, ""
    partial = _mv_parse_safe(span)  # math-verify's default: LaTeX, then plain expressions
    if partial and not isinstance(partial[0], str):
        return parsed, (f"math-verify reads only {_one_line(partial[0], 40)!r} of the box {_one_line(box, 80)!r} "
                        "(its LaTeX parser cannot read the box whole)")
    return parsed, ""


def _one_line(text: str, limit: int) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _parse_gold(ground_truth: str) -> list:
    gold = _parse_answer(str(ground_truth))
    if not gold:
        raise ValueError(
            f"ground truth {ground_truth!r} cannot be parsed by math-verify "
            "(expected a LaTeX or plain math answer such as '27' or '\\frac{1}{2}')"
        )
    return gold


def _response_candidates(response: str) -> List[list]:
    """Parsed answers of a response, most specific first: the last boxed
    expression (:func:`_parse_box`), then (for several boxes) all boxes
    together, then math-verify's own extraction of the whole response if
    nothing is boxed.  None if the last box is unterminated (see
    :func:`_final_box_cut_off`).  A last box that math-verify would read only
    in part is its text alone (logged), and then the only candidate."""
    boxes, cut = _scan_boxes(response)
    if cut:
        return []
    boxes = [b for b in boxes if b]
    cands: List[list] = []
    if boxes:
        last, why = _parse_box(boxes[-1])
        cands.append(last)
        if why:
            _log.warning("%s: it is compared as text only (it scores 0 unless it is the answer's text)", why)
        elif len(boxes) > 1:
            # "\boxed{69}, \boxed{84}" for a two-value answer
            cands.append(_mv_parse_response(response))
    else:
        cands.append(_mv_parse_response(response))
    return [c for c in cands if c]


# --------------------------------------------------------------------------
# Verifiers
# --------------------------------------------------------------------------
@register_verifier("numeric")
def numeric_verifier(response: str, ground_truth: str) -> float:
    """MAWPS-style numeric answer (ground truth like ``"43.0"``).

    Extraction: :func:`extract_numeric_answer` (last ``\\boxed{}``, else the
    "####" / "answer is" / "Answer:" anchor, else the last number), as in the
    Qwen2.5-Math evaluation harness; a response whose last box is cut off
    has no answer.  Comparison (:func:`_close`): relative tolerance
    ``REL_TOL`` = 1e-4, so 43 == 43.0 == "43.00" and 0.33333 == 1/3, and
    2^-80 != 2^-81; when both numbers are exactly whole they must be equal
    (70001 != 70000).  A percentage matches either reading: "45%" is right
    for 45 and for 0.45.  The ground truth may be any number
    :func:`parse_number` reads, or a LaTeX number math-verify evaluates.
    """
    gt = _numeric_ground_truth(ground_truth)
    pred = _extract_answer(response or "")
    if pred is None:
        return 0.0
    return 1.0 if _values_match(pred, gt) else 0.0


@register_verifier("gsm8k")
def gsm8k_verifier(response: str, ground_truth: str) -> float:
    """GSM8K (Cobbe et al. 2021): the reference answer is the number after
    ``#### `` in the dataset's answer field.  The loader passes that number;
    a full answer field containing ``####`` is accepted too.  Response
    extraction and comparison are those of :func:`numeric_verifier`."""
    return numeric_verifier(response, ground_truth)


@register_verifier("boxed")
def boxed_verifier(response: str, ground_truth: str) -> float:
    """LaTeX answers (Minerva OCW, AMC23, AIME24), compared by math-verify.

    The ground truth is a LaTeX answer (Minerva: the last ``\\boxed{}`` of the
    reference solution, extracted by the loader).  The response's last
    ``\\boxed{}`` expression is parsed with ``math_verify.parse``, whole, its
    stray ``$`` ignored (a box read only in part is compared as its text,
    :func:`_parse_box`); if nothing is boxed, math-verify's own extraction of
    the whole response is used; a response whose last box is cut off has no
    answer.  Numbers in e-notation
    ("4.5e33", Minerva's form) and with ``\\,`` thousands separators are
    rewritten first so that math-verify reads them as numbers.  Equivalence
    is ``math_verify.verify(gold, pred)``; when both sides are numbers they
    must also agree to ``REL_TOL`` relative (:func:`_answers_equal`).
    """
    gold = _parse_gold(ground_truth)
    for cand in _response_candidates(response or ""):
        if _answers_equal(gold, cand):
            return 1.0
    return 0.0


def _strip_math_delims(s: str) -> str:
    s = s.strip()
    if s.startswith("$") and s.endswith("$") and s.count("$") == 2:
        return s[1:-1].strip()
    return s


@register_verifier("olympiad_list")
def olympiad_list_verifier(response: str, ground_truth: str) -> float:
    """OlympiadBench (He et al. 2024): ground truth is a JSON list of answers
    (the ``final_answer`` field, e.g. ``["$69$,$84$"]``).

    Correct if the response's boxed answer(s) match *all* elements, order-
    insensitive: either the last ``k = len(list)`` boxes match the elements one
    to one in any order, or one answer (the last box, or all boxes together)
    equals the whole list as a set.  Comparison by math-verify, which also
    treats comma-separated answers inside one element as an unordered set.
    """
    try:
        answers = json.loads(ground_truth) if isinstance(ground_truth, str) else ground_truth
    except json.JSONDecodeError:
        raise ValueError(
            f"olympiad_list ground truth {ground_truth!r} is not a JSON list of answers"
        ) from None
    if isinstance(answers, str):
        answers = [answers]
    if not isinstance(answers, list) or not answers or not all(
        isinstance(a, (str, int, float)) and str(a).strip() for a in answers
    ):
        raise ValueError(
            f"olympiad_list ground truth {ground_truth!r} must be a non-empty JSON list "
            "of non-empty answers"
        )
    golds = [_parse_gold(str(a)) for a in answers]
    response = response or ""

    if len(golds) == 1:
        for cand in _response_candidates(response):
            if _answers_equal(golds[0], cand):
                return 1.0
        return 0.0

    # Several answers: (a) the last k boxes, matched one to one in any order.
    boxes, cut = _scan_boxes(response)
    if cut:  # the last answer was cut off
        return 0.0
    boxes = [b for b in boxes if b]
    if len(boxes) >= len(golds):
        preds = [_parse_box(b)[0] for b in boxes[-len(golds) :]]
        if _perfect_match(golds, preds):
            return 1.0
    # (b) one expression holding all answers, compared as a set.
    joined = _parse_gold(", ".join(_strip_math_delims(str(a)) for a in answers))
    for cand in _response_candidates(response):
        if _answers_equal(joined, cand):
            return 1.0
    return 0.0


def _perfect_match(golds: Sequence[list], preds: Sequence[list]) -> bool:
    """True if every gold has its own equal prediction (bipartite matching by
    augmenting paths; sizes are tiny)."""
    adj = [[j for j, p in enumerate(preds) if _answers_equal(g, p)] for g in golds]
    owner: Dict[int, int] = {}

    def assign(i: int, seen: set) -> bool:
        for j in adj[i]:
            if j in seen:
                continue
            seen.add(j)
            if j not in owner or assign(owner[j], seen):
                owner[j] = i
                return True
        return False

    return all(assign(i, set()) for i in range(len(golds)))
