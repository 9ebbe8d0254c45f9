"""The GRPO trainer at tensor-parallel size 2 (issue 14): TP = 2 x PP = 2 trains like TP = 1 x PP = 2.

One launch in the default suite: ``tp_train_worker.py`` at TP = 2 x PP = 2 (4 real gloo ranks,
tiny-llama: tied vocabulary-parallel embedding, 4 heads, 2 KV heads), 2 iterations of 8 sequences
(one optimizer step each), the mask codec at keep 0.25, KL to the reference, the drift probe and
the gradient-fidelity probe at iteration 2, the sparse tied-embedding exchange, a checkpoint at 2.
It is compared with a committed record of the same run at TP = 1 x PP = 2
(``reference/tp_train_tp1_pp2.json``; re-record it with
``PYTHONPATH=$PWD python tests/e2e/test_tensor_parallel_train.py --record``, which launches the
TP = 1 run: 2 ranks).

Tolerance (fp32 reduction order: the row-parallel layers add two partial products, the TP ranks'
norm terms are summed in another order): losses, grad norms, KL, entropy, mismatch and the probes'
numbers within ``1e-5`` relative + ``1e-6`` absolute; weights after 2 Adam steps at lr 1e-3 within
``1e-5`` absolute (1 % of one Adam step) at the recorded coordinates (per parameter the 32 that
moved most and 32 evenly spaced), and each parameter's ``||theta - theta_0||`` within ``1e-5``
relative. Measured (2026-12-02, this machine): see docs/parallelism.md ("The trainer at TP > 1").

Bytes: the boundary, sampler-sync and batch bytes equal TP = 1's exactly (each TP rank sends its
half of every payload; TP rank 0 sends the whole gathered stage to the sampler; one batch copy per
other stage); the tied-embedding exchange sends the TP = 1 rows split over the TP ranks plus one
8-byte norm term per optimizer step and one 16-byte weight term per iteration per extra TP rank.

``@slow``: a resume at TP = 2 (checkpoint at 1, a new trainer trains iteration 2) is bit-exact.
"""

import json
import math
import os
import re
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # distributed_util (pytest's rootdir conftest does the same)

from distributed_util import PARITY_REWARD, plan_of, run_ranks  # noqa: E402
from megatron_cegrpo.training.perf import without_wall_clock  # noqa: E402

WORKER = os.path.join(HERE, "tp_train_worker.py")
REFERENCE = os.path.join(HERE, "reference", "tp_train_tp1_pp2.json")
#: the stateful codecs' TP = 1 x PP = 2 record (re-record: ... --record-stateful)
STATEFUL_REFERENCE = os.path.join(HERE, "reference", "tp_stateful_tp1_pp2.json")
STATEFUL = ("lowrank", "rpq:lrq")
#: rpq:lrq at TP = 2 is not TP = 1 within fp32 reduction order (measured 2026-12-05 against the record,
#: 3 iterations of the tiny run): it rounds its coefficients deterministically, so the TP ranks' other
#: reduction order moves a few of them by one quantisation step. Measured: grad norm 8.3e-5 / 3.4e-4
#: relative at steps 1 / 2, KL 9e-4, fidelity cos 1.5e-3, the signed sampler mismatch mean 4.8e-5
#: absolute (6.9e-3 against 7.0e-3 nats), weights 1.9e-4 absolute at the recorded
#: coordinates (Adam moves a coordinate whose gradient sign flipped by ~lr), ||theta - theta_0|| 1.3e-3
#: relative; ``codec/error_persistence`` (the correlation of successive codec errors) 0.074 against
#: 0.092, so it is not compared. Its backward payloads are zero-padded to whole TP pieces (one element
#: for an odd-sized payload, ``tp_payload_piece``): +16 B of 36 816 at step 1, 4 B per such message.
#: ``lowrank`` keeps the mask run's tolerances (its weights within 1.2e-7).
QUANTISED = {"rpq:lrq": dict(rel=2e-3, abs=1e-4, w_abs=5e-4, norm_rel=5e-3, skip=("codec/error_persistence",),
                             padded=("comm/bwd_bytes", "comm/bytes_ratio"))}
