"""TP x PP x DP (issue 14): TP = 2 x PP = 2 x DP = 2 (8 ranks) trains like TP = 1 x PP = 2 x DP = 1.

``@slow`` (``make test-slow``; about 2 minutes, over the ~60 s a default-suite test may take under
load; the TP-only and DP-only paths have their fast e2e tests): one 8-rank launch of ``tp_train_worker.py`` (``dp 2``: real gloo processes, tiny-llama, no anchor):
2 iterations of 8 sequences (one optimizer step each; each replica runs 4 rows = 2 micro-batches of
2), KL to the reference, the drift probe at iteration 2, ``--tied-embedding-sync sparse``, for the
``mask`` codec (keep 0.25, a checkpoint at 2) and the ``dense`` codec. Compared with the committed
TP = 1 x PP = 2 x DP = 1 record (``reference/tp_train_tp1_pp2.json``, its ``dense`` part for the
dense run; re-record with ``PYTHONPATH=$PWD python tests/e2e/test_tensor_parallel_train.py --record``).
The record's mask run also ran the gradient-fidelity probe, refused at DP > 1; the probe never
changes a run (``training/fidelity.py``, bit for bit), so its ``fidelity/*`` keys alone are left out.

Rank order (megatron-core's ``tp-cp-ep-dp-pp``, TP fastest): rank r is TP rank ``r % 2``, replica
``(r // 2) % 2``, stage ``r // 4``; ranks 0-3 stage 0 (0, 1 replica 0), 4-7 stage 1.

Tolerance (fp32 reduction order, the two effects the TP-only and DP-only tests bound separately):
the row-parallel layers add T = 2 partial products, and each replica's gradient is a partial sum
added by the DP all-reduce instead of one running sum over the micro-batches. Losses, grad norms,
KL, entropy, mismatch and probe numbers within ``1e-5`` relative + ``1e-6`` absolute; weights after 2
Adam steps at lr 1e-3 within ``1e-5`` absolute at the recorded coordinates (1 % of one Adam step:
Adam divides by sqrt(v), so a relative gradient error is not damped) and ``||theta - theta_0||`` per
parameter within ``1e-5`` relative — the same bounds as the TP = 2 and DP = 2 tests. Measured: see
docs/parallelism.md ("TP x PP x DP"). The replicas of a stage hold bit-identical weights.

Bytes (docs/parallelism.md, "Metrics and the byte ledger"): boundary bytes summed over the TP ranks
and the replicas equal TP = 1 x DP = 1's exactly (each TP rank sends its half of a payload, each
replica its half of the micro-batches); the sampler sync and the checkpoint's full tied-embedding
sync are replica 0's, equal to TP = 1's; ``comm/embd_sync_dense_bytes`` is DP x TP = 1's (each
replica's pipeline exchanges); ``comm/dp_grad_allreduce_bytes`` is the sum over the 8 ranks of their
gradient buffers (a 2-member ring sends the whole buffer once); ``comm/batch_bytes`` counts the
driver's sends to TP rank 0 of the 3 other (stage, replica) positions (a stage's TP ranks share a host).
"""

import json
import os
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import test_tensor_parallel_train as tpt  # noqa: E402

TP, PP, DP = 2, 2, 2
FIDELITY = ("fidelity/",)
#: summed over TP ranks and replicas, equal to TP = 1 x DP = 1's
BOUNDARY_KEYS = ("comm/fwd_bytes", "comm/bwd_bytes", "comm/dense_equiv_bytes", "comm/bytes_ratio")
#: replica 0's (the driver's pipeline), equal to TP = 1 x DP = 1's
REPLICA0_KEYS = ("sync/bytes", "sync/dense_fp32_bytes", "actor/num_optimizer_steps", "actor/skipped_steps")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    d = tmp_path_factory.mktemp("tp2dp2")
    tpt.launch(d, TP, "dp", str(DP), dp=DP)
    return d


@pytest.fixture(scope="module")
def reference():
    with open(tpt.REFERENCE) as f:
        ref = json.load(f)
    if "dense" not in ref:
        pytest.fail(f"{tpt.REFERENCE} has no dense run; re-record it (test_tensor_parallel_train.py --record)")
    out = {"mask": ref, "dense": ref["dense"]}
    for r in out.values():
        r["metrics"] = {int(k): v for k, v in r["metrics"].items()}
    return out


