"""Reward functions: rule-based verifiers for math answers."""

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
    "Verifier",
    "available_verifiers",
    "boxed_verifier",
    "extract_boxed",
    "extract_numeric_answer",
    "get_verifier",
    "gsm8k_verifier",
    "last_boxed",
    "numeric_verifier",
    "olympiad_list_verifier",
    "parse_number",
    "register_verifier",
]