#: the boundary byte counters of a stateful codec (the lowrank basis is part of comm/fwd_bytes)
STATEFUL_EQUAL_KEYS = ("comm/fwd_bytes", "comm/bwd_bytes", "comm/basis_bytes", "comm/dense_equiv_bytes",
                       "comm/bytes_ratio", "comm/batch_bytes", "sync/bytes", "actor/num_optimizer_steps")
CACHE = "embedding.word_embeddings.weight"  # the first stage's row cache of the tied W (not trained there)
STEPS = (1, 2)
REL, ABS, W_ABS, NORM_REL = 1e-5, 1e-6, 1e-5, 1e-5
#: numbers that must agree within the fp32 tolerance
CLOSE_KEYS = ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/kl_loss", "actor/entropy",
              "actor/grad_norm", "actor/weight_rel_change", "actor/weight_rel_change/stage_0",
              "actor/weight_rel_change/stage_1", "mismatch/abs_logprob_diff_mean", "mismatch/logprob_diff_mean",
              "critic/score/mean", "response_length/mean", "probe/abs_logprob_diff_mean",
              "probe/view_abs_logprob_diff", "probe/kl_to_ref", "probe/kl_to_ref_compressed", "fidelity/cos",
              "fidelity/cos/stage_0", "fidelity/cos/stage_1", "fidelity/sign_agreement", "fidelity/norm_ratio",
              "codec/error_persistence")
#: bytes that must be equal
EQUAL_KEYS = ("comm/fwd_bytes", "comm/bwd_bytes", "comm/dense_equiv_bytes", "comm/bytes_ratio",
              "comm/embd_sync_dense_bytes", "comm/embd_full_sync_bytes", "comm/batch_bytes", "sync/bytes",
              "sync/dense_fp32_bytes", "actor/num_optimizer_steps", "actor/skipped_steps")
TOP, SPREAD = 32, 32


# ----------------------------------------------------------------------------- a run's numbers

def launch(out_dir, tp: int, *extra: str, dp: int = 1) -> None:
    """Run ``tp_train_worker.py`` at TP = ``tp`` x PP = 2 x DP = ``dp`` (2 x tp x dp gloo ranks) into
    ``out_dir``; ``extra``: the worker's mode (``resume``, or ``dp DP``)."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "reward.py"), "w") as f:
        f.write(PARITY_REWARD)
    run_ranks([WORKER, str(out_dir), str(tp), *extra], 2 * tp * dp, timeout=1500)


def load_metrics(out_dir, run: str):
    """{step: metrics without timings} of ``run``'s metrics.jsonl."""
    path = os.path.join(out_dir, run, "metrics.jsonl")
    with open(path) as f:
        lines = [json.loads(x) for x in f if x.strip()]
    return {m["step"]: without_wall_clock(m) for m in lines if "step" in m
            and any(k.startswith("actor/") for k in m)}


def load_stages(out_dir, run: str, tp: int):
    """[(whole params, whole theta_0) per stage]: the TP ranks' dumps merged (``merge_tp_shards``)."""
    from megatron_cegrpo.models.tp_shard import merge_tp_shards

    dumps = [torch.load(os.path.join(out_dir, run, f"rank{r}.pt")) for r in range(2 * tp)]
    stages = []
    for pp in (0, 1):
        shards = sorted((d for d in dumps if d["pp_rank"] == pp), key=lambda d: d["tp_rank"])
        assert [d["tp_rank"] for d in shards] == list(range(tp))
        stages.append(tuple(merge_tp_shards([d[k] for d in shards]) for k in ("params", "theta0")))
    return stages, dumps


def write_reference(path, ref: dict) -> dict:
    """Write a recorded reference as sorted, indented JSON (one place for both TP records)."""
    with open(path, "w") as f:
        json.dump(ref, f, indent=1, sort_keys=True)
        f.write("\n")
    return ref


def read_reference(path) -> dict:
    """A recorded reference with its ``metrics`` keyed by int step."""
    with open(path) as f:
        ref = json.load(f)
    ref["metrics"] = {int(k): v for k, v in ref["metrics"].items()}
    return ref


