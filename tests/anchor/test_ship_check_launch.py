"""``--anchor-ship-check`` in a launch (issue 30): ``anchor/ship_sign_agreement`` on every fire.

Tiny model, PP = 2 + 1 anchor rank, int4 shipments, c = K = 2 over 6 iterations (fires 2, 4, 6),
a checkpoint every 2 iterations. The straight run measures every fire: exactly 1 at fire 2 (it
replays theta(0), which both rings hold bit for bit: the start-up digests agreed), a fraction at
fires 4 and 6 (secant forecasts over int4-coded against exact weights). A run resumed at 2 has no
exact theta(0) (the exact copies are a measurement, not checkpointed), so fire 4 reports NaN
rather than a forecast over other checkpoints, and fire 6 reports the straight run's value.
"""

import math

from distributed_util import PARITY_REWARD, launch_train, tiny_args

ARGS = tiny_args(temperature=None, kl_coef=0, train_iters=6, boundary_codec="mask", anchor_ranks=1, anchor_interval=2,
                 anchor_delay=2, anchor_ship_check=True, save_interval=2)


def _tiny_numel():
    from megatron_cegrpo.models.hf_config import resolve_model
    from megatron_cegrpo.models.loader import load_hf_state_dict

    _, sd = load_hf_state_dict(resolve_model("tiny-llama"))
    return sum(v.numel() for v in sd.values())


def test_ship_sign_agreement_on_every_fire_and_after_a_resume(tmp_path):
    (tmp_path / "reward.py").write_text(PARITY_REWARD)
    args = ARGS + ["--custom-reward-function", f"{tmp_path / 'reward.py'}:parity_reward"]
    straight = launch_train(args + ["--save", str(tmp_path / "a" / "ckpt")], tmp_path / "a", ranks=3)
    agree = {t: m["anchor/ship_sign_agreement"] for t, m in straight.items() if m.get("anchor/fire")}
    assert sorted(agree) == [2, 4, 6]
    assert agree[2] == 1.0
    for t in (4, 6):  # measured 0.99949 and 0.99959 (2026-12-06): a forecast over int4-coded weights is
        # not the one over exact weights; 1.0 would mean the check compared the shipment with itself
        assert 0.5 < agree[t] < 1.0, (t, agree[t])
    # the exact copies ride beside each shipment, metered apart from the ledger
    fp32 = straight[1]["anchor/bytes_ship_fp32"]  # theta(0), theta(2), theta(4) at 1, 3, 5
    assert fp32 == 4 * _tiny_numel()  # every parameter once in fp32 (the tied W once)
    for t, m in straight.items():
        assert m["anchor/bytes_ship_check"] == m["anchor/bytes_ship_fp32"] == (fp32 if t % 2 else 0), t
    assert [straight[t]["anchor/ship_rejected"] for t in (2, 4, 6)] == [0, 0, 0]

    resumed = launch_train(args + ["--load", str(tmp_path / "a" / "ckpt" / "iter_0000002"),
                                   "--save", str(tmp_path / "b" / "ckpt")], tmp_path / "b", ranks=3)
    assert sorted(resumed) == [3, 4, 5, 6]
    assert math.isnan(float(resumed[4]["anchor/ship_sign_agreement"]))  # metrics.jsonl spells it "nan"
    assert resumed[6]["anchor/ship_sign_agreement"] == agree[6]
    assert resumed[4]["anchor/sign_agreement"] == straight[4]["anchor/sign_agreement"]
