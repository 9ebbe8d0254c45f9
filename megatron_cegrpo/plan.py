"""The run plan (issue 34, "a run plan resolved once"): what start-up resolves from the flags, the
world size, the model's config and ``--load``, once per process, and hands to everything after it.

``train.preflight`` resolves it on every rank before any process group exists
(:func:`resolve_plan`) and ``train.main`` hands it to the trainer (``GRPOTrainer``) or the anchor
(``run_anchor``); a trainer built without one (the test workers, ``tools/codec_fidelity.py``)
resolves it the same way. It holds:

- the :class:`~megatron_cegrpo.layout.Layout` (who is who; checked: world = TP x PP x DP + anchor
  ranks);
- the boundary codec, **built here and nowhere else** (``TrainConfig.build_boundary_codec``): the
  start-up checks read its declared capabilities (:func:`check_codec_layout`) and its documented bytes
  (:func:`check_codec_budget`), and each stage encodes with this very object;
- the resume decision (``checkpointing.decide_resume``): what ``--load`` starts from, which the
  stages' checkpointer and the anchor then load.

Config classes keep their per-flag checks (``TrainConfig.validate``); the checks that need the
codec, the model or the world live here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from megatron_cegrpo.errors import ConfigError, one_line
from megatron_cegrpo.layout import Layout

__all__ = ["RunPlan", "resolve_plan", "check_codec_layout", "check_codec_budget", "boundary_messages"]


@dataclass(frozen=True)
class RunPlan:
    """The run, resolved once (module docstring).

    Attributes:
        layout: the launch's :class:`Layout`.
        codec: the run's ``BoundaryCodec`` (``--boundary-codec``), the stage's own encoder.
        resume: what ``--load`` starts from (``checkpointing.ResumePoint``), or None: no ``--load``,
            or a fresh start in the run's own ``--save`` directory.
    """

    layout: Layout
    codec: Any
    resume: Any = None


def resolve_plan(cfg, world_size: int, hf_config, *, verify_sizes: bool = False) -> RunPlan:
    """The :class:`RunPlan` of ``cfg`` (a validated ``TrainConfig``) for a launch of ``world_size``
    ranks and the model's HF config.

    Args:
        verify_sizes: the resume decision also checks every listed checkpoint file's size
            (start-up, before any process group exists).
    Raises:
        ConfigError (CheckpointError for ``--load``): one line naming the flag and the fix.
    """
    from megatron_cegrpo import checkpointing as ck

    layout = cfg.layout(world_size)
    layout.check()
    try:
        codec = cfg.build_boundary_codec(warn=True)
    except ValueError as e:
        raise ConfigError(f"--boundary-codec {cfg.codec.boundary_codec!r}: {one_line(e)}; fix: e.g. "
                          "--boundary-codec mask, or --boundary-codec pcaq:lrq") from None
    check_codec_layout(cfg, codec, layout)
    check_codec_budget(cfg, codec, int(hf_config.hidden_size))
    resume = ck.decide_resume(cfg, hf_config, verify_sizes=verify_sizes) if cfg.checkpoint.load else None
    return RunPlan(layout=layout, codec=codec, resume=resume)


def check_codec_layout(cfg, codec, layout: Layout) -> None:
    """What the codec's declared capabilities allow in this layout (``docs/parallelism.md``):

    - at data-parallel size > 1 a replica-invariant codec (``BoundaryCodec.replica_invariant``: its
      payloads depend on their own micro-batch only, so the replicas send what one replica would);
    - at ``--tensor-model-parallel-size`` > 1 a codec whose TP ranks encode identical bits and split
      them (``BoundaryCodec.tp_splittable`` False: ``lowrank --lowrank-q-owner anchor``, whose basis
      the anchor sends to TP rank 0 only).

    Raises:
        ConfigError: one line naming the flag and the fix.
    """
    c, dp, tp = cfg.codec, layout.dp, layout.tp
    if dp > 1 and not codec.replica_invariant:
        raise ConfigError(
            f"--boundary-codec {c.boundary_codec} keeps a basis across micro-batches (per step or per "
            f"run), which data-parallel replicas (size {dp}) would each build from their own micro-batches; "
            "fix: pass a codec whose halves depend on their own micro-batch only (dense, mask, lrq, rpq: e.g. "
            "rpq:lrq), or launch one replica")
    if tp > 1 and not codec.tp_splittable:
        what = (f"--boundary-codec {c.boundary_codec} --lowrank-q-owner anchor: the anchor sends the basis to "
                f"each stage's TP rank 0 only, so the other {tp - 1} TP rank(s) could not decode; fix: pass "
                "--lowrank-q-owner fast" if c.boundary_codec == "lowrank" else
                f"--boundary-codec {c.boundary_codec} cannot split its payloads over the {tp} TP ranks; fix: "
                "pass --boundary-codec mask")
        raise ConfigError(what + ", or --tensor-model-parallel-size 1")


def boundary_messages(cfg) -> tuple:
    """``(forward, backward)`` messages one boundary carries in one iteration: per micro-batch one
    forward in each forward pass (the old-log-prob pass unless the update pass gives them, the
    reference pass with a KL term, each PPO epoch's update) and one backward per update."""
    g, mbs = cfg.grpo, cfg.parallel.micro_batch_size
    per_pass = g.sequences_per_iteration // mbs
    fwd = per_pass * (int(not cfg.old_log_prob_from_update) + int(g.kl_coef > 0) + g.ppo_epochs)
    return fwd, per_pass * g.ppo_epochs


def check_codec_budget(cfg, codec, hidden_size: int) -> None:
    """``--boundary-codec``'s documented bytes within the ``--boundary-keep-ratio`` budget it
    claims, per direction, over one iteration's messages (:func:`boundary_messages`) at the longest
    micro-batch (``compression.check_codec_budget``): ``[max prompt + max new tokens, mbs, d]``, or
    under ``--shared-prefix`` the longest packed one, ``[max prompt + G x max new tokens (rounded up
    to 8), mbs / G, d]`` (``grpo/shared_prefix.py``: a per-step basis is then amortised over fewer
    tokens). Nothing to check at PP = 1. Raises ConfigError naming both flags."""
    from megatron_cegrpo.compression import check_codec_budget as check

    c, r = cfg.codec, cfg.rollout
    if cfg.parallel.pipeline_model_parallel_size < 2:
        return
    fwd, bwd = boundary_messages(cfg)
    shape = (r.max_prompt_length + r.max_new_tokens, cfg.parallel.micro_batch_size, int(hidden_size))
    if cfg.parallel.shared_prefix:  # packed groups [prompt, r_1..r_G]: fewer tokens a message
        from megatron_cegrpo.grpo.shared_prefix import packed_length

        g = cfg.grpo.num_generations
        shape = (packed_length(r.max_prompt_length + g * r.max_new_tokens), cfg.parallel.micro_batch_size // g,
                 int(hidden_size))
    elem = 2 if cfg.model.precision != "fp32" else 4  # the boundary tensors' dtype (models.stage.PRECISIONS)
    try:
        check(codec, c.boundary_keep_ratio, shape, fwd, elem=elem, bwd_messages=bwd)
    except ValueError as e:
        raise ConfigError(f"--boundary-codec {c.boundary_codec} exceeds --boundary-keep-ratio "
                          f"{c.boundary_keep_ratio:g}: {one_line(e)}; fix: lower the halves' rank/share "
                          "parameters or raise --boundary-keep-ratio"
                          + (" or drop --shared-prefix" if cfg.parallel.shared_prefix else "")) from None


def plan_for(cfg, ctx, hf_config, plan: Optional[RunPlan]) -> RunPlan:
    """``plan`` when start-up handed one, else the same :func:`resolve_plan` for this process's world
    (a trainer or anchor built directly: test workers, ``tools/codec_fidelity.py``)."""
    return plan if plan is not None else resolve_plan(cfg, int(ctx.world_size), hf_config)
