"""Checking a conversation and rendering it into a prompt with the tokenizer's chat
template.

Shared by LLM.chat and the OpenAI chat endpoint, so that both accept the same
messages, refuse the same ones with the same errors, and turn them into the same
token ids.
"""

from __future__ import annotations

import json
from typing import Any

# "developer" is the OpenAI API's newer name for "system"; templates know "system".
# "tool" messages carry a tool's result back (tool calling).
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def chat_messages(conversation: Any) -> list[dict[str, str]]:
    """The conversation as a chat template reads it: [{"role", "content"}] with text
    content; ValueError naming the message at fault.

    Each message is a dict with a role in CHAT_ROLES and content: a string, or a list
    of text parts ({"type": "text", "text": ...}), which are joined. An assistant
    message with tool_calls may have no content; their arguments (a JSON string in the
    OpenAI API) reach the template as the dict chat templates expect. Other keys are
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
    out = {**message, "role": "system" if role == "developer" else role}
    if role == "assistant" and message.get("tool_calls"):
        out["tool_calls"] = _template_tool_calls(where, message["tool_calls"])
        if message.get("content") is None:
            out["content"] = ""
            return out
    out["content"] = _text_content(where, message.get("content"))
    return out


def _template_tool_calls(where: str, calls: Any) -> list[dict]:
    """An assistant message's tool_calls with each function's arguments as a dict."""
    if not isinstance(calls, list):
        raise ValueError(f"{where} tool_calls must be a list, got {calls!r}")
    out = []
    for i, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ValueError(f"{where} tool_calls[{i}] needs function.name, got {call!r}")
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except ValueError as e:
                raise ValueError(f"{where} tool_calls[{i}] function.arguments is not valid "
                                 f"JSON: {e}") from e
        out.append({**call, "function": {**function, "arguments": arguments}})
    return out


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
                       chat_template: str | None = None, tools: list[dict] | None = None,
                       template_kwargs: dict[str, Any] | None = None) -> dict:
    """{"prompt": text, "prompt_token_ids": ids}; ValueError for a bad conversation.
    tools: the functions the model may call (OpenAI's {"type": "function", "function":
    {...}} entries), handed to the template as its `tools`; template_kwargs: more
    variables for the template (say enable_thinking=False)."""
    messages = chat_messages(conversation)
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template; pass chat_template=")
    options = {**_checked_template_kwargs(template_kwargs), **({"tools": tools} if tools else {})}
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=add_generation_prompt,
                                             chat_template=chat_template, **options)
    except Exception as e:  # jinja raises its own error types for a broken template
        raise ValueError(f"the chat template failed to render: {e}") from e
    # The template already holds any BOS it wants: do not add special tokens twice.
    return {"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}


# apply_chat_template's own parameters: not template variables a caller may set.
_TEMPLATE_PARAMETERS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "tokenize",
    "add_generation_prompt", "continue_final_message", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})


def _checked_template_kwargs(kwargs: Any) -> dict[str, Any]:
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise ValueError(f"chat_template_kwargs must be a dict of template variables, got "
                         f"{kwargs!r}")
    for key in kwargs:
        if not isinstance(key, str) or not key.isidentifier() or key in _TEMPLATE_PARAMETERS:
            raise ValueError(f"chat_template_kwargs cannot set {key!r}: a template variable is "
                             "an identifier other than apply_chat_template's own parameters")
    return dict(kwargs)
