"""Chat prompt templates for math questions.

A template maps a question to the *user message*; :func:`build_prompt` wraps
it with the tokenizer's own chat template (``apply_chat_template`` with
``add_generation_prompt=True``), so the prompt ends where the assistant's
answer begins.
"""

from __future__ import annotations

from typing import Callable, Dict, List

__all__ = [
    "DEFAULT_TEMPLATE",
    "register_template",
    "get_template",
    "available_templates",
    "build_messages",
    "build_prompt",
    "encode_prompt",
]

Template = Callable[[str], str]

_TEMPLATES: Dict[str, Template] = {}

#: Template used when none is named.
DEFAULT_TEMPLATE = "boxed"


def register_template(name: str) -> Callable[[Template], Template]:
    """Decorator registering ``fn(question) -> user message`` as ``name``."""

    def deco(fn: Template) -> Template:
        if name in _TEMPLATES:
            raise ValueError(f"template {name!r} is already registered")
        _TEMPLATES[name] = fn
        return fn

    return deco


def get_template(name: str) -> Template:
    try:
        return _TEMPLATES[name]
    except KeyError:
        raise ValueError(
            f"unknown template {name!r}; valid templates: {', '.join(available_templates())}"
        ) from None


def available_templates() -> List[str]:
    return sorted(_TEMPLATES)


@register_template("boxed")
def _boxed(question: str) -> str:
    """Qwen2.5-Math's standard chain-of-thought prompt."""
    return question + "\nPlease reason step by step, and put your final answer within \\boxed{}."


@register_template("plain")
def _plain(question: str) -> str:
    """The question alone."""
    return question


@register_template("answer_is")
def _answer_is(question: str) -> str:
    """Ask for a 'The answer is N.' closing sentence."""
    return question + "\nGive the final answer as 'The answer is N.'"


def build_messages(question: str, template: str = DEFAULT_TEMPLATE) -> List[dict]:
    """The chat message list for ``question`` under ``template``."""
    if not isinstance(question, str) or not question.strip():
        raise ValueError("question must be a non-empty string")
    return [{"role": "user", "content": get_template(template)(question.strip())}]


def build_prompt(tokenizer, question: str, template: str = DEFAULT_TEMPLATE) -> str:
    """Prompt text for ``question``: the template's user message rendered by
    ``tokenizer.apply_chat_template(..., tokenize=False, add_generation_prompt=True)``."""
    return tokenizer.apply_chat_template(
        build_messages(question, template), tokenize=False, add_generation_prompt=True
    )


def encode_prompt(tokenizer, question: str, template: str = DEFAULT_TEMPLATE):
    """The prompt's token ids, as the sampler, the trainer and the evaluation feed them:
    :func:`build_prompt`'s text tokenized with ``add_special_tokens=False`` (the chat template
    already holds every special token; a tokenizer's own BOS would come twice).

    Returns:
        LongTensor[n] (int64), n the prompt's length in tokens.

    Raises:
        ValueError: an empty question or an unknown template (:func:`build_messages`).
    """
    import torch

    text = build_prompt(tokenizer, question, template)
    return torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
