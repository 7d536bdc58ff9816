"""Rendering a conversation into a prompt with the tokenizer's chat template.

Shared by LLM.chat and the OpenAI chat endpoint, so that both turn the same
messages into the same token ids.
"""

from __future__ import annotations

from typing import Any


def render_chat_prompt(tokenizer: Any, conversation: list[dict], add_generation_prompt: bool = True,
                       chat_template: str | None = None) -> dict:
    """{"prompt": text, "prompt_token_ids": ids}; ValueError for a bad conversation."""
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template; pass chat_template=")
    for message in conversation:
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise ValueError(f"each chat message needs 'role' and 'content', got {message!r}")
    try:
        text = tokenizer.apply_chat_template(conversation, tokenize=False,
                                             add_generation_prompt=add_generation_prompt,
                                             chat_template=chat_template)
    except Exception as e:  # jinja raises its own error types for a broken template
        raise ValueError(f"the chat template failed to render: {e}") from e
    # The template already holds any BOS it wants: do not add special tokens twice.
    return {"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}