def load_replicas(out_dir, run_name):
    """{dp_rank: [(whole params, whole theta_0) per stage]} and the 8 ranks' dumps."""
    from megatron_cegrpo.models.tp_shard import merge_tp_shards

    dumps = [torch.load(os.path.join(out_dir, run_name, f"rank{r}.pt")) for r in range(TP * PP * DP)]
    for r, d in enumerate(dumps):  # Megatron's order, TP fastest, then DP, then PP
        assert (d["tp_rank"], d["dp_rank"], d["pp_rank"]) == (r % TP, (r // TP) % DP, r // (TP * DP)), r
    out = {}
    for dp in range(DP):
        stages = []
        for pp in range(PP):
            shards = sorted((d for d in dumps if d["pp_rank"] == pp and d["dp_rank"] == dp), key=lambda d: d["tp_rank"])
            stages.append(tuple(merge_tp_shards([d[k] for d in shards]) for k in ("params", "theta0")))
        out[dp] = stages
    return out, dumps


def differences(metrics, ref_metrics, replicas, ref_weights):
    """The measured differences: {metric: (abs, rel)} over both steps, and the weights' max abs
    difference at the recorded coordinates and max relative ``||theta - theta_0||`` difference."""
    close = {}
    for step in tpt.STEPS:
        for k in tpt.CLOSE_KEYS:
            if k.startswith(FIDELITY) or k not in ref_metrics[step]:
                continue
            a, b = ref_metrics[step][k], metrics[step][k]
            d = abs(a - b)
            old = close.get(k, (0.0, 0.0))
            close[k] = (max(old[0], d), max(old[1], d / abs(a) if a else 0.0))
    w_abs = norm_rel = 0.0
    for key, ref in ref_weights.items():
        pp, name = key.split("/", 1)
        params, theta0 = replicas[0][int(pp)]
        flat = params[name].reshape(-1)
        got = torch.tensor([float(flat[i]) for i in ref["idx"]], dtype=torch.float64)
        w_abs = max(w_abs, float((got - torch.tensor(ref["val"], dtype=torch.float64)).abs().max()))
        norm = float((params[name].double() - theta0[name].double()).norm())
        norm_rel = max(norm_rel, abs(norm - ref["delta_norm"]) / max(ref["delta_norm"], 1e-30))
    return close, w_abs, norm_rel


@pytest.mark.slow
@pytest.mark.parametrize("codec", ["mask", "dense"])
def test_tp2_pp2_dp2_trains_like_the_recorded_tp1_dp1_run(run, reference, codec):
    m, ref = tpt.load_metrics(run, codec), reference[codec]
    m1 = ref["metrics"]
    assert sorted(m) == sorted(m1) == list(tpt.STEPS)
    for step in tpt.STEPS:
        for k in tpt.CLOSE_KEYS:
            if k.startswith(FIDELITY):
                assert k not in m[step], (step, k)  # refused at DP > 1
                continue
            assert (k in m1[step]) == (k in m[step]), (codec, step, k)
            if k in m1[step]:
                assert tpt._close(m1[step][k], m[step][k]), (codec, step, k, m1[step][k], m[step][k])
        for k in BOUNDARY_KEYS + REPLICA0_KEYS:
            assert m[step][k] == m1[step][k], (codec, step, k, m1[step][k], m[step][k])
        assert m[step]["comm/embd_sync_dense_bytes"] == DP * m1[step]["comm/embd_sync_dense_bytes"], (codec, step)
        # the driver's shares to the 3 other (stage, replica) positions, TP rank 0's: 3 half batches
        # (~1.5 x the one DP = 1 copy; counting every TP rank's 7 would be ~3.5 x)
        assert m1[step]["comm/batch_bytes"] < m[step]["comm/batch_bytes"] < 2 * m1[step]["comm/batch_bytes"]
    assert "probe/kl_to_ref" in m[2]
    replicas, _ = load_replicas(run, codec)
    close, w_abs, norm_rel = differences(m, m1, replicas, ref["weights"])
    print(f"\n{codec}: weights max abs diff {w_abs:.3g}, ||theta - theta_0|| max rel diff {norm_rel:.3g}; "
          + ", ".join(f"{k} {a:.2g}/{r:.2g}" for k, (a, r) in sorted(close.items())))
    assert w_abs <= tpt.W_ABS and norm_rel <= tpt.NORM_REL, (codec, w_abs, norm_rel)


@pytest.mark.slow
@pytest.mark.parametrize("codec", ["mask", "dense"])
def test_replicas_hold_bit_identical_weights(run, codec):
    _, dumps = load_replicas(run, codec)
    for r in range(0, len(dumps), TP * DP):  # stage-major blocks of TP x DP ranks
        for t in range(TP):
            a, b = dumps[r + t]["params"], dumps[r + TP + t]["params"]
            for n in a:
                if not (dumps[r]["pp_rank"] == 0 and n == tpt.CACHE):  # a row cache, per replica's tokens
                    assert torch.equal(a[n], b[n]), (codec, r, t, n)


@pytest.mark.slow
def test_dp_gradient_allreduce_bytes_are_every_ranks_gradient_buffer(run):
    m = tpt.load_metrics(run, "mask")
    _, dumps = load_replicas(run, "mask")
    reduced = sum(p.numel() * 4 for d in dumps for n, p in d["params"].items()
                  if not (d["pp_rank"] == 0 and n == tpt.CACHE))  # the cache has no gradient (sparse)
    for step in tpt.STEPS:
        assert m[step]["comm/dp_grad_allreduce_bytes"] == reduced, step


@pytest.mark.slow
def test_replica_0_writes_one_shard_per_tp_rank(run):
    from megatron_cegrpo import checkpointing as ck

    meta = ck.verify_checkpoint(os.path.join(run, "mask", "ckpt", "iter_0000002"))
    assert meta["tp_size"] == TP and ck.continues_run(meta)
    for pp in range(PP):
        names = ck.stage_file_names(meta, pp)
        assert sorted(n for n in names if n.startswith("model")) == ["model_tp00.safetensors", "model_tp01.safetensors"]


# ----------------------------------------------------------------------------- layout (no launch; default suite)

def _cfg(*extra):
    from megatron_cegrpo.arguments import build_config, parse_args

    return build_config(parse_args(["--model", "tiny-llama", "--pipeline-model-parallel-size", "2",
                                    "--tensor-model-parallel-size", "2", "--rollout-batch-size", "2",
                                    "--num-generations", "4", "--micro-batch-size", "2", "--anchor-ranks", "0",
                                    *extra]))


@pytest.mark.parametrize("world,dp", [(4, 1), (8, 2), (16, 4)])
def test_tp_x_pp_x_dp_layouts_validate(world, dp):
    cfg = _cfg().validate(world_size=world)
    assert cfg.data_parallel_size(world) == dp


@pytest.mark.parametrize("world,fit", [(2, 4), (6, 4), (10, 8)])
def test_a_world_that_is_not_tp_x_pp_x_dp_stops_with_one_line(world, fit):
    from megatron_cegrpo.errors import ConfigError

    with pytest.raises(ConfigError, match=rf"^world size {world} minus --anchor-ranks \(0\) leaves") as e:
        _cfg().validate(world_size=world)
    msg = str(e.value)
    assert "\n" not in msg and msg == (
        f"world size {world} minus --anchor-ranks (0) leaves {world} trainer ranks, not a multiple of "
        "--tensor-model-parallel-size (2) x --pipeline-model-parallel-size (2) (world = TP ranks x stages x "
        f"data-parallel replicas + anchor ranks); fix: launch with `deepspeed --num_gpus {fit}` "
        f"(or `torchrun --nproc-per-node {fit}`)"), msg


def test_dp_needs_whole_micro_batches_per_replica_at_tp2():
    from megatron_cegrpo.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^--global-batch-size=8 is not a multiple of data-parallel size \(2"):
        _cfg("--micro-batch-size", "8").validate(world_size=8)


def test_rank_layout_and_roles_are_megatrons_tp_dp_pp():
    from megatron_cegrpo.initialize import DistContext
    from megatron_cegrpo.layout import Layout
    from megatron_cegrpo.supervisor import rank_role

    layout = Layout(8, pp=2, tp=2, anchor_ranks=0)
    ctx = DistContext(rank=0, world_size=8, local_rank=0, local_world_size=8, pp_rank=0, pp_size=2, pp_group=None,
                      embd_group=None, pg_collection=None, device=torch.device("cpu"), tp_size=2, dp_size=2,
                      layout=layout)
    assert [ctx.replica_of(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert ([layout.tp_rank(r) for r in range(8)], [layout.pp_rank(r) for r in range(8)]) == (
        [0, 1, 0, 1, 0, 1, 0, 1], [0, 0, 0, 0, 1, 1, 1, 1])
    assert layout.stage_ranks == [0, 4] and layout.dp == 2 and layout.per_stage == 4
    # with the anchor: the last rank, after TP 1 x DP 2 x PP 2 trainer ranks
    with_anchor = Layout(5, pp=2, tp=1, anchor_ranks=1)
    assert [with_anchor.role(r) for r in range(5)] == [
        "pipeline stage 0 (data-parallel replica 0)", "pipeline stage 0 (data-parallel replica 1)",
        "pipeline stage 1 (data-parallel replica 0)", "pipeline stage 1 (data-parallel replica 1)", "anchor"]
    assert with_anchor.stage_ranks == [0, 2] and with_anchor.fitting_world() == 5
    assert Layout(4, pp=2, tp=1, anchor_ranks=1).dp == 0  # 3 trainer ranks do not fit PP 2
    argv = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--anchor-ranks", "0"]
    assert rank_role(argv, 6, 8) == "pipeline stage 1 (data-parallel replica 1, TP rank 0)"
    assert rank_role(argv, 3, 4) == "pipeline stage 1 (TP rank 1)"
    assert rank_role(["--pipeline-model-parallel-size", "2"], 3, 5) == "pipeline stage 1 (data-parallel replica 1)"
