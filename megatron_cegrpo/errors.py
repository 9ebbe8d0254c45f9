"""The one exception type for start-up mistakes a user fixes by changing the command line.

``ConfigError`` is raised by flag validation (:mod:`megatron_cegrpo.arguments`), by the
data checks (:mod:`megatron_cegrpo.data`), by checkpoint problems
(:class:`megatron_cegrpo.checkpointing.CheckpointError` derives from it) and by reward
functions (:class:`megatron_cegrpo.rewards.RewardError`: loading at start-up, bad values
during training). Its message is
one line naming the flag, file or field, what is wrong, and the fix. The entry point
(``megatron_cegrpo/train.py``) prints it once (rank 0) without a traceback and exits
with status 2.
"""

__all__ = ["ConfigError", "one_line"]


class ConfigError(ValueError):
    """A flag, data file, checkpoint or launch that cannot work; the message names it and
    the fix, on one line."""


def one_line(message: object) -> str:
    """``str(message)`` with its line breaks folded into spaces (messages are one line)."""
    return " ".join(str(message).split())
