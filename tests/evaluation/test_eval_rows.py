"""Per-row evaluation files (evaluation/rows.py) and the driver that writes them: exact contents,
ids stable across evaluations and across runs of the same --holdout-seed, size, bad files."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest
import torch

from megatron_cegrpo.data import load_dataset
from megatron_cegrpo.data.train_data import load_train_split
from megatron_cegrpo.evaluation import (
    DatasetResult,
    EvalMode,
    EvalRowsError,
    find_eval_rows,
    read_eval_rows,
    rows_digest,
    write_eval_rows,
)
from megatron_cegrpo.rollout.base import RolloutOutput


def _result(name, recs, scores, mode=EvalMode()):
    k = len(scores[0])
    return DatasetResult(name, mode, list(recs), scores, [["x"] * k for _ in recs], [[1] * k for _ in recs],
                         [[False] * k for _ in recs], 0.0)


def test_written_file_is_the_header_then_one_line_per_row(tmp_path):
    recs = load_dataset("mawps", limit=5)
    res = _result("mawps", recs, [[1.0], [0.0], [1.0], [0.0], [1.0]])
    path = write_eval_rows(str(tmp_path), res, 0)
    assert path == str(tmp_path / "eval_rows" / "mawps-step0.jsonl")
    assert (tmp_path / "eval_rows" / "mawps-step0.jsonl").stat().st_mode & 0o777 == 0o644  # not mkstemp's 0600
    lines = (tmp_path / "eval_rows" / "mawps-step0.jsonl").read_text().splitlines()
    header = json.loads(lines[0])
    assert header == {"schema": "megatron_cegrpo.eval_rows/1", "eval": "mawps", "step": 0, "mode": "greedy", "k": 1,
                      "num_rows": 5, "acc": 0.6, "rows_digest": rows_digest(recs)}
    assert lines[1:] == ['{"row":1,"score":1}', '{"row":2,"score":0}', '{"row":3,"score":1}',
                         '{"row":4,"score":0}', '{"row":5,"score":1}']
    back = read_eval_rows(path)
    assert back.ids == [1, 2, 3, 4, 5] and back.scores == [1, 0, 1, 0, 1] and back.acc == res.acc == 0.6
    assert back.by_id() == {1: 1, 2: 0, 3: 1, 4: 0, 5: 1}
    # a data set name's "/" is not a folder; find_eval_rows maps the file back
    res2 = _result("mawps/multiarith", load_dataset("mawps/multiarith", limit=2), [[0.0], [1.0]])
    p2 = write_eval_rows(str(tmp_path), res2, 48)
    assert p2.endswith("eval_rows/mawps,multiarith-step48.jsonl")
    assert find_eval_rows(str(tmp_path)) == {("mawps", 0): path, ("mawps/multiarith", 48): p2}
    assert find_eval_rows(str(tmp_path / "nothing")) == {}


def test_avg_at_k_keeps_the_mean_of_the_k_samples(tmp_path):
    recs = load_dataset("amc23", limit=3)
    res = _result("amc23", recs, [[1.0, 0.0, 0.0, 1.0], [1.0] * 4, [0.0] * 4],
                  EvalMode(greedy=False, k=4, temperature=0.7))
    rows = read_eval_rows(write_eval_rows(str(tmp_path), res, 10))
    assert rows.header["mode"] == "avg@4" and rows.header["k"] == 4 and rows.header["step"] == 10
    assert rows.scores == [0.5, 1, 0]


def test_held_out_row_ids_are_stable_across_runs_of_the_same_holdout_seed():
    a = load_train_split("mawps/singleop", num_holdout=300, seed=1234).holdout
    b = load_train_split("mawps/singleop", num_holdout=300, seed=1234).holdout
    c = load_train_split("mawps/singleop", num_holdout=300, seed=4321).holdout
    assert [r.row for r in a] == [r.row for r in b] and rows_digest(a) == rows_digest(b)
    assert len({r.row for r in a}) == 300  # unique: a line number of the training file
    assert rows_digest(a) != rows_digest(c)
    assert rows_digest(list(reversed(a))) == rows_digest(a)  # a set: order does not matter


def test_a_300_row_file_is_small(tmp_path):
    """The study's evaluation: 300 held-out MAWPS rows, greedy: under 7 kB (6.7 kB measured)."""
    recs = load_train_split("mawps/singleop", num_holdout=300, seed=1234).holdout
    res = _result("holdout", recs, [[float(i % 3 == 0)] for i in range(300)])
    path = write_eval_rows(str(tmp_path), res, 48)
    size = (tmp_path / "eval_rows" / "holdout-step48.jsonl").stat().st_size
    assert 6000 < size < 7000, size
    assert read_eval_rows(path).num_rows == 300


