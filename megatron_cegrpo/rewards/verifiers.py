"""Rule-based reward verifiers for math answers.

A verifier is a callable ``(response: str, ground_truth: str) -> float`` that
returns exactly ``1.0`` (correct) or ``0.0`` (wrong or no answer).  Verifiers
live in a name registry so that configs can refer to them by name::

    from megatron_cegrpo.rewards import get_verifier
    reward = get_verifier("numeric")("... so the answer is \\boxed{43}.", "43.0")

Division of labour:

* Symbolic / LaTeX equivalence is delegated to HuggingFace's ``math-verify``
  (``math_verify.parse`` / ``math_verify.verify``), the maintained library for
  this job.
* This module only adds answer *extraction* that math-verify does not do: the
  GSM8K ``#### N`` marker, "The answer is N" phrases, the last bare number of a
  response, and strict parsing of numeric ground truths.

Error policy: a malformed *ground truth* is a data bug and raises
``ValueError`` naming the value; a *response* without an extractable answer is
a normal model failure and scores ``0.0``.
"""

from __future__ import annotations

import json
import math
import re
import threading
from fractions import Fraction
from typing import Callable, Dict, List, Optional, Sequence

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


def extract_boxed(text: str) -> List[str]:
    """Contents of every ``\\boxed{...}`` / ``\\fbox{...}`` in ``text``, in order.

    Braces are matched with a depth counter, so nested groups such as
    ``\\boxed{\\frac{1}{2}}`` come out whole.  An unterminated box (a response
    cut off by ``max_new_tokens``) is ignored.  Same rule as the Minerva /
    Hendrycks MATH ``last_boxed_only_string`` helper.
    """
    out: List[str] = []
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
        if depth == 0:
            out.append(text[m.end() : i - 1].strip())
    return out


def last_boxed(text: str) -> Optional[str]:
    """Content of the last complete, non-empty ``\\boxed{...}`` in ``text`` or
    ``None``.  Empty boxes are skipped: small models echo the instruction
    "put your final answer within \\boxed{}" verbatim."""
    boxes = [b for b in extract_boxed(text) if b]
    return boxes[-1] if boxes else None


# A number: optional sign, digits with optional thousands separators ("1,000"
# but not "3,4"), optional decimals, optional "/denominator"; or ".5".
_NUM = r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:\s*/\s*\d+(?:\.\d+)?)?|-?\.\d+"
_NUM_RE = re.compile(r"(?<![\w.])(?:" + _NUM + r")")
# Final-answer anchors: GSM8K's "#### N" and the CoT phrases
# "The (final) answer is N" / "Answer: N".
_ANCHOR_RE = re.compile(r"####|answer\s+is\b|answer\s*:", re.IGNORECASE)
_LATEX_FRAC_RE = re.compile(r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}")


def _clean_number_text(s: str) -> str:
    """Strip the decoration around a final answer: $, \\$, %, LaTeX spacing,
    \\text{...} wrappers (their content stays), bold markers, trailing '.'."""
    s = s.strip()
    s = re.sub(r"\\(?:text|mathrm|textbf|mathbf)\s*\{([^{}]*)\}", r" \1 ", s)
    s = s.replace("\\$", "").replace("$", "").replace("\\%", "").replace("%", "")
    s = s.replace("\\!", "").replace("\\,", "").replace("\\ ", " ").replace("{,}", ",")
    s = s.replace("**", "")
    s = _LATEX_FRAC_RE.sub(r"\1/\2", s)
    s = s.replace("\\left", "").replace("\\right", "")
    return s.strip().rstrip(".").strip()


def parse_number(text: str) -> Optional[float]:
    """Parse a string that *is* a number ("1,000", "$43.00", "-3/4",
    "\\frac{3}{4}", "72.") to a float; ``None`` if it is anything else."""
    s = _clean_number_text(str(text))
    m = re.fullmatch(r"\s*(" + _NUM + r")\s*", s)
    if not m:
        return None
    return _num_to_float(m.group(1))