def fingerprint(stages):
    """Per trained parameter ``stage/name``: ``||theta - theta_0||`` (fp64) and the values of
    theta at its 32 most-moved and 32 evenly spaced coordinates (flat indices)."""
    out = {}
    for pp, (params, theta0) in enumerate(stages):
        for name, p in params.items():
            if pp == 0 and name == CACHE:
                continue
            flat, delta = p.reshape(-1), (p.double() - theta0[name].double()).reshape(-1)
            top = torch.topk(delta.abs(), min(TOP, delta.numel())).indices
            spread = torch.linspace(0, delta.numel() - 1, min(SPREAD, delta.numel())).long()
            idx = sorted(set(top.tolist()) | set(spread.tolist()))
            out[f"{pp}/{name}"] = {"delta_norm": float(delta.norm()), "idx": idx,
                                   "val": [float(flat[i]) for i in idx]}
    return out


def record(out_dir) -> dict:
    """Launch the TP = 1 x PP = 2 runs (``mask``, and ``dense`` for ``test_tensor_data_parallel.py``)
    and write :data:`REFERENCE` (metrics and weight fingerprints; the dense run's under ``"dense"``)."""
    launch(out_dir, 1, "dp", "1")
    stages, _ = load_stages(out_dir, "mask", 1)
    dense, _ = load_stages(out_dir, "dense", 1)
    ref = {"about": "tests/e2e/tp_train_worker.py at TP = 1 x PP = 2 (re-record: python "
                    "tests/e2e/test_tensor_parallel_train.py --record)",
           "torch": torch.__version__, "metrics": load_metrics(out_dir, "mask"), "weights": fingerprint(stages),
           "dense": {"metrics": load_metrics(out_dir, "dense"), "weights": fingerprint(dense)}}
    return write_reference(REFERENCE, ref)


def _run_name(spec: str) -> str:
    return spec.replace(":", "_").replace("/", "_")


def record_stateful(out_dir) -> dict:
    """Launch the TP = 1 x PP = 2 runs of :data:`STATEFUL` and write :data:`STATEFUL_REFERENCE`."""
    launch(out_dir, 1, "codecs", ",".join(STATEFUL))
    ref = {"about": "tests/e2e/tp_train_worker.py codecs at TP = 1 x PP = 2 (re-record: python "
                    "tests/e2e/test_tensor_parallel_train.py --record-stateful)", "torch": torch.__version__}
    for spec in STATEFUL:
        stages, _ = load_stages(out_dir, _run_name(spec), 1)
        ref[spec] = {"metrics": load_metrics(out_dir, _run_name(spec)), "weights": fingerprint(stages)}
    return write_reference(STATEFUL_REFERENCE, ref)


def read_stateful_reference() -> dict:
    """:data:`STATEFUL_REFERENCE` with each codec's ``metrics`` keyed by int step (``read_reference``)."""
    import tempfile

    with open(STATEFUL_REFERENCE) as f:
        raw = json.load(f)
    out = {}
    for spec in STATEFUL:
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as t:
            json.dump(raw[spec], t)
        out[spec] = read_reference(t.name)
        os.unlink(t.name)
    return out


# ----------------------------------------------------------------------------- the default suite

@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    d = tmp_path_factory.mktemp("tp2")
    launch(d, 2)
    return d


@pytest.fixture(scope="module")
def reference():
    return read_reference(REFERENCE)


def _close(a, b) -> bool:
    return math.isclose(a, b, rel_tol=REL, abs_tol=ABS)


