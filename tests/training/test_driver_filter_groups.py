"""The driver's generation loop with ``--filter-groups`` on a fake sampler and reward: which
prompts the batch holds, the rounds' seeds, the sampler's continuation, the bound and the
unfiltered path (``Driver.generate_and_score``; no model is loaded)."""

from types import SimpleNamespace

import torch

from megatron_cegrpo.arguments import build_config, parse_args
from megatron_cegrpo.data import PromptSampler
from megatron_cegrpo.grpo.dynamic_sampling import round_seed
from megatron_cegrpo.metrics import PhaseTimers
from megatron_cegrpo.rollout.base import RolloutOutput

from driver_double import bare_driver

B, G, N = 2, 4, 10


class FakeEngine:
    """Response j of each group of G is the text str(j); the prompt's id is its token."""

    pad_token_id = 0

    def __init__(self):
        self.seeds = []

    def generate(self, prompts, *, max_new_tokens, temperature, top_p, generator_seed):
        self.seeds.append(generator_seed)
        n = len(prompts)
        return RolloutOutput(list(prompts), [torch.tensor([7, 8]) for _ in range(n)],
                             [torch.zeros(2) for _ in range(n)], [str(i % G) for i in range(n)],
                             torch.ones(n, dtype=torch.bool))


def _driver(mixed, *flags):
    """A Driver on N prompts (id i + 1); prompt i has mixed scores when ``mixed(i)``, else all 0."""
    cfg = build_config(parse_args(["--rollout-batch-size", str(B), "--num-generations", str(G), "--seed", "3",
                                   *flags])).validate()
    records = [SimpleNamespace(question=f"q{i}", ground_truth="mixed" if mixed(i) else "tied", verifier="fake")
               for i in range(N)]
    return bare_driver(cfg, FakeEngine(), records, lambda response, gt: float(gt == "mixed" and response == "0"))


def _order(n_batches):
    s = PromptSampler(N, B, 3)
    return [s.next_batch() for _ in range(n_batches)]


def _prompts_of(batch):
    return batch["tokens"][::G, 0].sub(1).tolist()


def test_filter_keeps_the_first_mixed_groups_and_the_sampler_continues():
    order = _order(8)
    flat = [i for b in order for i in b]
    mixed = set(flat[3:6])  # draw order: tied, tied, tied, mixed, mixed, mixed, ...
    d = _driver(lambda i: i in mixed, "--filter-groups", "--max-num-gen-batches", "4")
    batch = d.generate_and_score(5, PhaseTimers())
    assert _prompts_of(batch) == flat[3:5]  # rounds 0 (tied, tied) and 1 (tied, mixed), 2 (mixed, mixed)
    assert batch["tokens"].shape[0] == B * G
    assert d.rollout.seeds == [round_seed(3, 5, r) for r in range(3)]
    assert d.rollout_metrics() == {"batch/num_gen_batches": 3, "batch/kept_groups": 2,
                                   "batch/tied_groups_dropped": 3, "batch/filled_with_tied": 0,
                                   "batch/mixed_groups_unused": 1}
    assert (batch["advantages"].abs().sum(1) > 0).all()  # every sequence of the batch teaches something
    assert d.sampler.state_dict()["position"] == 6  # the next iteration continues after the 3 rounds
    d.generate_and_score(6, PhaseTimers())
    assert d.rollout.seeds[3] == round_seed(3, 6, 0)


def test_bound_fills_with_the_newest_tied_groups():
    order = _order(3)
    d = _driver(lambda i: False, "--filter-groups", "--max-num-gen-batches", "3")
    batch = d.generate_and_score(1, PhaseTimers())
    assert _prompts_of(batch) == order[2]  # the last round's groups
    m = d.rollout_metrics()
    assert (m["batch/num_gen_batches"], m["batch/kept_groups"], m["batch/filled_with_tied"],
            m["batch/tied_groups_dropped"]) == (3, 0, 2, 4)
    assert (batch["advantages"] == 0).all()


def test_without_the_flag_one_round_and_no_metrics():
    order = _order(1)
    d = _driver(lambda i: False)
    batch = d.generate_and_score(2, PhaseTimers())
    assert _prompts_of(batch) == order[0]
    assert d.rollout.seeds == [3 * 1_000_003 + 2] and d.rollout_metrics() == {}


def test_gen_batch_size_draws_larger_rounds():
    """``--gen-batch-size 4`` (2 B): rounds of 4 prompts; the first two mixed groups in draw order
    make the batch, the surplus mixed group and the tied ones are dropped, the sampler continues
    after the 2 rounds' 8 prompts."""
    flat = [i for b in _order(8) for i in b]
    mixed = set(flat[3:6])  # round 0: tied, tied, tied, mixed; round 1: mixed, mixed, tied, tied
    d = _driver(lambda i: i in mixed, "--filter-groups", "--max-num-gen-batches", "4", "--gen-batch-size", "4")
    sizes = []
    generate = d.rollout.generate
    d.rollout.generate = lambda prompts, **kw: sizes.append(len(prompts)) or generate(prompts, **kw)
    batch = d.generate_and_score(5, PhaseTimers())
    assert sizes == [4 * G, 4 * G]
    assert _prompts_of(batch) == flat[3:5] and batch["tokens"].shape[0] == B * G
    assert d.rollout.seeds == [round_seed(3, 5, 0), round_seed(3, 5, 1)]
    assert d.rollout_metrics() == {"batch/num_gen_batches": 2, "batch/kept_groups": 2,
                                   "batch/tied_groups_dropped": 5, "batch/filled_with_tied": 0,
                                   "batch/mixed_groups_unused": 1}
    assert d.sampler.state_dict()["position"] == 8
