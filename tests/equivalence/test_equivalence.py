"""The tiny recorded run (tests/equivalence/equivalence_runs.py) gives the recorded metrics (bit for bit on
the machine that recorded them; within float32 rounding on another CPU)."""

import json

import pytest
from equivalence_runs import compare_with_record, differences, environment_differences, run


def skip_unless_recorded_here(name: str) -> None:
    """Skip, saying what differs, when ``name`` was recorded with another CPU capability or other
    package versions (equivalence_runs.ENVIRONMENT_KEYS): its sampled tokens need not be this host's."""
    diff = environment_differences(name)
    if diff:
        pytest.skip(f"the {name} record was made elsewhere ({'; '.join(diff)}); re-record it on this host: "
                    f"python tests/equivalence/equivalence_runs.py record {name}")


def test_tiny_run_matches_the_recorded_metrics(tmp_path):
    skip_unless_recorded_here("tiny")
    got = run("tiny", str(tmp_path))
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5]
    diff, notes = compare_with_record("tiny", got)
    for line in notes:  # a record of the batch's former wire format: everything but its bytes compared
        print(f"note: {line}")
    assert diff == []


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


def test_a_record_of_the_former_batch_wire_compares_everything_but_the_batch_bytes(tmp_path, monkeypatch):
    """A record made when the batch went as torch's pickle (no ``batch_wire`` in its environment)
    compares without ``comm/batch_bytes``: the ledger's totals less the batch still compare
    exactly, so a changed boundary byte shows; a record of this wire format compares the bytes."""
    import equivalence_runs as er
    from megatron_cegrpo.training.ledger import RunLedger

    monkeypatch.setattr(er, "HERE", str(tmp_path))
    (tmp_path / "reference").mkdir()

    def recs(batch_bytes, fwd=1000):
        ledger, out = RunLedger(), []
        for step, b in enumerate(batch_bytes, 1):
            m = {"step": step, "comm/fwd_bytes": fwd, "comm/bwd_bytes": 500, "comm/dense_equiv_bytes": 30000,
                 "comm/batch_bytes": b, "batch/response_tokens": 40, "actor/pg_loss": 0.25 * step}
            out.append({**m, **ledger.step(m)})
        return out

    old, new = recs([24431, 24432]), recs([23900, 23901])  # torch's pickle vs tensor-bytes/1
    (tmp_path / "reference" / "x.jsonl").write_text("".join(json.dumps(r) + "\n" for r in old))
    env = er.environment()
    (tmp_path / "reference" / "x.env.json").write_text(json.dumps(env))
    diff, notes = er.compare_with_record("x", new)
    assert diff == [] and len(notes) == 1 and "torch-pickle" in notes[0] and er.BATCH_WIRE in notes[0]
    assert er.without_batch_bytes(old)[1]["comm/run_total_bytes"] == 2 * 1500
    assert "comm/total_ratio" not in er.without_batch_bytes(old)[0]
    diff, _ = er.compare_with_record("x", recs([23900, 23901], fwd=1001))
    assert "step 1: comm/fwd_bytes: expected 1000, got 1001" in diff and any("comm/total_bytes" in d for d in diff)
    (tmp_path / "reference" / "x.env.json").write_text(json.dumps(dict(env, batch_wire=er.BATCH_WIRE)))
    diff, notes = er.compare_with_record("x", new)
    assert notes == [] and "step 1: comm/batch_bytes: expected 24431, got 23900" in diff
