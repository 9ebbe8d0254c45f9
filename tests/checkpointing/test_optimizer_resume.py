"""DeepSpeedCPUAdam resumed from its state dict at every step of a short run takes the straight
run's steps bit for bit (issue 35 item 5).

The mechanism a resume can break here is the optimizer's: its C++ side keeps beta^t as a float32
running product in a straight run and recomputed it with ``pow`` after a restart, 1 ulp apart at
t = 3 and t = 6 for beta2 = 0.999 (``optim/factory.replay_cpu_adam_bias_correction``). Every other
piece of trainer state is covered end to end by ``tests/e2e/test_resume.py``. A new optimizer in
this process has a new C++ object (its own ``opt_id``), as a resumed process does.
"""

import copy

import numpy as np
import pytest
import torch

from megatron_cegrpo.arguments import OptimConfig
from megatron_cegrpo.optim.factory import build_optimizer, replay_cpu_adam_bias_correction

STEPS = 8
SHAPES = [(37,), (8, 5), (1,)]


@pytest.fixture(scope="module", autouse=True)
def _cpu_info_once():
    """DeepSpeedCPUAdam's constructor asks py-cpuinfo for the CPU vendor, ~1.3 s a call here:
    ask once for the dozen optimizers of this file."""
    import cpuinfo

    real = cpuinfo.get_cpu_info
    info = real()
    cpuinfo.get_cpu_info = lambda: info
    yield
    cpuinfo.get_cpu_info = real


def _grads(step):
    gen = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(s, generator=gen) * (1.0 + step) for s in SHAPES]


def _step(params, opt, step):
    for p, g in zip(params, _grads(step)):
        p.grad = g
    opt.step()


def _bits(ts):
    return [t.detach().clone().view(torch.int32) for t in ts]


def _straight_run(cfg):
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]
    opt = build_optimizer(params, cfg)
    saved = {0: (_bits(params), copy.deepcopy(opt.state_dict()))}
    for k in range(1, STEPS + 1):
        _step(params, opt, k)
        saved[k] = (_bits(params), copy.deepcopy(opt.state_dict()))
    return saved


def _plain_cpu_adam(params, cfg):
    """build_optimizer's DeepSpeedCPUAdam without the replay on load (the code before the fix)."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    return DeepSpeedCPUAdam(params, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps,
                            weight_decay=cfg.weight_decay, adamw_mode=True)


def _resume(cfg, saved, k, build=build_optimizer):
    """Params and optimizer state of step k in a new optimizer, stepped to STEPS; the weights' bits
    after each step."""
    params = [torch.nn.Parameter(b.clone().view(torch.float32)) for b in saved[k][0]]
    opt = build(params, cfg)
    opt.load_state_dict(copy.deepcopy(saved[k][1]))
    out = {}
    for t in range(k + 1, STEPS + 1):
        _step(params, opt, t)
        out[t] = _bits(params)
    return out


def _mismatches(saved, resumed):
    return [t for t, bits in resumed.items() if not all(torch.equal(a, b) for a, b in zip(bits, saved[t][0]))]


CFG = OptimConfig(lr=1e-2, weight_decay=0.1)  # AdamW, betas 0.9 / 0.999 as ds_configs/cpu_adamw.json


@pytest.fixture(scope="module")
def saved():
    return _straight_run(CFG)


def test_resume_at_every_step_is_bit_exact(saved):
    assert not torch.equal(saved[STEPS][0][0], saved[0][0][0])  # the weights moved
    for k in range(1, STEPS):
        assert _mismatches(saved, _resume(CFG, saved, k)) == [], k


def test_without_the_replay_resumes_before_steps_3_and_6_diverge(saved):
    """The defect the replay removes: a fresh C++ optimizer's pow(beta2, t) is 1 ulp off the
    running product at t = 3 and 6, and a resume there leaves the straight run's trajectory."""
    b2 = np.float32(0.999)
    running = np.cumprod(np.full(STEPS, b2, dtype=np.float32), dtype=np.float32)
    pow_t = np.array([np.float32(np.float64(b2) ** t) for t in range(1, STEPS + 1)], dtype=np.float32)
    assert [t + 1 for t in np.flatnonzero(running != pow_t)] == [3, 6]
    diverged = {k: _mismatches(saved, _resume(CFG, saved, k, build=_plain_cpu_adam)) for k in range(1, STEPS)}
    assert diverged[2][:1] == [3] and diverged[5][:1] == [6]
    assert diverged[3] == []  # pow(beta, 4) is the running product: a resume before step 4 was exact


def test_replay_returns_the_step_and_leaves_the_state_alone(saved):
    params = [torch.nn.Parameter(b.clone().view(torch.float32)) for b in saved[5][0]]
    opt = build_optimizer(params, CFG)
    assert replay_cpu_adam_bias_correction(opt) == 0  # nothing stepped yet
    opt.load_state_dict(copy.deepcopy(saved[5][1]))
    state = copy.deepcopy(opt.state_dict())
    assert replay_cpu_adam_bias_correction(opt) == 5
    after = opt.state_dict()
    for i, st in state["state"].items():
        assert st["step"] == after["state"][i]["step"] == 5
        assert torch.equal(st["exp_avg"], after["state"][i]["exp_avg"])
        assert torch.equal(st["exp_avg_sq"], after["state"][i]["exp_avg_sq"])
    assert all(torch.equal(a, b) for a, b in zip(_bits(params), saved[5][0]))
