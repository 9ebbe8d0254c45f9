"""What ``tp_codec_worker.py`` runs and ``test_tp_codec_determinism.py`` checks, in a module with
no side effects: the test must not import the worker, whose ``bootstrap(cpu_compat=True)`` would
install the CPU compatibility layer in the pytest process (it did, and changed the HF models of
``tests/checkpointing/test_ckpt_convert.py`` that ran after it in the same process)."""

#: (spec, keep ratio): the codecs the TP split now runs, with the mask as the stateless control
SPECS = (("lowrank", 0.25), ("pcaq:lrq", 0.25), ("rpq:lrq", 0.25), ("rpq/own=0:lrq", 0.25),
         ("pcaq:pcaq", 0.25), ("mask", 0.25), ("rpq/warm=1/lag=1:lrq/warm=1/lag=1", 0.25),
         ("pcaq/rd=1:lrq/rd=1", 0.25), ("pcaq/every=2/ema=0.9:lrq", 0.25), ("pcaq/prefix=1:lrq", 0.25))
S, B, D, SEED = 16, 2, 64, 1234
PASSES = ("old", "ref", "upd")
OPTIONS = {"q_owner": "fast", "tokens_per_iteration": 8 * S * 4, "anchor_interval": 4}
