"""Model FLOPs of the update pass (training/perf.py) against torch's own FLOP counter."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from megatron_cegrpo.training.perf import matmul_params, perf_metrics, update_pass_flops


@pytest.mark.parametrize("pp_rank", [0, 1])
def test_update_flops_match_torch_flop_counter(megatron_single_process, pp_rank):
    from megatron_cegrpo.models import build_stage, hf_to_megatron, load_hf_state_dict, load_stage_weights
    from megatron_cegrpo.models import resolve_model, stage_layer_range, transformer_config_from_hf

    hf_config, sd = load_hf_state_dict(resolve_model("tiny-llama"))
    tf = transformer_config_from_hf(hf_config, pipeline_model_parallel_size=2)
    model = build_stage(hf_config, tf, pp_rank=pp_rank, pp_size=2)
    load_stage_weights(model, hf_to_megatron(sd, hf_config, tf, pp_rank, 2))
    lo, hi = stage_layer_range(tf, pp_rank, 2)
    n, s, d = 3, 10, tf.hidden_size
    tokens = torch.randint(0, hf_config.vocab_size, (n, s))
    pos = torch.arange(s).expand(n, s)
    with FlopCounterMode(display=False) as counter:
        if pp_rank == 0:
            out = model(input_ids=tokens, position_ids=pos, attention_mask=None)
        else:
            x = torch.randn(s, n, d, requires_grad=True)
            model.set_input_tensor(x)
            out = model(input_ids=None, position_ids=pos, attention_mask=None)
        out.float().square().mean().backward()
    counted = counter.get_total_flops()
    ours = update_pass_flops(model, tf, hi - lo, n, s)
    assert counted == ours  # every matmul and bmm of forward and backward, exactly
    embedding = hf_config.vocab_size * d
    dense = sum(p.numel() for p in model.parameters() if p.dim() == 2)
    assert matmul_params(model) == (dense - embedding if pp_rank == 0 else dense)


def test_perf_metrics_arithmetic():
    m = {"perf/update_flops": 6e12, "timing_s/update": 3.0}
    assert perf_metrics(m, None) == {"perf/flops/actor": 2.0}
    assert perf_metrics(m, 4.0) == {"perf/flops/actor": 2.0, "perf/mfu/actor": 0.5}
    assert perf_metrics({"timing_s/update": 3.0}, 4.0) == {}