def _num_to_float(tok: str) -> Optional[float]:
    tok = tok.replace(",", "").replace(" ", "")
    try:
        if "/" in tok:
            num, den = tok.split("/", 1)
            if float(den) == 0:
                return None
            return float(Fraction(num) / Fraction(den))
        return float(tok)
    except (ValueError, ZeroDivisionError):
        return None


def _numbers_in(text: str) -> List[str]:
    return _NUM_RE.findall(_clean_number_text(text))


# Line-initial list markers ("7. Therefore", "Step 3:", "2)") are not answers.
_ENUM_RE = re.compile(r"^(\s*(?:[-*]\s*)?(?:step\s*)?)\d+\s*[.):](?=\s|$)", re.IGNORECASE | re.MULTILINE)


def _strip_enumerators(text: str) -> str:
    return _ENUM_RE.sub(r"\1", text)


def _number_after_anchor(segment: str) -> Optional[float]:
    """Number stated right after an answer anchor.

    Uses the rest of the anchor's sentence (up to a line break or a '.'
    that ends a sentence, not a decimal point); if it is an equation
    ("The answer is 7 + 7 = 14.") the first number after the last '=' is
    used, otherwise the first number.
    """
    line = segment.strip().split("\n", 1)[0] if segment.strip() else ""
    line = re.split(r"\.(?=\s|$)", line, maxsplit=1)[0]
    if "=" in line:
        after = line.rsplit("=", 1)[1]
        nums = _numbers_in(after)
        if nums:
            return _num_to_float(nums[0])
    nums = _numbers_in(line)
    return _num_to_float(nums[0]) if nums else None


def extract_numeric_answer(response: str) -> Optional[float]:
    """The model's final numeric answer, or ``None``.

    Rule order (Qwen2.5-Math evaluation / GSM8K conventions):

    1. the content of the last ``\\boxed{...}`` (a boxed answer is binding:
       if it holds no number, there is no answer);
    2. else the number after the last anchor "####" (GSM8K), "answer is" or
       "Answer:" (CoT phrasing);
    3. else the last number anywhere in the response, not counting
       line-initial list markers ("7. Therefore," in a cut-off response).

    An empty box is skipped; an anchor followed by no number ("The answer is
    N.", a parroted instruction) falls through to rule 3.

    Commas, ``$`` and trailing periods are stripped; ``a/b`` and
    ``\\frac{a}{b}`` become floats.
    """
    if not response:
        return None
    box = last_boxed(response)
    if box is not None:
        val = parse_number(box)
        if val is not None:
            return val
        # "\boxed{x = 14}" or "\boxed{14 \text{ apples}}": take the value
        # after '=' or the single number in the box.
        if "=" in box:
            nums = _numbers_in(box.rsplit("=", 1)[1])
        else:
            nums = _numbers_in(box)
        return _num_to_float(nums[0]) if len(nums) == 1 else None

    anchors = list(_ANCHOR_RE.finditer(response))
    if anchors:
        val = _number_after_anchor(response[anchors[-1].end() :])
        if val is not None:
            return val

    nums = _numbers_in(_strip_enumerators(response))
    return _num_to_float(nums[-1]) if nums else None


def _numeric_ground_truth(ground_truth) -> float:
    gt = str(ground_truth).strip()
    if "####" in gt:  # tolerate a raw GSM8K answer field
        gt = gt.rsplit("####", 1)[1].strip()
    val = parse_number(gt)
    if val is None or not math.isfinite(val):
        raise ValueError(
            f"numeric ground truth {ground_truth!r} is not a number "
            "(expected e.g. '43', '43.0', '1,000' or '3/4')"
        )
    return val


def _close(pred: float, gt: float) -> bool:
    """Relative tolerance ``REL_TOL``; two whole numbers must be equal.

    The integer rule keeps large counts honest: with 1e-4 alone a GSM8K
    response of 70001 would pass for the ground truth 70000 (test row 3).
    """
    if pred.is_integer() and gt.is_integer():
        return pred == gt
    return math.isclose(pred, gt, rel_tol=REL_TOL, abs_tol=ABS_TOL)


# --------------------------------------------------------------------------
# math-verify wrappers
# --------------------------------------------------------------------------
def _timeout() -> Optional[int]:
    # math-verify's timeout uses signal.alarm, which only works in the main
    # thread; elsewhere run without it (its docs recommend exactly this).
    return 5 if threading.current_thread() is threading.main_thread() else None