def test_tp2_trains_like_the_recorded_tp1_run(tp2, reference):
    m2, m1 = load_metrics(tp2, "mask"), reference["metrics"]
    assert sorted(m2) == sorted(m1) == list(STEPS)
    for step in STEPS:
        for k in CLOSE_KEYS:
            assert (k in m1[step]) == (k in m2[step]), (step, k)
            if k in m1[step]:
                assert _close(m1[step][k], m2[step][k]), (step, k, m1[step][k], m2[step][k])
        for k in EQUAL_KEYS:
            assert m2[step][k] == m1[step][k], (step, k, m1[step][k], m2[step][k])
    assert "fidelity/cos" in m2[2] and "probe/kl_to_ref" in m2[2]  # both probes ran at iteration 2
    stages, _ = load_stages(tp2, "mask", 2)
    for key, ref in reference["weights"].items():
        pp, name = key.split("/", 1)
        params, theta0 = stages[int(pp)]
        flat = params[name].reshape(-1)
        got = torch.tensor([float(flat[i]) for i in ref["idx"]], dtype=torch.float64)
        diff = float((got - torch.tensor(ref["val"], dtype=torch.float64)).abs().max())
        assert diff <= W_ABS, (key, diff)
        norm = float((params[name].double() - theta0[name].double()).norm())
        assert math.isclose(norm, ref["delta_norm"], rel_tol=NORM_REL, abs_tol=1e-9), (key, norm, ref["delta_norm"])


def test_tp2_tied_embedding_bytes_are_tp1_rows_split_over_the_tp_ranks(tp2, reference):
    m2, m1 = load_metrics(tp2, "mask"), reference["metrics"]
    for step in STEPS:
        steps = m2[step]["actor/num_optimizer_steps"]
        # the second TP rank's 8-byte norm term per optimizer step and 16-byte weight term per iteration
        assert m2[step]["comm/embd_sync_bytes"] - m1[step]["comm/embd_sync_bytes"] == 8 * steps + 16, step
        assert m2[step]["comm/total_bytes"] - m1[step]["comm/total_bytes"] == 8 * steps + 16, step


def test_tp2_ranks_of_a_stage_hold_identical_replicated_weights(tp2):
    from megatron_cegrpo.models.tp_shard import partition_dim

    _, dumps = load_stages(tp2, "mask", 2)
    for pp in (0, 1):
        a, b = (d["params"] for d in dumps if d["pp_rank"] == pp)
        for n in a:
            if partition_dim(n) is None:  # norms: the same gradient and step on both TP ranks
                assert torch.equal(a[n], b[n]), (pp, n)


def test_tp2_checkpoint_holds_one_shard_per_tp_rank(tp2):
    from megatron_cegrpo import checkpointing as ck

    ckpt = os.path.join(tp2, "mask", "ckpt", "iter_0000002")
    meta = ck.verify_checkpoint(ckpt)
    assert meta["tp_size"] == 2 and ck.continues_run(meta)
    for pp in (0, 1):
        names = ck.stage_file_names(meta, pp)
        for base, ext in (("model", "safetensors"), ("reference", "safetensors"), ("trainer_state", "pt")):
            assert [n for n in names if n.startswith(base)] == [f"{base}_tp00.{ext}", f"{base}_tp01.{ext}"], names


@pytest.mark.slow
def test_resume_at_tp2_is_bit_exact(tmp_path):
    """Checkpoints at 1 and 2; a new trainer from the one at 1 trains iteration 2: the metrics of
    iteration 2 and every rank's final weights equal the straight run's bit for bit."""
    launch(tmp_path, 2, "resume")
    a, b = load_metrics(tmp_path, "mask"), load_metrics(tmp_path, "resumed")
    assert sorted(b) == [2]
    assert a[2] == b[2], {k: (a[2][k], b[2].get(k)) for k in a[2] if a[2][k] != b[2].get(k)}
    _, straight = load_stages(tmp_path, "mask", 2)
    _, resumed = load_stages(tmp_path, "resumed", 2)
    for p, q in zip(straight, resumed):
        assert all(torch.equal(p["params"][n], q["params"][n]) for n in p["params"]), (p["pp_rank"], p["tp_rank"])


