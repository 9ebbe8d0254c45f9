"""The tiny recorded run (tests/equivalence/equivalence_runs.py) gives the recorded metrics (bit for bit on
the machine that recorded them; within float32 rounding on another CPU)."""

import json

import pytest
from equivalence_runs import differences, environment_differences, reference_path, run


def skip_unless_recorded_here(name: str) -> None:
    """Skip, saying what differs, when ``name`` was recorded with another CPU capability or other
    package versions (equivalence_runs.ENVIRONMENT_KEYS): its sampled tokens need not be this host's."""
    diff = environment_differences(name)
    if diff:
        pytest.skip(f"the {name} record was made elsewhere ({'; '.join(diff)}); re-record it on this host: "
                    f"python tests/equivalence/equivalence_runs.py record {name}")


def test_tiny_run_matches_the_recorded_metrics(tmp_path):
    skip_unless_recorded_here("tiny")
    with open(reference_path("tiny")) as f:
        expected = [json.loads(x) for x in f if x.strip()]
    got = run("tiny", str(tmp_path))
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5]
    assert differences(expected, got) == []


def test_differences_tolerates_cpu_rounding_but_not_behaviour():
    # CI's CPU gave these against the reference recorded here (float32 reductions in another order)
    ref = {"step": 2, "actor/kl_loss": 4.63537871837616e-05, "anchor/sign_agreement": 0.45765963518896335,
           "mismatch/logprob_diff_mean": 0.001222630380652845, "actor/grad_norm": 0.7101517351251679}
    ci = {"step": 2, "actor/kl_loss": 4.635502894719442e-05, "anchor/sign_agreement": 0.4576590279801807,
          "mismatch/logprob_diff_mean": 0.0012225707760080695, "actor/grad_norm": 0.7101516512562474}
    assert differences([ref], [ci]) == []
    assert differences([ref], [dict(ci, **{"actor/grad_norm": 0.7102})]) == [
        "step 2: actor/grad_norm: expected 0.7101517351251679, got 0.7102"]
    assert len(differences([ref], [dict(ci, step=3)])) == 1  # ints compare exactly
    assert differences([ref], [{k: v for k, v in ci.items() if k != "actor/kl_loss"}]) == [
        "step 2: actor/kl_loss: expected 4.63537871837616e-05, got '<absent>'"]


def test_environment_differences_name_what_the_recording_host_had(tmp_path, monkeypatch):
    import equivalence_runs as er

    monkeypatch.setattr(er, "HERE", str(tmp_path))
    (tmp_path / "reference").mkdir()
    assert er.environment_differences("x") == []  # a record without its environment compares
    here = er.environment()
    with open(er.environment_path("x"), "w") as f:
        json.dump(dict(here, cpu="another CPU's name"), f)  # the CPU's name is for the reader only
    assert er.environment_differences("x") == []
    other = "AVX2" if here["cpu_capability"] != "AVX2" else "AVX512"
    with open(er.environment_path("x"), "w") as f:
        json.dump(dict(here, cpu_capability=other, tokenizers="0.0.1"), f)
    assert er.environment_differences("x") == [f"cpu_capability: recorded {other}, here {here['cpu_capability']}",
                                               f"tokenizers: recorded 0.0.1, here {here['tokenizers']}"]


def test_each_kind_of_host_compares_against_its_own_record(tmp_path, monkeypatch):
    """A run may keep one record per kind of host (reference/<name>.<kind>.jsonl): the one whose
    environment matches this host's is compared; with none matching, the first, whose differences
    then make the test skip."""
    import equivalence_runs as er

    monkeypatch.setattr(er, "HERE", str(tmp_path))
    ref = tmp_path / "reference"
    ref.mkdir()
    here = er.environment()
    other = "AVX512" if here["cpu_capability"] == "AVX2" else "AVX2"  # a capability this host lacks
    for stem, env in (("x", dict(here, amx=not here["amx"])), ("x.other", dict(here, cpu_capability=other)),
                      ("x.mine", here)):
        (ref / f"{stem}.jsonl").write_text("{}\n")
        (ref / f"{stem}.env.json").write_text(json.dumps(env))
    assert er.reference_path("x") == str(ref / "x.mine.jsonl") and er.environment_differences("x") == []
    (ref / "x.mine.jsonl").unlink()
    assert er.reference_path("x") == str(ref / "x.jsonl")
    assert er.environment_differences("x") == [f"amx: recorded {not here['amx']}, here {here['amx']}"]
    assert er.host_kind() == here["cpu_capability"].lower() + ("-amx" if here["amx"] else "")
