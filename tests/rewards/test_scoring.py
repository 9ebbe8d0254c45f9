"""score_responses: every reward value is checked before it reaches the advantages."""

import decimal
import re
from fractions import Fraction

import numpy as np
import pytest
import torch

from megatron_cegrpo.data import PromptRecord
from megatron_cegrpo.rewards import RewardError, get_verifier, load_custom_reward_function, score_responses

LONG_Q = (
    "Natalia sold clips to 48 of her friends in April, and then she sold\n"
    "half as many clips in May. How many clips did Natalia sell altogether?"
)


def _rec(question="q", gt="72", verifier="numeric"):
    return PromptRecord(question=question, ground_truth=gt, verifier=verifier, dataset="t", row=1)


def _const(*values):
    """get_reward_fn whose function returns ``values`` in turn."""
    it = iter(values)
    return lambda _name: (lambda response, gt: next(it))


def test_verifiers_per_record_values_dtype_shape():
    # each row by its own verifier: the olympiad_list row's JSON ground truth is no number (the
    # numeric verifier would refuse it), and "The answer is 5. Then 3 + 4 = 7." is right for numeric
    # and wrong for boxed (which reads the last number)
    recs = [_rec(gt="72"), _rec(gt="72"), _rec(gt="\\frac{1}{2}", verifier="boxed"), _rec(gt="3", verifier="gsm8k"),
            _rec(gt='["$69$,$84$"]', verifier="olympiad_list"), _rec(gt="5"), _rec(gt="5", verifier="boxed")]
    texts = ["\\boxed{72}", "The answer is 71.", "\\boxed{0.5}", "#### 3", "\\boxed{84, 69}",
             "The answer is 5. Then 3 + 4 = 7.", "The answer is 5. Then 3 + 4 = 7."]
    scores = score_responses(get_verifier, None, recs, texts)
    assert scores.dtype == torch.float32 and scores.shape == (7,)
    assert scores.tolist() == [1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0]


@pytest.mark.parametrize(
    "value,expected",
    [
        (True, 1.0), (False, 0.0), (1, 1.0), (0.25, 0.25), (-3, -3.0), (Fraction(1, 4), 0.25),
        (decimal.Decimal("0.5"), 0.5), (np.float64(0.75), 0.75), (np.float32(0.5), 0.5), (np.int64(2), 2.0),
        (np.bool_(True), 1.0), (np.array(0.5), 0.5), (torch.tensor(0.5), 0.5), (torch.tensor([1.0]), 1.0),
        (torch.tensor(True), 1.0), (3e38, 3e38),
    ],
)
def test_accepted_values(value, expected):
    scores = score_responses(_const(value), "r.py:fn", [_rec()], ["x"])
    assert scores.dtype == torch.float32
    assert scores.item() == pytest.approx(expected, rel=1e-7)


@pytest.mark.parametrize(
    "value,shown,problem",
    [
        (None, "None", "no value"),
        (float("nan"), "nan", "NaN"),
        (float("inf"), "inf", "infinite"),
        (float("-inf"), "-inf", "infinite"),
        (np.float32("nan"), "np.float32(nan)", "NaN"),
        (torch.tensor(float("nan")), "tensor(nan)", "NaN"),
        (decimal.Decimal("NaN"), "Decimal('NaN')", "NaN"),
        (decimal.Decimal("sNaN"), "Decimal('sNaN')", "NaN"),
        (1e39, "1e+39", "beyond the float32 range"),  # finite in fp64, inf in the fp32 tensor
        (10**400, "1000000000", "too large for a float"),
        ("1.0", "'1.0'", "a str, not a real number"),
        ([1.0], "[1.0]", "a list, not a real number"),
        (1 + 2j, "(1+2j)", "a complex, not a real number"),
        (torch.tensor([1.0, 0.0]), "tensor([1., 0.])", "a Tensor of shape (2,), not one number"),
    ],
)
def test_rejected_values_name_function_row_value_and_fix(value, shown, problem):
    recs = [_rec(), _rec(), _rec(question=LONG_Q)]
    with pytest.raises(RewardError, match=re.escape(f"returned {shown}") + ".*" + re.escape(f"({problem}")) as e:
        score_responses(_const(1.0, 0.0, value), "my_rewards.py:score", recs, ["a", "b", "c"])
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith(f"reward function 'my_rewards.py:score' returned {shown}")
    assert f"({problem}" in msg
    # the row: its index and the question, one line, cut to 60 characters
    assert "row 2 of the batch (question 'Natalia sold clips to 48 of her friends in April, and the...')" in msg
    assert msg.endswith("return a finite float for every response (e.g. 0.0 for a wrong or unscorable answer)")


def test_raising_reward_is_wrapped_and_chained():
    def boom(response, gt):
        raise ValueError("no score for\n  this response")

    with pytest.raises(RewardError, match="raised ValueError: no score for this response on row 0") as e:
        score_responses(lambda _n: boom, "my_rewards.py:score", [_rec(question="What is 2+2?")], ["4"])
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith("reward function 'my_rewards.py:score' raised ValueError: no score for this "
                          "response on row 0 of the batch (question 'What is 2+2?'); fix the reward function")
    assert isinstance(e.value.__cause__, ValueError) and not isinstance(e.value.__cause__, RewardError)


def test_verifier_error_names_the_verifier_and_row():
    recs = [_rec(gt="72"), _rec(gt="twelve apples", question="How many apples?")]
    with pytest.raises(RewardError, match="^verifier 'numeric' raised ValueError: numeric ground truth") as e:
        score_responses(get_verifier, None, recs, ["\\boxed{72}", "\\boxed{12}"])
    msg = str(e.value)
    assert msg.startswith("verifier 'numeric' raised ValueError: numeric ground truth 'twelve apples' is not a number")
    assert "row 1 of the batch (question 'How many apples?')" in msg
    # a RewardError is a ValueError: callers that catch ValueError still do
    assert isinstance(e.value, ValueError)


def test_unknown_verifier_is_named():
    with pytest.raises(RewardError, match=r"verifier 'nope' cannot be resolved for row 0 .*unknown verifier 'nope'"):
        score_responses(get_verifier, None, [_rec(verifier="nope")], ["x"])


def test_length_mismatch_and_empty_batch():
    with pytest.raises(ValueError, match="2 records but 1 response texts"):
        score_responses(get_verifier, None, [_rec(), _rec()], ["x"])
    empty = score_responses(get_verifier, None, [], [])
    assert empty.dtype == torch.float32 and empty.shape == (0,)


def test_custom_reward_file_end_to_end(tmp_path):
    src = tmp_path / "my_rewards.py"
    src.write_text(
        "import math\n"
        "def score(response, ground_truth):\n"
        "    if 'skip' in response:\n"
        "        return math.nan\n"
        "    return 0.35 if ground_truth in response else 0.0\n"
    )
    spec = f"{src}:score"
    fn = load_custom_reward_function(spec)
    recs = [_rec(gt="72"), _rec(gt="72"), _rec(gt="5", question="Q3")]
    scores = score_responses(lambda _n: fn, spec, recs, ["72", "71", "5"])
    assert scores.tolist() == [pytest.approx(0.35), 0.0, pytest.approx(0.35)]
    with pytest.raises(RewardError, match=re.escape(f"{spec!r} returned nan (NaN) for row 1")) as e:
        score_responses(lambda _n: fn, spec, recs, ["72", "skip", "5"])
    assert str(e.value).startswith(f"reward function {spec!r} returned nan (NaN) for row 1 of the batch")