@pytest.mark.parametrize("text, what", [
    ('{"row": 1, "score": 1}\n', "not a per-row evaluation file"),
    ('{"schema": "megatron_cegrpo.eval_rows/1", "num_rows": 2}\n{"row":1,"score":1}\n{"row":1,"score":0}\n',
     "line 3: row 1 appears twice"),
    ('{"schema": "megatron_cegrpo.eval_rows/1", "num_rows": 1}\n{"row":1,"score":2}\n', "score 2.0 is outside"),
    ('{"schema": "megatron_cegrpo.eval_rows/1", "num_rows": 3}\n{"row":1,"score":1}\n{"row":2,"sc',
     "line 3: not a"),
    ('{"schema": "megatron_cegrpo.eval_rows/1", "num_rows": 3}\n{"row":1,"score":1}\n',
     "1 rows, the header says 3"),
])
def test_a_bad_file_is_one_line_naming_it_and_the_fix(tmp_path, text, what):
    p = tmp_path / "holdout-step0.jsonl"
    p.write_text(text)
    with pytest.raises(EvalRowsError, match=re.escape(what)) as e:
        read_eval_rows(str(p))
    msg = str(e.value)
    assert msg.startswith(str(p)) and what in msg and "fix: delete it" in msg and "\n" not in msg


# ----------------------------------------------------------------------------- the driver


class _Tok:
    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        return "".join(m["content"] for m in messages)

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}


class _Engine:
    """Answers each prompt with ``answer(question)``; the question is the decoded prompt."""

    def __init__(self, answer):
        self.answer = answer

    def generate(self, prompt_ids, *, max_new_tokens, temperature, top_p=1.0, greedy=False, generator_seed=None,
                 return_logprobs=True):
        texts = [self.answer("".join(chr(int(i)) for i in p)) for p in prompt_ids]
        return RolloutOutput([p.clone() for p in prompt_ids], [torch.arange(2) for _ in texts],
                             [torch.zeros(2) for _ in texts], texts, torch.ones(len(texts), dtype=torch.bool))


def _driver(log_dir, holdout, eval_sets=None):
    from megatron_cegrpo.training.driver import Driver

    d = Driver.__new__(Driver)  # the evaluation part only: no model, no sampler
    d.cfg = SimpleNamespace(data=SimpleNamespace(eval_max_new_tokens=8, eval_batch_size=4, prompt_template="plain"),
                            optim=SimpleNamespace(seed=1), logging=SimpleNamespace(log_dir=str(log_dir), tqdm=False))
    d.holdout_records, d.tokenizer = holdout, _Tok()
    d.eval_sets = eval_sets
    d.eval_modes = {n: EvalMode() for n in eval_sets} if eval_sets else None
    return d


def test_the_driver_keeps_every_evaluations_rows(tmp_path, capsys):
    """Before and after training: two files of the same rows, their accuracies those of the
    metrics the trainer logs; the suite's data sets likewise."""
    holdout = load_train_split("mawps/singleop", num_holdout=6, seed=1234).holdout
    truth = {r.question: r.ground_truth for r in holdout}
    first = {r.question for r in holdout[:2]}
    d = _driver(tmp_path, holdout, {"mawps/multiarith": load_dataset("mawps/multiarith", limit=3)})
    d.rollout = _Engine(lambda p: f"The answer is {truth[next(q for q in truth if p.startswith(q))]}."
                        if any(p.startswith(q) for q in first) else "no idea")
    before = d.evaluate_holdout(0)
    suite = d.evaluate_suite(0)
    d.rollout = _Engine(lambda p: f"The answer is {truth[next(q for q in truth if p.startswith(q))]}."
                        if any(p.startswith(q) for q in truth) and not p.startswith(holdout[0].question)
                        else "no idea")
    after = d.evaluate_holdout(5)
    files = find_eval_rows(str(tmp_path))
    assert sorted(files) == [("holdout", 0), ("holdout", 5), ("mawps/multiarith", 0)]
    b, a = read_eval_rows(files[("holdout", 0)]), read_eval_rows(files[("holdout", 5)])
    assert b.ids == a.ids == [r.row for r in holdout] and b.header["rows_digest"] == a.header["rows_digest"]
    assert b.scores == [1, 1, 0, 0, 0, 0] and a.scores == [0, 1, 1, 1, 1, 1]
    assert before["val/holdout/acc"] == b.acc == pytest.approx(2 / 6)
    assert after["val/holdout/acc"] == a.acc == pytest.approx(5 / 6)
    s = read_eval_rows(files[("mawps/multiarith", 0)])
    assert s.ids == [1, 2, 3] and suite["val/mawps/multiarith/acc"] == s.acc == 0.0
    assert "dense-view evaluation at iteration 0: mawps/multiarith 0.000" in capsys.readouterr().out


def test_a_rows_file_that_cannot_be_written_is_a_warning(tmp_path, capsys):
    holdout = load_train_split("mawps/singleop", num_holdout=2, seed=1234).holdout
    (tmp_path / "eval_rows").write_text("a file where the folder goes")
    d = _driver(tmp_path, holdout)
    d.rollout = _Engine(lambda p: "no idea")
    assert d.evaluate_holdout(0)["val/holdout/acc"] == 0.0  # the evaluation itself is returned
    out = capsys.readouterr().out
    assert "warning: the per-row scores of holdout at step 0 were not written" in out
