"""evaluate(): greedy accuracy and avg@k against hand counts, each data set's verifier on
real rows, malformed rows, modes, the JSON summary. A fake engine returns canned responses
so every expected accuracy is known exactly."""

from __future__ import annotations

import json
import math
import re
from dataclasses import replace

import pytest
import torch

from megatron_cegrpo.data import DatasetError, PromptRecord, load_dataset
from megatron_cegrpo.evaluation import (
    DEFAULT_SUITE,
    DatasetResult,
    EvalMode,
    evaluate,
    evaluate_detailed,
    format_table,
    load_eval_datasets,
    load_summary,
    parse_mode,
    resolve_modes,
    write_summary,
)
from megatron_cegrpo.rewards import get_verifier
from megatron_cegrpo.rollout.base import RolloutOutput


class CharTokenizer:
    """Chat template '<u>...</u><a>' and one token per character: prompts decode exactly."""

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        assert not tokenize and add_generation_prompt
        return "".join(f"<u>{m['content']}</u>" for m in messages) + "<a>"

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}

    @staticmethod
    def decode_prompt(ids) -> str:
        return "".join(chr(int(i)) for i in ids)


class FakeEngine:
    """``generate`` answers from ``canned[question]``: a string (every call) or a list (the
    n-th time the question is asked gets element n). Records every call."""

    def __init__(self, records, canned):
        """``canned``: {row number: answer(s)} for ``records``."""
        self.by_prompt = {r.question: canned[r.row] for r in records}
        self.calls = []  # (questions, temperature, greedy, generator_seed)
        self.asked = {}

    def _question(self, ids):
        text = CharTokenizer.decode_prompt(ids)
        assert text.startswith("<u>") and text.endswith("</u><a>"), text
        body = text[3:-7]
        for q in self.by_prompt:
            if body.startswith(q):  # the template may add an instruction after the question
                return q
        raise AssertionError(f"unknown prompt {body[:60]!r}")

    def generate(self, prompt_ids, *, max_new_tokens, temperature, top_p=1.0, greedy=False,
                 generator_seed=None, return_logprobs=True):
        qs = [self._question(p) for p in prompt_ids]
        self.calls.append((qs, temperature, greedy, generator_seed))
        texts = []
        for q in qs:
            c = self.by_prompt[q]
            n = self.asked.get(q, 0)
            self.asked[q] = n + 1
            texts.append(c[n] if isinstance(c, list) else c)
        # response i: 3 tokens, the last one unfinished
        resp = [torch.arange(3) for _ in texts]
        finished = torch.tensor([i != len(texts) - 1 for i in range(len(texts))])
        return RolloutOutput([p.clone() for p in prompt_ids], resp, [torch.zeros(3) for _ in texts],
                             texts, finished)


TOK = CharTokenizer()


# ----------------------------------------------------------------------------- hand counts


def test_greedy_accuracy_is_the_hand_count():
    recs = load_dataset("mawps", limit=5)  # targets 14, 9, 8, 15, ...
    assert [r.ground_truth for r in recs[:4]] == ["14.0", "9.0", "8.0", "15.0"]
    canned = {
        1: "7 + 7 = 14 bottle caps are in the box. The answer is 14.",   # right
        2: "Jose ends with 7 + 2 = 10 bottle caps.",                        # wrong (9)
        3: "\\boxed{8}",                                                    # right
        4: "The answer is 51.",                                             # wrong (15)
        5: f"So the result is \\boxed{{{float(recs[4].ground_truth):g}}}",  # right
    }
    eng = FakeEngine(recs, canned)
    m = evaluate(eng, TOK, {"mawps": recs}, modes="greedy", max_new_tokens=32, batch_size=2,
                 template="plain", progress=False)
    assert m["val/mawps/acc"] == pytest.approx(0.6, abs=1e-12)  # 3 of 5
    assert m["val/mawps/num_rows"] == 5
    # per-problem [1,0,1,0,1]: sample variance 0.3, stderr sqrt(0.3/5)
    assert m["val/mawps/acc_stderr"] == pytest.approx(math.sqrt(0.3 / 5), abs=1e-12)
    assert "val/mawps/pass@1" not in m
    # every prompt asked once, greedy, in chunks of at most 2
    assert sorted(eng.asked.values()) == [1] * 5
    assert all(greedy and len(qs) <= 2 for qs, _, greedy, _ in eng.calls)
    assert len(eng.calls) == 3
    # 3 chunks of sizes 2,2,1: one unfinished response each -> 3 of 5 truncated; length 3
    assert m["val/mawps/response_length/clip_ratio"] == pytest.approx(3 / 5)
    assert m["val/mawps/response_length/mean"] == 3.0
    # the mean, not the largest or the first: two rows of 2 and 6 tokens
    r = DatasetResult("x", EvalMode(), recs[:2], [[1.0], [0.0]], [["a"], ["b"]], [[2], [6]], [[False], [True]], 0.0)
    assert r.metrics()["val/x/response_length/mean"] == 4.0
    assert m["timing_s/eval"] >= m["timing_s/eval/mawps"] >= 0


