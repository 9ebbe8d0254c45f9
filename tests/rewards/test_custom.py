"""load_custom_reward_function: a working spec loads; every bad one fails in one line."""

import os

import pytest

from megatron_cegrpo.rewards import RewardError, load_custom_reward_function


@pytest.fixture
def files(tmp_path):
    (tmp_path / "ok.py").write_text("def score(response, ground_truth):\n    return 1.0\nTHRESHOLD = 3\n")
    (tmp_path / "ok.txt").write_text("def score(response, ground_truth):\n    return 1.0\n")
    (tmp_path / "syntax.py").write_text("def score(response, ground_truth)\n    return 1.0\n")
    (tmp_path / "imports.py").write_text("import no_such_module_for_cegrpo\n")
    (tmp_path / "exits.py").write_text("import sys\nsys.exit(2)\n")
    (tmp_path / "one_arg.py").write_text("def score(response):\n    return 1.0\n")
    (tmp_path / "kw.py").write_text("def score(response, ground_truth, *, scale=1.0, **extra):\n    return scale\n")
    (tmp_path / "a:b.py").write_text("def score(response, ground_truth):\n    return 0.5\n")
    return tmp_path


def test_loads_and_calls(files):
    assert load_custom_reward_function(f"{files}/ok.py:score")("x", "y") == 1.0
    assert load_custom_reward_function(f" {files}/kw.py:score ")("x", "y") == 1.0  # extra keyword-only params
    assert load_custom_reward_function(f"{files}/a:b.py:score")("x", "y") == 0.5  # split at the last ':'


@pytest.mark.parametrize(
    "spec,expected",
    [
        # wrong spec format
        ("{d}/ok.py", "--custom-reward-function must be FILE.py:FUNCTION (e.g. my_rewards.py:score), "
                      "got '{d}/ok.py'; name the file and, after a colon, the function in it"),
        ("{d}/ok.py:", "--custom-reward-function must be FILE.py:FUNCTION (e.g. my_rewards.py:score), "
                       "got '{d}/ok.py:'; name the file and, after a colon, the function in it"),
        (":score", "--custom-reward-function must be FILE.py:FUNCTION (e.g. my_rewards.py:score), "
                   "got ':score'; name the file and, after a colon, the function in it"),
        # missing file / not a file / not Python
        ("{d}/missing.py:score", "--custom-reward-function '{d}/missing.py:score': '{d}/missing.py' does not "
                                 "exist (working directory '{cwd}'); give the path of a .py file"),
        ("{d}:score", "--custom-reward-function '{d}:score': '{d}' is a directory, not a file (working "
                      "directory '{cwd}'); give the path of a .py file"),
        ("{d}/ok.txt:score", "--custom-reward-function '{d}/ok.txt:score': '{d}/ok.txt' is not a Python file; "
                             "give a .py file"),
        # the file does not import
        ("{d}/syntax.py:score", "--custom-reward-function '{d}/syntax.py:score': importing '{d}/syntax.py' "
                                "failed with SyntaxError: expected ':' (syntax.py, line 1); fix the file"),
        ("{d}/imports.py:score", "--custom-reward-function '{d}/imports.py:score': importing '{d}/imports.py' "
                                 "failed with ModuleNotFoundError: No module named 'no_such_module_for_cegrpo'; "
                                 "fix the file"),
        ("{d}/exits.py:score", "--custom-reward-function '{d}/exits.py:score': importing '{d}/exits.py' "
                               "failed with SystemExit: 2; fix the file"),
        # missing function name / not callable / wrong arity
        ("{d}/ok.py:scroe", "--custom-reward-function '{d}/ok.py:scroe': '{d}/ok.py' defines no 'scroe' "
                            "(functions defined there: score); name one of them after the colon"),
        ("{d}/ok.py:THRESHOLD", "--custom-reward-function '{d}/ok.py:THRESHOLD': 'THRESHOLD' is an object of "
                                "type int, not a function; name a function (response, ground_truth) -> float"),
        ("{d}/one_arg.py:score", "--custom-reward-function '{d}/one_arg.py:score': score(response) cannot be "
                                 "called as score(response, ground_truth); give it two positional parameters"),
    ],
)
def test_bad_specs_one_line(files, spec, expected):
    spec = spec.format(d=files)
    with pytest.raises(RewardError, match="^--custom-reward-function ") as e:
        load_custom_reward_function(spec)
    assert str(e.value) == expected.format(d=files, cwd=os.getcwd())
    assert isinstance(e.value, ValueError)