@pytest.mark.slow
def test_tp2_stateful_codecs_train_like_tp1(tmp_path):
    """``lowrank`` (fast-owned Q, warm-started, its basis split over the TP ranks) and ``rpq:lrq`` (the
    bases inside the payloads) at TP = 2 x PP = 2 against the committed TP = 1 x PP = 2 record
    (``reference/tp_stateful_tp1_pp2.json``): ``lowrank``'s boundary bytes equal exactly (each TP rank
    sends half of every payload and basis), its losses, norms and probes within the mask run's
    tolerances, its weights at the recorded coordinates within ``W_ABS``; ``rpq:lrq`` within the
    tolerances :data:`QUANTISED` states and why."""
    if not os.path.exists(STATEFUL_REFERENCE):
        pytest.skip(f"{STATEFUL_REFERENCE} not recorded yet; record it with "
                    "`PYTHONPATH=$PWD python tests/e2e/test_tensor_parallel_train.py --record-stateful`")
    launch(tmp_path, 2, "codecs", ",".join(STATEFUL))
    refs = read_stateful_reference()
    for spec in STATEFUL:
        m2, m1 = load_metrics(tmp_path, _run_name(spec)), refs[spec]["metrics"]
        tol = QUANTISED.get(spec, dict(rel=REL, abs=ABS, w_abs=W_ABS, norm_rel=NORM_REL, skip=(), padded=()))
        assert sorted(m2) == sorted(m1) == list(STEPS), spec
        for step in STEPS:
            for k in CLOSE_KEYS:
                assert (k in m1[step]) == (k in m2[step]), (spec, step, k)
                if k in m1[step] and k not in tol["skip"]:
                    assert math.isclose(m1[step][k], m2[step][k], rel_tol=tol["rel"], abs_tol=tol["abs"]), \
                        (spec, step, k, m1[step][k], m2[step][k])
            for k in STATEFUL_EQUAL_KEYS:
                if k == "comm/bwd_bytes" and k in tol["padded"]:  # <= one fp32 element per message: 4 micro-batches
                    pad = m2[step][k] - m1[step][k]  # (2 prompts x 4 responses, micro-batches of 2)
                    assert 0 <= pad <= 4 * 4 and pad % 4 == 0, (spec, step, k, m1[step][k], m2[step][k])
                elif k not in tol["padded"]:
                    assert m2[step].get(k) == m1[step].get(k), (spec, step, k, m1[step].get(k), m2[step].get(k))
        if spec == "lowrank":  # one d x r basis per iteration, split over the two TP ranks, counted once
            assert all(m2[s]["comm/basis_bytes"] > 0 for s in STEPS)
        stages, _ = load_stages(tmp_path, _run_name(spec), 2)
        for key, ref in refs[spec]["weights"].items():
            pp, name = key.split("/", 1)
            params, theta0 = stages[int(pp)]
            flat = params[name].reshape(-1)
            got = torch.tensor([float(flat[i]) for i in ref["idx"]], dtype=torch.float64)
            diff = float((got - torch.tensor(ref["val"], dtype=torch.float64)).abs().max())
            assert diff <= tol["w_abs"], (spec, key, diff)
            norm = float((params[name].double() - theta0[name].double()).norm())
            assert math.isclose(norm, ref["delta_norm"], rel_tol=tol["norm_rel"], abs_tol=1e-9), (spec, key, norm)


# ----------------------------------------------------------------------------- refused at start-up (no launch)

def _cfg(*extra):
    from megatron_cegrpo.arguments import build_config, parse_args

    return build_config(parse_args(["--model", "tiny-llama", "--pipeline-model-parallel-size", "2",
                                    "--tensor-model-parallel-size", "2", "--rollout-batch-size", "2",
                                    "--num-generations", "4", "--micro-batch-size", "2", *extra]))


def test_tp2_pp2_without_an_anchor_validates():
    assert _cfg("--anchor-ranks", "0").validate(world_size=4).data_parallel_size(4) == 1


@pytest.mark.parametrize("codec", ["lowrank", "pcaq:lrq", "rpq:lrq", "rpq/own=0:lrq", "mask:lrq"])
def test_tp2_runs_the_tp_splittable_stateful_codecs(codec):
    """Their TP ranks encode identical bits and split them (tests/compression/test_tp_codec_determinism.py)."""
    flags = ("--boundary-codec", codec, "--boundary-keep-ratio", "0.25")
    assert plan_of(_cfg("--anchor-ranks", "0", *flags), 4).layout.tp == 2
    assert plan_of(_cfg("--anchor-ranks", "1", *flags), 5).codec.tp_splittable