def test_avg_at_k_averages_k_samples_and_sends_each_prompt_k_times_with_the_temperature():
    recs = load_dataset("amc23", limit=3)  # answers 27, 36, 45
    right = {r.row: f"... so the answer is \\boxed{{{r.ground_truth}}}." for r in recs}
    wrong = "I think it is \\boxed{1000001}."
    canned = {
        1: [right[1], wrong, wrong, right[1]],  # [1,0,0,1] -> 0.5
        2: [right[2]] * 4,                      # 1.0
        3: [wrong] * 4,                         # 0.0
    }
    eng = FakeEngine(recs, canned)
    rep = evaluate_detailed(eng, TOK, {"amc23": recs}, modes=("avg@4", 0.6), max_new_tokens=16,
                            batch_size=5, template="boxed", progress=False, seed=7)
    m = rep.metrics
    assert rep.datasets["amc23"].scores[0] == [1.0, 0.0, 0.0, 1.0]
    assert rep.datasets["amc23"].per_problem == [0.5, 1.0, 0.0]
    assert m["val/amc23/acc"] == pytest.approx(0.5)          # (0.5 + 1 + 0) / 3
    assert m["val/amc23/pass@4"] == pytest.approx(2 / 3)     # problems 1 and 2
    assert m["val/amc23/num_rows"] == 3
    assert eng.asked == {r.question: 4 for r in recs}
    assert {t for _, t, _, _ in eng.calls} == {0.6}
    assert not any(g for _, _, g, _ in eng.calls)
    assert sum(len(qs) for qs, *_ in eng.calls) == 12 and max(len(qs) for qs, *_ in eng.calls) <= 5
    # chunk seeds differ from each other and are reproducible
    seeds = [s for *_, s in eng.calls]
    assert len(set(seeds)) == len(seeds)
    eng2 = FakeEngine(recs, canned)
    evaluate(eng2, TOK, {"amc23": recs}, modes="avg@4:0.6", max_new_tokens=16, batch_size=5,
             template="boxed", progress=False, seed=7)
    assert [s for *_, s in eng2.calls] == seeds


def test_several_datasets_default_modes_and_progress_bar(capsys):
    mawps = load_dataset("mawps", limit=2)
    aime = load_dataset("aime24", limit=2)
    canned_m = {r.row: f"\\boxed{{{r.ground_truth}}}" for r in mawps}
    canned_a = {1: "\\boxed{204}", 2: "\\boxed{0}"}
    eng = FakeEngine(mawps, canned_m)
    eng.by_prompt.update(FakeEngine(aime, canned_a).by_prompt)  # row numbers repeat across sets
    m = evaluate(eng, TOK, {"mawps": mawps, "aime24": aime}, max_new_tokens=8, batch_size=16,
                 template="plain", progress=True)
    assert m["val/mawps/acc"] == 1.0
    assert m["val/aime24/acc"] == 0.5 and m["val/aime24/pass@8"] == 0.5
    # aime24's suite mode: 8 samples at T=0.7; mawps greedy
    assert eng.asked[aime[0].question] == 8 and eng.asked[mawps[0].question] == 1
    assert {(t, g) for qs, t, g, _ in eng.calls if qs[0] in {r.question for r in aime}} == {(0.7, False)}
    err = capsys.readouterr().err
    assert "eval aime24 (avg@8 T=0.7)" in err and "eval mawps (greedy)" in err


# ----------------------------------------------------------------------------- verifiers x data sets


