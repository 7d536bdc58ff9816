"""Which engine answers a request: the served models by name, each with the serving
objects of its endpoints. A server of one engine has one entry (under one or more
names); a server of a model pool has one per model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from spindle.config import ServerArgs
from spindle.entrypoints.openai.protocol import APIError
from spindle.entrypoints.openai.serving_base import ServedModels, model_not_found
from spindle.entrypoints.openai.serving_chat import ChatServing
from spindle.entrypoints.openai.serving_completion import CompletionServing
from spindle.entrypoints.openai.serving_embedding import EmbeddingServing
from spindle.entrypoints.openai.serving_transcription import TranscriptionServing


@dataclass(frozen=True)
class ServedModel:
    """One engine (an AsyncLLM, or a pool model's PooledEngine) as the routes see it."""

    models: ServedModels
    completions: CompletionServing
    chat: ChatServing
    embeddings: EmbeddingServing
    transcriptions: TranscriptionServing  # (and translations)

    @classmethod
    def of(cls, engine: Any, models: ServedModels, args: ServerArgs) -> "ServedModel":
        """The routes of one model, with the server's audio limit and parsers."""
        return cls(models, CompletionServing(engine, models),
                   ChatServing(engine, models, args.tool_call_parser, args.reasoning_parser),
                   EmbeddingServing(engine, models),
                   TranscriptionServing(engine, models, args.max_audio_seconds))


class ModelRoutes:
    """The served models by every name they answer to. card_extra(name) adds fields to
    a model's card in /v1/models (a pool's state of that model)."""

    def __init__(self, served: Sequence[ServedModel],
                 card_extra: Callable[[str], dict[str, Any]] | None = None) -> None:
        self._served = list(served)
        self._card_extra = card_extra

    @property
    def _by_name(self) -> dict[str, ServedModel]:
        """(Made on each use: adapters come and go at run time.)"""
        return {name: s for s in self._served for name in s.models.all_names}

    @property
    def names(self) -> list[str]:
        return list(self._by_name)

    def route(self, requested: str | None) -> ServedModel:
        """The model a request's model field names; with no name, the only one."""
        if requested is None:
            if len(self._served) == 1:
                return self._served[0]
            raise APIError(400, "the request names no model and this server serves several: "
                           f"set model to one of {', '.join(repr(n) for n in self.names)}",
                           param="model", code="model_required")
        served = self._by_name.get(requested)
        if served is None:
            raise model_not_found(requested, self.names)
        return served

    def listing(self) -> dict[str, Any]:
        return {"object": "list", "data": [self.card(name) for name in self.names]}

    def retrieve(self, model_id: str) -> dict[str, Any]:
        """GET /v1/models/{model_id}: the model's card, or 404."""
        if model_id not in self._by_name:
            raise model_not_found(model_id, self.names)
        return self.card(model_id)

    def card(self, name: str) -> dict[str, Any]:
        card = self._by_name[name].models.card(name)
        if self._card_extra is not None:
            card.update(self._card_extra(name))
        return card
