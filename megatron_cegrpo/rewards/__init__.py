"""Reward functions: rule-based verifiers for math answers, user reward functions
loaded from a file, and checked scoring of a rollout batch."""

from megatron_cegrpo.rewards.custom import load_custom_reward_function
from megatron_cegrpo.rewards.scoring import RewardError, score_responses
from megatron_cegrpo.rewards.verifiers import (
    REL_TOL,
    Verifier,
    available_verifiers,
    boxed_verifier,
    extract_boxed,
    extract_numeric_answer,
    get_verifier,
    gsm8k_verifier,
    last_boxed,
    numeric_verifier,
    olympiad_list_verifier,
    parse_number,
    register_verifier,
)

__all__ = [
    "REL_TOL",
    "RewardError",
    "Verifier",
    "available_verifiers",
    "boxed_verifier",
    "extract_boxed",
    "extract_numeric_answer",
    "get_verifier",
    "gsm8k_verifier",
    "last_boxed",
    "load_custom_reward_function",
    "numeric_verifier",
    "olympiad_list_verifier",
    "parse_number",
    "register_verifier",
    "score_responses",
]