def _right_answer(r: PromptRecord) -> str:
    """A right answer in the form ``r``'s verifier reads. The numeric and gsm8k ones end in another
    number, which the boxed verifier takes for the answer (it scores them 0), so that a row scored
    by the boxed verifier instead of its own would fail."""
    if r.verifier == "olympiad_list":
        answers = [a.strip().strip("$") for a in json.loads(r.ground_truth)]
        return "Therefore the answer is " + ", ".join(f"\\boxed{{{a}}}" for a in answers) + "."
    if r.verifier == "gsm8k":
        return f"Step by step the total is found. The answer is {r.ground_truth}. Then 3 + 4 = 7."
    if r.verifier == "numeric":
        return f"Adding up gives the result. The answer is {float(r.ground_truth):g}. Then 3 + 4 = 7."
    return f"Putting it together, the final answer is $\\boxed{{{r.ground_truth}}}$."


@pytest.mark.parametrize("name,verifier", [
    ("mawps", "numeric"), ("gsm8k/test", "gsm8k"), ("minerva_math", "boxed"),
    ("amc23", "boxed"), ("aime24", "boxed"), ("olympiadbench", "olympiad_list"),
])
def test_each_dataset_uses_its_verifier_on_real_rows(name, verifier):
    recs = load_dataset(name, limit=3)
    assert {r.verifier for r in recs} == {verifier}
    good = FakeEngine(recs, {r.row: _right_answer(r) for r in recs})
    bad = FakeEngine(recs, {r.row: "After some work the answer is \\boxed{-987654}." for r in recs})
    kw = dict(modes={name: "greedy"}, max_new_tokens=8, template="boxed", progress=False)
    assert evaluate(good, TOK, {name: recs}, **kw)[f"val/{name}/acc"] == 1.0
    assert evaluate(bad, TOK, {name: recs}, **kw)[f"val/{name}/acc"] == 0.0
    if verifier in ("numeric", "gsm8k"):  # scored by the boxed verifier, these right answers score 0
        assert [get_verifier("boxed")(_right_answer(r), r.ground_truth) for r in recs] == [0.0] * 3


def test_near_miss_answers_score_zero():
    gsm = load_dataset("gsm8k/test", limit=3)  # row 3: 70000
    eng = FakeEngine(gsm, {1: "#### 18", 2: "#### 3", 3: "She made a profit of $70,001.\n#### 70001"})
    m = evaluate(eng, TOK, {"gsm8k/test": gsm}, max_new_tokens=8, progress=False)
    assert m["val/gsm8k/test/acc"] == pytest.approx(2 / 3)


# ----------------------------------------------------------------------------- malformed rows


def test_malformed_ground_truth_names_the_row_before_any_generation():
    recs = load_dataset("mawps", limit=4)
    recs[2] = replace(recs[2], ground_truth="twelve apples")
    eng = FakeEngine(recs, {r.row: "\\boxed{1}" for r in recs})
    with pytest.raises(DatasetError, match=r"'mawps', row 3: ground truth 'twelve apples' is unusable"):
        evaluate(eng, TOK, {"mawps": recs}, progress=False)
    assert eng.calls == []


@pytest.mark.parametrize("change,msg", [
    (dict(question="   "), r"row 2: question is '   '"),
    (dict(verifier="nope"), r"row 2: unknown verifier 'nope'"),
    (dict(ground_truth="[not json"), r"row 2: ground truth .* is unusable"),
])
def test_malformed_records_raise_dataset_error(change, msg):
    recs = load_dataset("olympiadbench", limit=2)
    recs[1] = replace(recs[1], **change)
    with pytest.raises(DatasetError, match=msg):
        evaluate(FakeEngine(recs[:1], {1: ""}), TOK, {"olympiadbench": recs}, progress=False)


def test_malformed_file_row_is_named_by_load_eval_datasets(tmp_path, monkeypatch):
    (tmp_path / "mawps").mkdir()
    (tmp_path / "mawps" / "singleop.jsonl").write_text(
        '{"input": "1 + 1?", "target": 2.0}\n{"input": "2 + 2?", "target": "four"}\n')
    monkeypatch.setenv("CEGRPO_DATA_ROOT", str(tmp_path))
    with pytest.raises(DatasetError, match=r"singleop.jsonl, line 2: field 'target'"):
        load_eval_datasets(["mawps"])
    assert len(load_eval_datasets(["mawps"], limit=1)["mawps"]) == 1
    with pytest.raises(DatasetError, match="no rows"):
        evaluate(FakeEngine([], {}), TOK, {"mawps": []}, progress=False)


