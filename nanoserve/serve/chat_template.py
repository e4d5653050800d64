"""A conversation as the model's prompt text, through the tokenizer's chat template."""

from __future__ import annotations

from typing import Any

from nanoserve.chat import check_template_kwargs
from nanoserve.serve.protocol import APIError, short


def chat_prompt(tokenizer, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                tools: list[dict[str, Any]] | None = None,
                template_kwargs: dict[str, Any] | None = None) -> str:
    """The template's text (tokenized without special tokens, as every prompt is: the template
    writes the ones the model needs), with the request's tools and chat_template_kwargs
    (enable_thinking, say). APIError 400 when there is no template or it refuses the
    messages."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise APIError(400, "this model has no chat template; use /v1/completions", "messages")
    try:
        kwargs = check_template_kwargs(template_kwargs)
    except ValueError as e:
        raise APIError(400, str(e), "chat_template_kwargs") from e
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=add_generation_prompt,
                                             tools=tools, **kwargs)
    except Exception as e:  # the template refused the conversation
        raise APIError(400, f"the chat template refused these messages: "
                            f"{short(str(e), 300)}", "messages") from e
