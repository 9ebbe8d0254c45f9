"""Tests for megatron_cegrpo.rewards.verifiers, on real rows of shared/data."""

import json
import os
import re
from pathlib import Path

import pytest

_REPO = Path(__file__).resolve().parents[2]

from megatron_cegrpo.data import default_data_root, load_dataset
from megatron_cegrpo.rewards import (
    available_verifiers,
    extract_boxed,
    extract_numeric_answer,
    get_verifier,
    parse_number,
    register_verifier,
)

needs_data = pytest.mark.skipif(
    not os.path.isdir(default_data_root()),
    reason=f"data folder {default_data_root()} not found (set $CEGRPO_DATA_ROOT)",
)

numeric = get_verifier("numeric")
gsm8k = get_verifier("gsm8k")
boxed = get_verifier("boxed")
olympiad = get_verifier("olympiad_list")


def _raw_rows(rel, n):
    with open(os.path.join(default_data_root(), rel), encoding="utf-8") as fh:
        return [json.loads(next(fh)) for _ in range(n)]


def _fmt(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


# --------------------------------------------------------------------------
# registry
# --------------------------------------------------------------------------
def test_registry_names_and_unknown():
    assert {"numeric", "gsm8k", "boxed", "olympiad_list"} <= set(available_verifiers())
    with pytest.raises(ValueError, match="unknown verifier 'no_such_verifier'; valid names:") as e:
        get_verifier("no_such_verifier")
    msg = str(e.value)
    assert "no_such_verifier" in msg and "numeric" in msg and "olympiad_list" in msg


def test_register_custom_and_duplicate():
    @register_verifier("_test_always_one")
    def _one(response, gt):
        return 1.0

    try:
        assert get_verifier("_test_always_one")("x", "y") == 1.0
        assert "_test_always_one" in available_verifiers()
        with pytest.raises(ValueError, match="verifier 'numeric' is already registered"):
            register_verifier("numeric")(lambda r, g: 0.0)
    finally:
        from megatron_cegrpo.rewards import verifiers

        verifiers._VERIFIERS.pop("_test_always_one", None)


# --------------------------------------------------------------------------
# numeric (MAWPS)
# --------------------------------------------------------------------------
@needs_data
def test_numeric_real_mawps_rows():
    recs = load_dataset("mawps/singleop", limit=30)
    for r in recs:
        gt = r.ground_truth  # e.g. "14.0"
        ans = _fmt(float(gt))  # "14"
        for resp in (
            f"Adding them gives \\boxed{{{ans}}}.",
            f"7 + 7 = {ans}\n#### {ans}",
            f"The answer is {ans}.",
            f"So there are {ans} bottle caps",
            f"Answer: ${float(gt):.2f}",
        ):
            assert numeric(resp, gt) == 1.0, (r.row, resp, gt)
        wrong = _fmt(float(gt) + 1)
        assert numeric(f"The answer is {wrong}.", gt) == 0.0
        assert numeric(f"\\boxed{{{wrong}}}", gt) == 0.0
        assert numeric("I am not sure how to solve this.", gt) == 0.0


@needs_data
def test_numeric_mawps_non_integer_target():
    rows = _raw_rows("mawps/singleop.jsonl", 562)
    frac = [r for r in rows if not float(r["target"]).is_integer()]
    assert frac, "singleop has non-integer targets"
    gt = str(frac[0]["target"])
    assert numeric(f"The answer is {gt}.", gt) == 1.0
    assert numeric(f"\\boxed{{{float(gt) * 1.00001}}}", gt) == 1.0  # within 1e-4
    assert numeric(f"\\boxed{{{float(gt) * 1.001}}}", gt) == 0.0  # outside


def test_numeric_tolerance_and_forms():
    assert numeric("43", "43.0") == 1.0
    assert numeric("\\boxed{43.00}", "43") == 1.0
    assert numeric("It costs $1,080.", "1080") == 1.0
    assert numeric("\\boxed{\\$1,080}", "1,080") == 1.0
    assert numeric("\\boxed{\\frac{3}{4}}", "0.75") == 1.0
    assert numeric("The answer is 3/4.", "0.75") == 1.0
    assert numeric("The answer is -5.", "-5") == 1.0
    assert numeric("The answer is 5.", "-5") == 0.0
    assert numeric("\\boxed{0}", "0") == 1.0
    assert numeric("\\boxed{0.33333}", "1/3") == 1.0  # relative 1e-4
    assert numeric("\\boxed{70001}", "70000") == 0.0  # whole numbers: exact
    assert numeric("\\boxed{70000.0}", "70000") == 1.0
    assert numeric("\\boxed{0.001}", "0") == 0.0


def test_numeric_extraction_priority():
    # the last box wins over later loose numbers
    assert extract_numeric_answer("\\boxed{12} (check: 3 * 4 = 12, 12 - 1 = 11)") == 12.0
    # anchor beats the last number
    assert extract_numeric_answer("The answer is 14. Check: 7 + 7 = 14, step 2") == 14.0
    # an equation after the anchor: value after the last '='
    assert extract_numeric_answer("The answer is 7 + 7 = 14 caps.") == 14.0
    # only the anchor's sentence counts
    assert extract_numeric_answer("The answer is 12. Then 3 + 4 = 7.") == 12.0
    assert extract_numeric_answer("The answer is 7.5 apples. Check: 15 / 2") == 7.5
    # GSM8K marker
    assert extract_numeric_answer("48/2 = 24\n48 + 24 = 72\n#### 72") == 72.0
    # boxed with text / equation inside
    assert extract_numeric_answer("\\boxed{14 \\text{ apples}}") == 14.0
    assert extract_numeric_answer("\\boxed{x = 14}") == 14.0
    assert extract_numeric_answer("\\boxed{\\text{14 apples}}") == 14.0
    assert extract_numeric_answer("\\boxed{3 \\text{ and } 4}") is None  # two numbers: ambiguous
    # a box without a number is binding: no answer
    assert extract_numeric_answer("7 + 7 = 14, so \\boxed{x}") is None
    # unterminated last box (generation cut off inside the final answer): no
    # answer. The "1" is a fragment of it (1? 14? 1/2?), not a stated number
    assert extract_numeric_answer("7 + 7 = 14 so \\boxed{1") is None
    assert extract_numeric_answer("") is None
    assert extract_numeric_answer("no digits here") is None


@pytest.mark.parametrize(
    "text,expected",
    [
        # SmolLM2-135M greedy outputs on mawps/singleop (measurement run)
        # row 5, "boxed" template: the instruction's empty \boxed{} is echoed
        ("To put your final answer within \\boxed{}, you need to add the 3 more cards.\n\n"
         "\\boxed{} 3 more are added to the original 4 cards.\n\nSo, the answer is 3 + 3 = 6.", 6.0),
        # row 11, "boxed": cut off at max_new_tokens right after a list marker
        ("4. So, Bobby has a total of 2 + 6 = 8 blocks.\n"
         "6. We can add 8 + 2 = 10 blocks to Bobby's father's total of 2 + 6 = 8 blocks.\n7. Therefore,", 8.0),
        # row 38, "plain": the stated final answer wins over a correct intermediate
        ("She buys 18 more candies, which means she has 9 + 18 = 27 candies.\n"
         "Therefore, Barbara has 27 candies.\n#### 2\nThe answer is: 2", 2.0),
        # row 5, "plain": quoted answer
        ("There are 4 + 3 = 7 total cards.\n#### 3\nThe answer is \"3\".", 3.0),
        # row 38, "answer_is": the instruction's 'N' is parroted -> last number
        ("She buys 18 more candies, so she has 9 + 18 = 27 candies remaining. The answer is N.", 27.0),
        # row 8, "boxed"
        ("3. So, 2 + 5 = 7 peanuts Carol has.\n\nSo, Carol has 7 peanuts.\n\nThe final answer is 7.", 7.0),
        ("Step 3: 7 + 7 = 14\nStep 4:", 14.0),
    ],
)
def test_numeric_extraction_on_small_model_outputs(text, expected):
    assert extract_numeric_answer(text) == expected


def test_extract_boxed_nested():
    assert extract_boxed("a \\boxed{\\frac{1}{2}} b \\boxed{3}") == ["\\frac{1}{2}", "3"]
    assert extract_boxed("\\fbox{7}") == ["7"]
    assert extract_boxed("\\boxed{\\{1,2\\}}") == ["\\{1,2\\}"]
    assert extract_boxed("\\boxed{unterminated") == []


@pytest.mark.parametrize("bad", ["abc", "", "4 apples and 3 pears", "nan"])
def test_numeric_malformed_ground_truth_raises(bad):
    with pytest.raises(ValueError, match=re.escape(f"numeric ground truth {bad!r} is not a number")) as e:
        numeric("\\boxed{4}", bad)
    assert repr(bad) in str(e.value)


# --------------------------------------------------------------------------
# gsm8k
# --------------------------------------------------------------------------
@needs_data
def test_gsm8k_real_rows():
    recs = load_dataset("gsm8k/train", limit=1)
    assert recs[0].ground_truth == "72"
    for resp in ("\\boxed{72}", "#### 72", "The answer is 72.", "72 clips"):
        assert gsm8k(resp, "72") == 1.0, resp
    assert gsm8k("The answer is 73.", "72") == 0.0
    assert gsm8k("Natalia sold clips.", "72") == 0.0


@needs_data
def test_gsm8k_reference_solutions_score_one():
    """The dataset's own worked solution is a correct response."""
    rows = _raw_rows("gsm8k/test.jsonl", 100)
    recs = load_dataset("gsm8k/test", limit=100)
    for raw, rec in zip(rows, recs):
        assert gsm8k(raw["answer"], rec.ground_truth) == 1.0, rec.row
        # raw answer field as ground truth is tolerated too
        assert gsm8k(f"\\boxed{{{rec.ground_truth}}}", raw["answer"]) == 1.0
        assert gsm8k(f"#### {int(rec.ground_truth) + 1}", rec.ground_truth) == 0.0


@needs_data
def test_gsm8k_thousands_separator_row():
    rows = _raw_rows("gsm8k/test.jsonl", 1319)
    raw = next(r for r in rows if "," in r["answer"].rsplit("####", 1)[1])
    shown = raw["answer"].rsplit("####", 1)[1].strip()  # e.g. "1,080"
    gt = shown.replace(",", "")
    assert gsm8k(f"The answer is ${shown}.", gt) == 1.0
    assert gsm8k(f"\\boxed{{{gt}}}", gt) == 1.0


# --------------------------------------------------------------------------
# boxed (Minerva, AMC, AIME)
# --------------------------------------------------------------------------
@needs_data
@pytest.mark.parametrize("name", ["aime24", "amc23"])
def test_boxed_competition_rows(name):
    for r in load_dataset(name):
        gt = r.ground_truth
        assert boxed(f"Thus the answer is $\\boxed{{{gt}}}$.", gt) == 1.0, (name, r.row)
        assert boxed(f"\\boxed{{{int(gt) + 1}}}", gt) == 0.0
        assert boxed("I cannot solve this.", gt) == 0.0
    # amc23 stores 27.0: the loader gives "27", and "27.0" in a box is equal
    assert boxed("\\boxed{27.0}", "27") == 1.0


@needs_data
def test_boxed_minerva_reference_solutions():
    rows = _raw_rows("minerva_math/test.jsonl", 20)
    recs = load_dataset("minerva_math", limit=20)
    assert recs[0].ground_truth == "1.6"
    for raw, rec in zip(rows, recs):
        assert boxed(raw["solution"], rec.ground_truth) == 1.0, rec.row
    assert boxed("s = 1.6 cm, so \\boxed{1.6}", "1.6") == 1.0
    assert boxed("\\boxed{1.7}", "1.6") == 0.0
    assert boxed("", "1.6") == 0.0
    # nested-brace answer of row 13 (\frac{...}{...\left[...\right]})
    r13 = recs[12]
    assert r13.ground_truth.startswith("\\frac{2 \\pi c^{2} R^{2}}")
    assert boxed(f"\\boxed{{{r13.ground_truth}}}", r13.ground_truth) == 1.0
    assert boxed("\\boxed{2 \\pi c^2}", r13.ground_truth) == 0.0


def test_boxed_symbolic_equivalence_and_fallback():
    assert boxed("\\boxed{\\frac{1}{2(n+1)}}", "\\frac{1}{2 n+2}") == 1.0
    assert boxed("\\boxed{0.5}", "\\frac{1}{2}") == 1.0
    # nothing boxed: math-verify's own extraction of the whole response
    assert boxed("The final answer is $\\frac{1}{2}$.", "\\frac{1}{2}") == 1.0


def test_boxed_malformed_ground_truth_raises():
    with pytest.raises(ValueError, match="ground truth '' cannot be parsed by math-verify") as e:
        boxed("\\boxed{1}", "")
    assert "''" in str(e.value)


# --------------------------------------------------------------------------
# olympiad_list (OlympiadBench)
# --------------------------------------------------------------------------
@needs_data
def test_olympiad_real_rows():
    recs = load_dataset("olympiadbench", limit=20)
    assert json.loads(recs[0].ground_truth) == ["2"]
    assert olympiad("Sergey needs \\boxed{2} moves.", recs[0].ground_truth) == 1.0
    assert olympiad("\\boxed{3}", recs[0].ground_truth) == 0.0
    assert olympiad("No idea.", recs[0].ground_truth) == 0.0
    assert olympiad("\\boxed{\\frac{1}{2(n+1)}}", recs[1].ground_truth) == 1.0

    multi = next(r for r in recs if json.loads(r.ground_truth) == ["$69$,$84$"])
    assert olympiad("\\boxed{69, 84}", multi.ground_truth) == 1.0
    assert olympiad("\\boxed{84, 69}", multi.ground_truth) == 1.0  # order-insensitive
    assert olympiad("\\boxed{84} and \\boxed{69}", multi.ground_truth) == 1.0
    assert olympiad("\\boxed{84}", multi.ground_truth) == 0.0  # one missing
    tuples = next(r for r in recs if "(1,8,19)" in r.ground_truth)
    assert olympiad("\\boxed{(4,5,7), (1,8,19), (2,7,13)}", tuples.ground_truth) == 1.0
    assert olympiad("\\boxed{(4,5,7), (1,8,19)}", tuples.ground_truth) == 0.0


def test_olympiad_multi_element_list():
    gt = json.dumps(["$3$", "$\\frac{1}{2}$"])
    assert olympiad("first \\boxed{3}, second \\boxed{\\frac{1}{2}}", gt) == 1.0
    assert olympiad("first \\boxed{0.5}, second \\boxed{3}", gt) == 1.0
    assert olympiad("\\boxed{3, \\frac{1}{2}}", gt) == 1.0
    assert olympiad("\\boxed{3}", gt) == 0.0
    assert olympiad("\\boxed{3} \\boxed{3}", gt) == 0.0


@pytest.mark.parametrize("bad", ["not json", "[]", "[\"\"]", "{\"a\": 1}"])
def test_olympiad_malformed_ground_truth_raises(bad):
    with pytest.raises(ValueError, match=re.escape(f"olympiad_list ground truth {bad!r} ")) as e:
        olympiad("\\boxed{2}", bad)
    assert repr(bad) in str(e.value)


# --------------------------------------------------------------------------
# answer kinds: cut-off boxes, units, powers, scientific notation, percent,
# separators, signs, tolerance of tiny / huge values
# --------------------------------------------------------------------------
TRUNC = "First \\boxed{5}. Wait, recheck: the answer is \\boxed{7"
_ANSWER_CASES = [
    # --- a cut-off last box is no answer; the retracted earlier box must not win
    ("numeric", TRUNC, "5", 0.0),
    ("boxed", TRUNC, "5", 0.0),
    ("gsm8k", TRUNC, "5", 0.0),
    ("numeric", TRUNC, "7", 0.0),  # "\boxed{7" may have become 75
    ("gsm8k", "The answer is 72. \\boxed{7", "72", 0.0),
    ("gsm8k", "#### 72\n\\boxed{7", "72", 0.0),
    ("boxed", "\\boxed{\\frac{1}{2}", "\\frac{1}{2}", 0.0),
    ("olympiad_list", "\\boxed{69}, \\boxed{8", '["$69$,$84$"]', 0.0),
    ("numeric", "\\boxed{5 is wrong. Final: \\boxed{7}", "7", 1.0),  # only the last box counts
    # --- a unit's exponent is not a number
    ("numeric", "\\boxed{12 \\text{ cm}^2}", "12", 1.0),
    ("boxed", "\\boxed{12 \\text{ cm}^2}", "12", 1.0),
    ("numeric", "\\boxed{12\\,\\mathrm{m}^2}", "12", 1.0),
    ("boxed", "\\boxed{12\\,\\mathrm{m}^2}", "12", 1.0),
    ("numeric", "\\boxed{12 \\text{ cm}^{2}}", "12", 1.0),
    ("numeric", "\\boxed{8 \\text{ m}^3}", "8", 1.0),
    ("numeric", "\\boxed{5 \\text{ m/s}^2}", "5", 1.0),
    ("numeric", "\\boxed{9.81 \\, \\mathrm{m/s^2}}", "9.81", 1.0),
    ("numeric", "\\boxed{9.8 \\text{ m s}^{-2}}", "9.8", 1.0),
    ("numeric", "\\boxed{60 \\text{ km/h}}", "60", 1.0),
    ("numeric", "\\boxed{90^\\circ}", "90", 1.0),
    ("numeric", "\\boxed{90^{\\circ}}", "90", 1.0),
    ("numeric", "The temperature is -40^\\circ C", "-40", 1.0),
    ("numeric", "The area is 12 cm^2", "12", 1.0),  # last-number rule
    ("numeric", "so the area is 12 m^{2}.", "12", 1.0),
    # --- powers and scientific notation are one number
    ("numeric", "\\boxed{2^{10}}", "1024", 1.0),
    ("numeric", "\\boxed{10^{3}}", "1000", 1.0),
    ("numeric", "\\boxed{2^{-10}}", "0.0009765625", 1.0),
    ("numeric", "The answer is 2^{10}.", "1024", 1.0),
    ("numeric", "\\boxed{1.5 \\times 10^{-3}}", "0.0015", 1.0),
    ("numeric", "\\boxed{1.2 \\cdot 10^{5}}", "120000", 1.0),
    ("numeric", "\\boxed{1.5e-3}", "0.0015", 1.0),
    ("numeric", "\\boxed{6.02 \\times 10^{23}}", "6.02e23", 1.0),
    ("numeric", "It is 3 x 10^8 m/s.", "3e8", 1.0),
    ("numeric", "\\boxed{0.00001}", "1e-05", 1.0),  # str(float) form of a MAWPS target
    ("numeric", "\\boxed{3}", "1e-05", 0.0),
    ("numeric", "\\boxed{2^{2000}}", "4", 0.0),  # huge power: evaluated by math-verify, not hung
    ("boxed", "\\boxed{4.5 \\times 10^{33}}", "4.5e33", 1.0),  # Minerva's e-notation
    ("boxed", "\\boxed{1.5e-3}", "0.0015", 1.0),
    ("boxed", "The final answer is $4.5e33$.", "4.5e33", 1.0),
    ("boxed", "\\boxed{3.8 \\times 10^{35}}", "3.83e35", 0.0),
    # --- LaTeX is read as a whole, not as its digits
    ("numeric", "\\boxed{\\sqrt{2}}", "2", 0.0),
    ("numeric", "\\boxed{\\sqrt{2}}", "1.41421356", 1.0),
    ("numeric", "\\boxed{2x}", "2", 0.0),
    ("numeric", "\\boxed{3,4}", "34", 0.0),
    ("numeric", "\\boxed{\\frac{1}{2^{80}}}", "\\frac{1}{2^{80}}", 1.0),
    # --- tiny and huge values: relative tolerance, exact whole numbers
    ("boxed", "\\boxed{\\frac{1}{2^{80}}}", "\\frac{1}{2^{81}}", 0.0),
    ("numeric", "\\boxed{\\frac{1}{2^{80}}}", "\\frac{1}{2^{81}}", 0.0),
    ("olympiad_list", "\\boxed{2^{-80}}", '["$2^{-81}$"]', 0.0),
    ("boxed", "\\boxed{1e-8}", "2e-8", 0.0),
    ("boxed", "\\boxed{0.0000001}", "0.0000002", 0.0),
    ("boxed", "\\boxed{3.0000001 \\times 10^{-9}}", "3 \\times 10^{-9}", 1.0),
    ("numeric", "\\boxed{2e-10}", "1e-10", 0.0),
    ("numeric", "\\boxed{1.00005e-10}", "1e-10", 1.0),
    ("numeric", "\\boxed{1e-12}", "0", 0.0),  # written exactly: not zero
    ("numeric", "\\boxed{123456789012345678901}", "123456789012345678902", 0.0),
    ("numeric", "\\boxed{2^{80}}", "1208925819614629174706176", 1.0),
    ("numeric", "\\boxed{2^{80}}", "1208925819614629174706177", 0.0),
    ("numeric", "\\boxed{43.004}", "43", 0.0),
    ("boxed", "\\boxed{27.00001}", "27", 0.0),
    ("boxed", "\\boxed{27.0}", "27", 1.0),
    # --- percent: "45%" is right for 45 and for 0.45
    ("numeric", "\\boxed{45\\%}", "45", 1.0),
    ("numeric", "\\boxed{50\\%}", "0.5", 1.0),
    ("numeric", "\\boxed{5\\%}", "0.5", 0.0),
    ("numeric", "The answer is 45%.", "0.45", 1.0),
    ("boxed", "\\boxed{50\\%}", "0.5", 1.0),
    ("boxed", "\\boxed{9\\%}", "9", 1.0),
    # --- thousands separators
    ("numeric", "\\boxed{1,000,000}", "1000000", 1.0),
    ("numeric", "\\boxed{1{,}000}", "1000", 1.0),
    ("numeric", "\\boxed{1\\,000}", "1000", 1.0),
    ("boxed", "\\boxed{1\\,000}", "1000", 1.0),
    ("numeric", "\\boxed{1,234.5}", "1234.5", 1.0),
    # --- negative numbers
    ("numeric", "\\boxed{-3}", "-3", 1.0),
    ("numeric", "\\boxed{3}", "-3", 0.0),
    ("numeric", "\\boxed{\u22125}", "-5", 1.0),  # U+2212 minus sign
    ("numeric", "The answer is \u22125.", "-5", 1.0),
    ("numeric", "\\boxed{-2^{3}}", "-8", 1.0),
    ("numeric", "\\boxed{(-2)^{2}}", "4", 1.0),
    ("numeric", "\\boxed{-\\frac{3}{4}}", "-0.75", 1.0),
    ("numeric", "\\boxed{-.5}", "-1/2", 1.0),
    # --- a box math-verify reads only in part is no answer (issue 35 item 5): its plain-expression
    # fallback read the 3 of 3\sqrt(5) (after its normalisation made \sqrt( a line break) and the 5 of "3 ) 5"
    ("numeric", "\\boxed{3\\sqrt(5)}", "3", 0.0),
    ("boxed", "\\boxed{3\\sqrt(5)}", "3", 0.0),
    ("olympiad_list", "\\boxed{3\\sqrt(5)}", '["3"]', 0.0),
    ("numeric", "\\boxed{3\\sqrt(5) + 1}", "1", 0.0),
    ("numeric", "\\boxed{3 ) 5}", "5", 0.0),
    ("boxed", "\\boxed{3 ) 5}", "5", 0.0),
    ("numeric", "The answer is 3. \\boxed{3\\sqrt(5)}", "3", 0.0),  # the box is binding
    ("boxed", "\\boxed{3\\sqrt{5}}", "3\\sqrt{5}", 1.0),  # read whole: as before
    ("numeric", "\\boxed{3\\sqrt{5}}", "6.7082039", 1.0),
    ("boxed", "\\boxed{np.arcsin(10/13)}", "np.arcsin(10/13)", 1.0),  # no value at all: its text, compared whole
    # --- stray $ inside a box: read as the box without them
    ("numeric", "$\\boxed{12 $ and $13 }. $", "13", 0.0),
    ("numeric", "$\\boxed{12 $ and $13 }. $", "12", 0.0),
    ("boxed", "$\\boxed{12 $ and $13 }. $", "13", 0.0),
    ("olympiad_list", "$\\boxed{12 $ and $13 }. $", '["12", "13"]', 1.0),
    ("numeric", "\\boxed{$\\frac{1}{2}$}", "0.5", 1.0),
    ("boxed", "\\boxed{$\\frac{1}{2}$}", "\\frac{1}{2}", 1.0),
    ("numeric", "\\boxed{\\$1,080}", "1080", 1.0),  # \$ is a dollar sign, not a delimiter
]


@pytest.mark.parametrize("name,response,gold,expected", _ANSWER_CASES)
def test_answer_kinds(name, response, gold, expected):
    assert get_verifier(name)(response, gold) == expected


@pytest.mark.parametrize(
    "text,expected",
    [
        ("\\boxed{2^{10}}", 1024.0),
        ("\\boxed{12 \\text{ cm}^2}", 12.0),
        ("The area is 12 cm^2", 12.0),
        ("\\boxed{1.5 \\times 10^{-3}}", 0.0015),
        ("\\boxed{45\\%}", 45.0),
        ("\\boxed{\\sqrt{2}}", 2**0.5),
        ("\\boxed{2x}", None),
        ("First \\boxed{5}. Wait, recheck: the answer is \\boxed{7", None),
    ],
)
def test_extract_numeric_answer_kinds(text, expected):
    assert extract_numeric_answer(text) == expected


def test_parse_number_forms():
    assert parse_number("1.5e-3") == 0.0015
    assert parse_number("2^{10}") == 1024.0
    assert parse_number("1.5 \\times 10^{-3}") == 0.0015
    assert parse_number("45\\%") == 45.0
    assert parse_number("12 \\text{ cm}^2") is None  # a number with a unit is not a number
    assert parse_number("1e400") == float("inf")
    assert parse_number("3,4") is None and parse_number("2x") is None


def test_numeric_ground_truth_forms():
    assert numeric("\\boxed{1024}", "2^{10}") == 1.0
    assert numeric("\\boxed{0.5}", "\\frac{1}{2}") == 1.0
    assert numeric("\\boxed{0.0015}", "1.5 \\times 10^{-3}") == 1.0
    for bad in ("inf", "\\infty", "1e400", "x", "twelve apples"):
        with pytest.raises(ValueError, match=re.escape(f"numeric ground truth {bad!r} is not a number")) as e:
            numeric("\\boxed{1}", bad)
        assert repr(bad) in str(e.value)


@needs_data
def test_boxed_minerva_scientific_notation():
    """58 Minerva answers are in e-notation ("4.5e33"), which math-verify reads
    as 4.5 * e * 33 (Euler's e): the same value written 4.5 \\times 10^{33}
    scored 0 before the verifier rewrote e-notation."""
    sci = [r for r in load_dataset("minerva_math") if re.fullmatch(r"\d+(\.\d+)?e-?\d+", r.ground_truth)]
    assert len(sci) == 58
    for r in sci:
        mant, exp = r.ground_truth.split("e")
        assert boxed(f"\\boxed{{{mant} \\times 10^{{{exp}}}}}", r.ground_truth) == 1.0, r.row
        assert boxed(f"\\boxed{{{float(mant) * 2:g}e{exp}}}", r.ground_truth) == 0.0, r.row


def test_math_verify_verifiers_work_off_the_main_thread():
    """math-verify's signal-based timeout only works in the main thread; the
    verifiers must still work from rollout worker threads."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=2) as pool:
        got = list(pool.map(lambda args: get_verifier(args[0])(*args[1:]), [
            ("boxed", "\\boxed{0.5}", "\\frac{1}{2}"),
            ("boxed", "\\boxed{0.6}", "\\frac{1}{2}"),
            ("olympiad_list", "\\boxed{84, 69}", '["$69$,$84$"]'),
            ("numeric", "The answer is 72.", "72"),
        ]))
    assert got == [1.0, 0.0, 1.0, 1.0]


def test_a_box_read_in_part_is_logged_in_one_line(caplog):
    with caplog.at_level("WARNING", logger="megatron_cegrpo.rewards.verifiers"):
        assert numeric("so \\boxed{3\\sqrt(5)}", "3") == 0.0
        assert boxed("\\boxed{3 ) 5}", "5") == 0.0
    assert [r.getMessage() for r in caplog.records] == [
        "math-verify reads only '3' of the box '3\\\\sqrt(5)' (its LaTeX parser cannot read the box whole): "
        "no number; the response scores 0",
        "math-verify reads only '5' of the box '3 ) 5' (its LaTeX parser cannot read the box whole): "
        "it is compared as text only (it scores 0 unless it is the answer's text)"]
    caplog.clear()
    with caplog.at_level("WARNING", logger="megatron_cegrpo.rewards.verifiers"):
        assert numeric("\\boxed{2x}", "2") == 0.0  # read whole, holds no number: nothing to report
        assert numeric("\\boxed{14}", "14") == 1.0
    assert caplog.records == []


@pytest.mark.parametrize("box", ["12 and 13", "x = 14", "\\frac{1}{2}", "14 \\text{ apples}", "3,4", "2^{10}", "-7",
                                 "\\sqrt{2}", "3\\sqrt(5)", "1,000"])
def test_stray_dollars_in_a_box_change_nothing(box):
    """A box reads the same with '$' around it, around its first token, or between its tokens."""
    first, _, rest = box.partition(" ")
    variants = [f"${box}$", f"{box} $", f"${first}$ {rest}", " $ $ ".join(box.split(" "))]
    want = extract_numeric_answer(f"\\boxed{{{box}}}")
    for v in variants:
        assert extract_numeric_answer(f"$\\boxed{{{v}}}$.") == want, v