# ----------------------------------------------------------------------------- modes


def test_parse_mode_and_default_suite():
    assert parse_mode("greedy") == EvalMode() == parse_mode(None)
    assert parse_mode("avg@8") == EvalMode(greedy=False, k=8, temperature=0.7)
    assert parse_mode(("avg@4", 1.0)) == parse_mode("avg@4:1.0") == EvalMode(False, 4, 1.0)
    for bad, why in [("avg@", "eval mode 'avg@': expected 'greedy', 'avg@K'"),
                     ("avg@0", "avg@k needs an integer k >= 1, got 0"),
                     ("best@4", "eval mode 'best@4': expected 'greedy', 'avg@K'"),
                     (("greedy", 0.7), "greedy decoding takes no temperature"),
                     (("avg@4", -1.0), "avg@k needs a finite temperature > 0, got -1.0"),
                     ("avg@4:0", "avg@k needs a finite temperature > 0, got 0.0")]:
        with pytest.raises(ValueError, match=re.escape(why)):
            parse_mode(bad)
    assert {n: m.name for n, m in DEFAULT_SUITE.items()} == {
        "gsm8k/test": "greedy", "mawps": "greedy", "minerva_math": "greedy",
        "amc23": "avg@8", "aime24": "avg@8", "olympiadbench": "greedy"}
    assert DEFAULT_SUITE["amc23"].temperature == 0.7
    modes = resolve_modes(["amc23", "mawps/addsub", "mawps"], {"mawps": "avg@2"})
    assert [m.name for m in modes.values()] == ["avg@8", "greedy", "avg@2"]
    assert all(m.name == "avg@3" for m in resolve_modes(["amc23", "mawps"], "avg@3").values())


# ----------------------------------------------------------------------------- JSON summary


def test_summary_round_trip(tmp_path):
    recs = load_dataset("aime24", limit=2)
    eng = FakeEngine(recs, {1: ["\\boxed{204}", "\\boxed{1}"], 2: ["\\boxed{113}", "\\boxed{113}"]})
    rep = evaluate_detailed(eng, TOK, {"aime24": recs}, modes="avg@2", max_new_tokens=8, progress=False)
    rep.metrics["val/extra/nanvalue"] = float("nan")
    path = write_summary(str(tmp_path / "sub" / "res.json"), rep, {"label": "dense", "model": "fake"},
                         num_examples=1)
    data = json.loads(open(path).read())
    assert data["schema"] == "megatron_cegrpo.eval/1"
    assert data["metrics"]["val/aime24/acc"] == 0.75 and data["metrics"]["val/extra/nanvalue"] == "nan"
    ds = data["datasets"]["aime24"]
    assert (ds["mode"], ds["k"], ds["temperature"], ds["num_rows"]) == ("avg@2", 2, 0.7, 2)
    assert [r["scores"] for r in ds["rows"]] == [[1.0, 0.0], [1.0, 1.0]]
    assert len(ds["examples"]) == 1 and ds["examples"][0]["responses"] == ["\\boxed{204}", "\\boxed{1}"]
    s = load_summary(path)
    assert s["label"] == "dense" and s["acc"]["aime24"] == 0.75 and s["modes"]["aime24"] == "avg@2 T=0.7"
    assert "aime24" in format_table(rep) and "0.7500" in format_table(rep)
    # the trainer's summary.json and a flat dict are readable too
    (tmp_path / "summary.json").write_text(json.dumps({"final": {"val/holdout/acc": 0.25}}))
    assert load_summary(str(tmp_path / "summary.json"))["acc"] == {"holdout": 0.25}
    (tmp_path / "junk.json").write_text(json.dumps({"a": 1}))
    with pytest.raises(ValueError, match="no 'val/<data set>/acc'"):
        load_summary(str(tmp_path / "junk.json"))


def test_evaluation_asks_the_engine_to_skip_logprobs():
    recs = load_dataset("mawps", limit=2)
    seen = []

    class NoLogprobEngine(FakeEngine):
        def generate(self, prompt_ids, *, return_logprobs=True, **kw):
            seen.append(return_logprobs)
            return super().generate(prompt_ids, **kw)

    eng = NoLogprobEngine(recs, {1: "\\boxed{14}", 2: "\\boxed{9}"})
    assert evaluate(eng, TOK, {"mawps": recs}, progress=False)["val/mawps/acc"] == 1.0
    assert seen == [False]

