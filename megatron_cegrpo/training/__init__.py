"""The trainer ranks' side of a run (DESIGN.md section 2), one concern per module:

- ``trainer.py``: the iteration loop (:class:`GRPOTrainer`);
- ``driver.py``: rank 0's data, sampler, reward, evaluation and log;
- ``stage.py``: one pipeline stage's passes, update and hooks;
- ``circuit.py``: the slot for a correction circuit (the anchor: ``anchor/circuit.py``);
- ``reduce.py``: stage metrics reduced on the driver by declared rules;
- ``checkpointer.py``: save and restore a rank's weights and stateful objects.
"""

from megatron_cegrpo.training.trainer import GRPOTrainer

__all__ = ["GRPOTrainer"]
