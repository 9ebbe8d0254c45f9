"""--train-data resolved, loaded, split and length-filtered, each mistake a one-line ConfigError."""

import json
import os

import pytest

from megatron_cegrpo.data import (
    DatasetError,
    PromptRecord,
    check_eval_data,
    check_train_data,
    default_data_root,
    load_train_split,
    resolve_train_data,
    select_prompts,
)
from megatron_cegrpo.errors import ConfigError

needs_data = pytest.mark.skipif(not os.path.isdir(default_data_root()),
                                reason=f"data folder {default_data_root()} not found (set $CEGRPO_DATA_ROOT)")


def _mawps(tmp_path, n, name="rows.jsonl"):
    p = tmp_path / name
    p.write_text("".join(json.dumps({"input": f"What is {i} plus {i}?", "target": 2.0 * i}) + "\n"
                         for i in range(n)))
    return p


def test_a_missing_file_is_named_not_called_an_unknown_data_set(tmp_path):
    missing = tmp_path / "typo.jsonl"
    with pytest.raises(ConfigError, match=r"^--train-data .*typo\.jsonl: no such file") as e:
        resolve_train_data(str(missing))
    assert str(e.value).startswith(f"--train-data {missing}: no such file ({missing}); fix: check the path")
    with pytest.raises(ConfigError, match=r"'mawps/singelop' is neither an existing file nor a known data set "
                                          r"name; fix: pass a \.jsonl path or one of aime24, amc23"):
        resolve_train_data("mawps/singelop")
    with pytest.raises(ConfigError, match=r"is a directory, not a \.jsonl file"):
        resolve_train_data(str(tmp_path))
    with pytest.raises(ConfigError, match=r"the data set file .*/mawps/singleop.jsonl does not exist; the data "
                                          r"root is .*empty \(--data-root"):
        resolve_train_data("mawps/singleop", data_root=str(tmp_path / "empty"))


def test_holdout_must_leave_a_training_prompt(tmp_path):
    p = _mawps(tmp_path, 5)
    split = load_train_split(str(p), num_holdout=4, seed=1)
    assert (len(split.train), len(split.holdout)) == (1, 4)
    assert split.path == str(p)
    for n in (5, 9):
        with pytest.raises(ConfigError, match=f"^--num-holdout {n} leaves no training prompt") as e:
            load_train_split(str(p), num_holdout=n, seed=1)
        assert str(e.value) == (f"--num-holdout {n} leaves no training prompt: {p} has 5 rows; "
                                "fix: pass --num-holdout 4 or less")


def test_training_rows_repeating_a_held_out_question_are_dropped(tmp_path):
    p = tmp_path / "dups.jsonl"
    qs = ["What is 1 plus 1?", "What is 2 plus 2?", "what  is 1 plus 1?", "What is 3 plus 3?", "What is 2 plus 2? "]
    p.write_text("".join(json.dumps({"input": q, "target": 1.0}) + "\n" for q in qs))
    # random.Random(3).sample(range(5), 1) == [1]: row 2 (1-based) is held out, and row 5 repeats it
    split = load_train_split(str(p), num_holdout=1, seed=3)
    assert [r.row for r in split.holdout] == [2]
    assert [r.row for r in split.train] == [1, 3, 4] and split.duplicates_dropped == 1
    # rows 1 and 3 are one question too (case and spacing): holding out row 3 drops row 1
    split = load_train_split(str(p), num_holdout=2, seed=9)
    assert [r.row for r in split.holdout] == [3, 4]
    assert [r.row for r in split.train] == [2, 5] and split.duplicates_dropped == 1
    p.write_text("".join(json.dumps({"input": "Same?", "target": 1.0}) + "\n" for _ in range(3)))
    with pytest.raises(ConfigError, match="every training row of .* repeats a held-out question"):
        load_train_split(str(p), num_holdout=1, seed=0)


def test_bad_rows_are_config_errors(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"input": "q", "target": 1}\n{"input": "q2"\n')
    with pytest.raises(DatasetError, match=r"line 2: field '<line>' is not valid JSON") as e:
        load_train_split(str(p))
    assert isinstance(e.value, ConfigError)
    assert f"{p}, line 2: field '<line>' is not valid JSON" in str(e.value)


def test_select_prompts_keeps_what_fits_and_names_the_shortest(tmp_path):
    split = load_train_split(str(_mawps(tmp_path, 4)))
    def encode(q):
        return list(range(len(q)))  # one "token" per character
    lengths = [len(r.question) for r in split.train]
    kept, ids, too_long = select_prompts(split.train, encode, max(lengths))
    assert len(kept) == 4 and too_long == 0 and [len(x) for x in ids] == lengths
    kept, _, _ = select_prompts(split.train, encode, max(lengths), stop_after=1)
    assert len(kept) == 1
    with pytest.raises(ConfigError, match="longer than --max-prompt-length=3 tokens") as e:
        select_prompts(split.train, encode, 3, source="--train-data rows.jsonl")
    assert str(e.value) == ("--train-data rows.jsonl: every one of the 4 training prompts is longer than "
                            f"--max-prompt-length=3 tokens (the shortest has {min(lengths)}); "
                            f"fix: pass --max-prompt-length {min(lengths)} or more")
    # prompts of other lengths (the file's four are equally long): the too-long are counted, and the
    # error names the shortest, not the first or the longest
    recs = [PromptRecord(q, "1", "numeric", "t", i + 1) for i, q in enumerate(["aaaa", "aa", "aaa"])]
    kept, ids, too_long = select_prompts(recs, list, 3)
    assert [r.row for r in kept] == [2, 3] and too_long == 1 and [len(x) for x in ids] == [2, 3]
    with pytest.raises(ConfigError, match=r"\(the shortest has 2\); fix: pass --max-prompt-length 2 or more"):
        select_prompts(recs, list, 1)


@needs_data
def test_check_train_and_eval_data_on_the_real_files(tmp_path):
    split = check_train_data("mawps/singleop", num_holdout=48, seed=1234, encode=lambda q: q.split(),
                             max_prompt_length=200)
    assert len(split.train) + len(split.holdout) + split.duplicates_dropped == 562 and len(split.holdout) == 48
    check_eval_data(["mawps", "gsm8k/test"])
    with pytest.raises(ConfigError, match=r"--eval-datasets: the file of 'amc23' \(.*amc23/test.jsonl\) does not "
                                          r"exist; .*fix: point --data-root"):
        check_eval_data(["amc23"], data_root=str(tmp_path))
