"""POST /tokenize and /detokenize (vLLM's routes): a text, or a conversation rendered
by the chat template, as the token ids the engine would see; token ids as text.

/tokenize takes {"model", "prompt", "add_special_tokens": true} or {"model",
"messages", "add_generation_prompt": true, "chat_template_kwargs"} (plus
"return_token_strs") and answers {"count", "max_model_len", "tokens"} ("token_strs"
when asked); /detokenize takes {"model", "tokens"} and answers {"prompt"}. Both run
in a tokenizer thread, off the engine's."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from spindle.entrypoints.chat_utils import render_chat_prompt
from spindle.entrypoints.openai.protocol import bad_request

router = APIRouter(tags=["tokenize"])


class TokenizeBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    tokens: list[int] = Field(min_length=0)


def _served(request: Request, model: str | None):
    served = request.app.state.routes.route(model)
    served.models.resolve(model)
    return served.completions  # (its engine and models: any serving object would do)


@router.post("/tokenize")
async def tokenize(body: TokenizeBody, request: Request) -> dict[str, Any]:
    serving = _served(request, body.model)
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("give exactly one of prompt and messages", "prompt")

    def run(tokenizer: Any) -> tuple[list[int], list[str] | None]:
        if body.messages is not None:
            ids = render_chat_prompt(tokenizer, body.messages, body.add_generation_prompt,
                                     template_kwargs=body.chat_template_kwargs
                                     )["prompt_token_ids"]
        else:
            ids = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        strs = tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return list(ids), strs

    ids, strs = await serving.engine.with_tokenizer(run)
    answer = {"count": len(ids), "max_model_len": serving.models.max_model_len,
              "tokens": ids}
    if strs is not None:
        answer["token_strs"] = strs
    return answer


@router.post("/detokenize")
async def detokenize(body: DetokenizeBody, request: Request) -> dict[str, Any]:
    serving = _served(request, body.model)
    vocab = serving.engine.config.model.vocab_size
    bad = [t for t in body.tokens if not 0 <= t < vocab]
    if bad:
        raise bad_request(f"tokens must be ids of the vocabulary [0, {vocab}), got {bad[0]}",
                          "tokens")
    text = await serving.engine.with_tokenizer(lambda tokenizer: tokenizer.decode(body.tokens))
    return {"prompt": text}