def test_tp2_pp2_with_an_anchor_rank_validates():
    """5 ranks: TP 2 x PP 2 + the anchor (test_tensor_parallel_anchor.py trains it)."""
    assert _cfg("--anchor-ranks", "1").validate(world_size=5).data_parallel_size(5) == 1


@pytest.mark.parametrize("world,dp", [(9, 2), (17, 4)])
def test_tp2_pp2_x_dp_with_an_anchor_rank_validates(world, dp):
    """TP 2 x PP 2 x DP + the anchor (test_tensor_data_parallel_anchor.py trains DP = 2)."""
    cfg = _cfg("--anchor-ranks", "1").validate(world_size=world)
    assert cfg.data_parallel_size(world) == dp


@pytest.mark.parametrize("extra,world,start", [
    (["--anchor-ranks", "1"], 4, "world size 4 minus --anchor-ranks (1) leaves 3 trainer ranks, not a multiple of "
                                 "--tensor-model-parallel-size (2) x --pipeline-model-parallel-size (2)"),
    (["--anchor-ranks", "1", "--micro-batch-size", "8"], 9,  # TP x DP + anchor runs; whole micro-batches
     "--global-batch-size=8 is not a multiple of data-parallel size (2, from the world size) x --micro-batch-size (8)"),
    (["--anchor-ranks", "1", "--boundary-codec", "lowrank", "--lowrank-q-owner", "anchor"], 5,
     "--boundary-codec lowrank --lowrank-q-owner anchor: the anchor sends the basis to each stage's TP rank 0 only"),
    (["--anchor-ranks", "0"], 6, "world size 6 minus --anchor-ranks (0) leaves 6 trainer ranks, not a multiple of "
                                 "--tensor-model-parallel-size (2) x --pipeline-model-parallel-size (2)"),
])
def test_what_tp_does_not_run_yet_stops_with_one_line(extra, world, start):
    from megatron_cegrpo.errors import ConfigError

    with pytest.raises(ConfigError, match="^" + re.escape(start)) as e:
        plan_of(_cfg(*extra), world)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(start) and "fix: " in msg, msg


def test_a_run_written_at_another_tp_size_does_not_continue():
    from megatron_cegrpo.checkpointing.compat import check_resume_tensor_parallel
    from megatron_cegrpo.errors import ConfigError

    tp = _cfg("--anchor-ranks", "0").parallel.tensor_model_parallel_size
    check_resume_tensor_parallel({"tp_size": 2}, tp, "ckpt")
    with pytest.raises(ConfigError, match=r"^--load ckpt was written at --tensor-model-parallel-size 1 .*fix: pass "
                                          r"--tensor-model-parallel-size 1, or convert it to weights only"):
        check_resume_tensor_parallel({}, tp, "ckpt")


def test_per_tp_rank_file_names_and_continued_runs():
    from megatron_cegrpo import checkpointing as ck

    assert ck.tp_file_name("reference") == "reference" and ck.tp_file_name("reference", 1, 2) == "reference_tp01"
    with pytest.raises(ValueError, match="out of range"):
        ck.tp_file_name("trainer_state", 2, 2)
    files = lambda *names: {"files": {f"stage_00/{n}": {} for n in names}}  # noqa: E731
    assert ck.continues_run(files("model.safetensors", "trainer_state.pt"))
    assert ck.continues_run(files("model_tp00.safetensors", "trainer_state_tp00.pt", "trainer_state_tp01.pt"))
    assert not ck.continues_run(files("model_tp00.safetensors", "model_tp01.safetensors"))  # weights only


if __name__ == "__main__":
    if sys.argv[1:] not in (["--record"], ["--record-stateful"]):
        sys.exit("usage: PYTHONPATH=$PWD python tests/e2e/test_tensor_parallel_train.py --record | --record-stateful")
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        if sys.argv[1] == "--record":
            r = record(tmp)
            print(f"wrote {REFERENCE}: steps {sorted(r['metrics'])}, {len(r['weights'])} parameters")
        else:
            r = record_stateful(tmp)
            print(f"wrote {STATEFUL_REFERENCE}: {', '.join(STATEFUL)}")