def _mv_parse_safe(text: str) -> list:
    try:
        return _mv_parse(text, parsing_timeout=_timeout())
    except Exception:  # math-verify raises on pathological LaTeX / timeouts
        return []


def _mv_equal(gold: list, pred: list) -> bool:
    if not gold or not pred:
        return False
    try:
        return bool(_mv_verify(gold, pred, timeout_seconds=_timeout()))
    except Exception:
        return False


def _latex_for_parse(expr: str) -> str:
    """Wrap a bare LaTeX answer in ``$...$`` so math-verify's LaTeX extractor
    sees it (answers that already contain ``$``/``\\(`` pass unchanged)."""
    expr = expr.strip()
    if "$" in expr or "\\(" in expr or "\\[" in expr:
        return expr
    return f"${expr}$"


def _parse_answer(expr: str) -> list:
    """math-verify parse of one answer expression (a box content or a data
    set answer).  If it holds stray ``$`` signs that break the parse (Minerva
    line 73 boxes ``...+$ $\\dot{x}_0...``), retry with them removed."""
    parsed = _mv_parse_safe(_latex_for_parse(expr))
    if not parsed and "$" in expr:
        parsed = _mv_parse_safe(_latex_for_parse(expr.replace("$", " ")))
    return parsed


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
    expression, then (for several boxes) all boxes together, then
    math-verify's own extraction of the whole response if nothing is boxed."""
    boxes = [b for b in extract_boxed(response) if b]
    cands: List[list] = []
    if boxes:
        cands.append(_parse_answer(boxes[-1]))
        if len(boxes) > 1:
            # "\boxed{69}, \boxed{84}" for a two-value answer
            cands.append(_mv_parse_safe(response))
    else:
        cands.append(_mv_parse_safe(response))
    return [c for c in cands if c]


# --------------------------------------------------------------------------
# Verifiers
# --------------------------------------------------------------------------
@register_verifier("numeric")
def numeric_verifier(response: str, ground_truth: str) -> float:
    """MAWPS-style numeric answer (ground truth like ``"43.0"``).

    Extraction: :func:`extract_numeric_answer` (last ``\\boxed{}``, else the
    "####" / "answer is" / "Answer:" anchor, else the last number), as in the
    Qwen2.5-Math evaluation harness.  Comparison: relative tolerance
    ``REL_TOL`` = 1e-4, so 43 == 43.0 == "43.00" and 0.33333 == 1/3; when
    both numbers are whole they must be equal (70001 != 70000).
    """
    gt = _numeric_ground_truth(ground_truth)
    pred = extract_numeric_answer(response or "")
    if pred is None or not math.isfinite(pred):
        return 0.0
    return 1.0 if _close(pred, gt) else 0.0


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
    ``\\boxed{}`` expression is parsed with ``math_verify.parse``; if nothing
    is boxed, math-verify's own extraction of the whole response is used.
    Equivalence is ``math_verify.verify(gold, pred)``.
    """
    gold = _parse_gold(ground_truth)
    for cand in _response_candidates(response or ""):
        if _mv_equal(gold, cand):
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
            if _mv_equal(golds[0], cand):
                return 1.0
        return 0.0

    # Several answers: (a) the last k boxes, matched one to one in any order.
    boxes = [b for b in extract_boxed(response) if b]
    if len(boxes) >= len(golds):
        preds = [_parse_answer(b) for b in boxes[-len(golds) :]]
        if _perfect_match(golds, preds):
            return 1.0
    # (b) one expression holding all answers, compared as a set.
    joined = _parse_gold(", ".join(_strip_math_delims(str(a)) for a in answers))
    for cand in _response_candidates(response):
        if _mv_equal(joined, cand):
            return 1.0
    return 0.0


def _perfect_match(golds: Sequence[list], preds: Sequence[list]) -> bool:
    """True if every gold has its own equal prediction (bipartite matching by
    augmenting paths; sizes are tiny)."""
    adj = [[j for j, p in enumerate(preds) if _mv_equal(g, p)] for g in golds]
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
