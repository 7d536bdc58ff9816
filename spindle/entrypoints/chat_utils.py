"""Checking a conversation and rendering it into a prompt with the tokenizer's chat
template.

Shared by LLM.chat and the OpenAI chat endpoint, so that both accept the same
messages, refuse the same ones with the same errors, and turn them into the same
token ids.
"""

from __future__ import annotations

from typing import Any

# "developer" is the OpenAI API's newer name for "system"; templates know "system".
CHAT_ROLES = ("system", "developer", "user", "assistant")


def chat_messages(conversation: Any) -> list[dict[str, str]]:
    """The conversation as a chat template reads it: [{"role", "content"}] with text
    content; ValueError naming the message at fault.

    Each message is a dict with a role in CHAT_ROLES and content: a string, or a list
    of text parts ({"type": "text", "text": ...}), which are joined. Other keys are
    kept for the template.
    """
    if not isinstance(conversation, (list, tuple)) or not conversation:
        raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")
    return [_template_message(i, message) for i, message in enumerate(conversation)]


def _template_message(index: int, message: Any) -> dict[str, Any]:
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise ValueError(f"{where} must be a dict with 'role' and 'content', got {message!r}")
    role = message.get("role")
    if role not in CHAT_ROLES:
        problem = "has no 'role'" if role is None else f"has role {role!r}"
        raise ValueError(f"{where} {problem}: the role must be one of {', '.join(CHAT_ROLES)}")
    return {**message, "role": "system" if role == "developer" else role,
            "content": _text_content(where, message.get("content"))}


def _text_content(where: str, content: Any) -> str:
    if isinstance(content, str):
        return content
    if content is None:
        raise ValueError(f"{where} has no 'content': every message needs its text "
                         "(a string or a list of text parts)")
    if isinstance(content, list) and all(
            isinstance(part, dict) and part.get("type") == "text"
            and isinstance(part.get("text"), str) for part in content):
        return "".join(part["text"] for part in content)
    raise ValueError(f"{where} content must be a string or a list of "
                     f"{{'type': 'text', 'text': ...}} parts, got {content!r}")


def render_chat_prompt(tokenizer: Any, conversation: list[dict], add_generation_prompt: bool = True,
                       chat_template: str | None = None) -> dict:
    """{"prompt": text, "prompt_token_ids": ids}; ValueError for a bad conversation."""
    messages = chat_messages(conversation)
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template; pass chat_template=")
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=add_generation_prompt,
                                             chat_template=chat_template)
    except Exception as e:  # jinja raises its own error types for a broken template
        raise ValueError(f"the chat template failed to render: {e}") from e
    # The template already holds any BOS it wants: do not add special tokens twice.
    return {"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}
