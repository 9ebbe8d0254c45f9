"""The tiny recorded run (tests/equivalence/equivalence_runs.py) gives the recorded metrics (bit for bit on
the machine that recorded them; within float32 rounding on another CPU)."""

import json

from equivalence_runs import differences, reference_path, run


def test_tiny_run_matches_the_recorded_metrics(tmp_path):
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
