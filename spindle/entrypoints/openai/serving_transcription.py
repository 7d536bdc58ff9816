"""POST /v1/audio/transcriptions and /v1/audio/translations: an audio file in (a
multipart form, as OpenAI's API takes it), its text out, served by Whisper checkpoints.

A request that names no language gets the one Whisper detects on the first window
(the likeliest language token after <|startoftranscript|>), on multilingual checkpoints.
The engine takes at most one window of audio per request (the feature extractor's
chunk_length seconds, 30 on real checkpoints), so a longer upload is cut into
consecutive windows, all submitted at once, and their texts joined: one segment per
window. Windows are independent; none is conditioned on the text of the one before
(Whisper's sequential long-form decoding), and there is no temperature fallback.
The app mounts this router beside the others (api_server._make_app).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends, File, Form, Request, UploadFile
from fastapi.responses import Response

from spindle.entrypoints.openai.protocol import bad_request
from spindle.entrypoints.openai.serving_base import (OpenAIServing, ServedModels, final_outputs,
                                                     logprob_token_count, raise_if_aborted)
from spindle.entrypoints.openai.transcription_formats import (RESPONSE_FORMATS, Segment,
                                                              render)
from spindle.multimodal.audio_io import AudioError, decode_audio, resample, split_windows
from spindle.multimodal.whisper_prompt import (DEFAULT_LANGUAGE, decoder_prompt_ids,
                                               language_detection)
from spindle.outputs import CompletionOutput, RequestOutput, finite_logprob
from spindle.sampling_params import SamplingParams

# Longest upload accepted, in seconds of audio (ServerArgs.max_audio_seconds, the
# --max-audio-seconds flag of `spindle serve`).
MAX_AUDIO_SECONDS = 3600.0
WHISPER_ARCHITECTURE = "WhisperForConditionalGeneration"
# WhisperFeatureExtractor's defaults, for a preprocessor_config.json that leaves one out.
_EXTRACTOR_DEFAULTS = {"sampling_rate": 16000, "chunk_length": 30, "hop_length": 160}
# The media type of the formats answered as text.
_TEXT_MEDIA_TYPES = {"text": "text/plain; charset=utf-8", "srt": "text/plain; charset=utf-8",
                     "vtt": "text/vtt; charset=utf-8"}

router = APIRouter()


@dataclass(frozen=True)
class TranscriptionRequest:
    """The form fields of either route; task is the route's."""

    audio: bytes
    task: str  # "transcribe" | "translate"
    model: str | None = None
    language: str | None = None
    prompt: str | None = None
    temperature: float = 0.0
    response_format: str = "json"

    def check(self) -> None:
        """400 naming the field for a value spindle cannot serve."""
        if self.response_format not in RESPONSE_FORMATS:
            raise bad_request(f"response_format must be one of "
                              f"{', '.join(map(repr, RESPONSE_FORMATS))}, got "
                              f"{self.response_format!r}", "response_format")
        if not 0.0 <= self.temperature <= 1.0:
            raise bad_request(f"temperature must be between 0 and 1, got {self.temperature}",
                              "temperature")


@dataclass(frozen=True)
class AudioCheckpoint:
    """What a Whisper checkpoint's files say about the audio it takes."""

    sampling_rate: int
    chunk_length: float  # seconds of audio per window
    hop_length: int  # samples per feature frame (a segment's seek counts these)
    generation_config: dict[str, Any]

    @classmethod
    def read(cls, model_dir: str, hf_config: Any) -> "AudioCheckpoint":
        directory = Path(model_dir)
        extractor = {**_EXTRACTOR_DEFAULTS, **_json_file(directory / "preprocessor_config.json")}
        generation = _json_file(directory / "generation_config.json")
        generation.setdefault("decoder_start_token_id",
                              getattr(hf_config, "decoder_start_token_id", None))
        return cls(int(extractor["sampling_rate"]), float(extractor["chunk_length"]),
                   int(extractor["hop_length"]), generation)


class TranscriptionServing(OpenAIServing):
    def __init__(self, engine: Any, models: ServedModels,
                 max_audio_seconds: float = MAX_AUDIO_SECONDS) -> None:
        super().__init__(engine, models)
        self.max_audio_seconds = max_audio_seconds
        self._checkpoint: AudioCheckpoint | None = None

    async def create(self, req: TranscriptionRequest, request_id: str) -> dict[str, Any] | Response:
        self.models.resolve(req.model)
        req.check()
        checkpoint = self.audio_checkpoint(req.model)
        await self._prompt_ids(req, checkpoint)  # (a bad language: 400 before decoding)
        try:
            waveform, duration = await asyncio.to_thread(self._load_audio, req.audio, checkpoint)
        except AudioError as e:
            raise bad_request(str(e), "file") from None
        windows = split_windows(waveform, checkpoint.sampling_rate, checkpoint.chunk_length)
        if req.language is None:
            req = replace(req, language=await self._detect_language(
                request_id, checkpoint, windows[0][2]))
        prompt_ids = await self._prompt_ids(req, checkpoint)
        segments = await self._transcribe(request_id, req, checkpoint, prompt_ids, windows)
        return _render(req, segments, duration)

    async def _detect_language(self, request_id: str, checkpoint: AudioCheckpoint,
                               samples: Any) -> str | None:
        """The language Whisper detects on the first window (whisper_prompt.
        language_detection); None (the default language) for an English-only checkpoint."""
        detection = await self.engine.with_tokenizer(lambda tokenizer: language_detection(
            tokenizer, checkpoint.generation_config, samples, checkpoint.sampling_rate))
        if detection is None:
            return None
        prompt, params, codes = detection
        (output,) = await final_outputs(await self.start(f"{request_id}-language", [prompt],
                                                         params))
        raise_if_aborted(output.outputs[0])
        return codes[output.outputs[0].token_ids[0]]

    async def _transcribe(self, request_id: str, req: TranscriptionRequest,
                          checkpoint: AudioCheckpoint, prompt_ids: list[int],
                          windows: list[tuple[float, float, Any]]) -> list[Segment]:
        """One request per window, all at once (the engine batches them); a segment each."""
        params = SamplingParams(
            temperature=req.temperature, max_tokens=self.engine.config.model.max_model_len
            - len(prompt_ids), logprobs=0 if req.response_format == "verbose_json" else None)
        prompts = [{"prompt_token_ids": prompt_ids,
                    "multi_modal_data": {"audio": (samples, checkpoint.sampling_rate)}}
                   for _, _, samples in windows]
        outputs = await final_outputs(await self.start(request_id, prompts, params))
        special = await self.special_token_ids()
        return [segment_of(start, end, output, req.temperature, special,
                           seek=round(start * checkpoint.sampling_rate) // checkpoint.hop_length)
                for (start, end, _), output in zip(windows, outputs)]

    def audio_checkpoint(self, requested: str | None) -> AudioCheckpoint:
        """The served checkpoint's audio settings; 400 when it is not a Whisper model."""
        model_config = self.engine.config.model
        if WHISPER_ARCHITECTURE not in (model_config.hf_config.architectures or ()):
            name = requested or self.models.names[0]
            raise bad_request(f"the model {name!r} does not serve audio: transcriptions and "
                              f"translations need a Whisper checkpoint ({WHISPER_ARCHITECTURE})",
                              "model")
        if self._checkpoint is None:
            self._checkpoint = AudioCheckpoint.read(model_config.model, model_config.hf_config)
        return self._checkpoint

    async def _prompt_ids(self, req: TranscriptionRequest,
                          checkpoint: AudioCheckpoint) -> list[int]:
        max_prompt_tokens = self.engine.config.model.max_model_len // 2 - 1  # as Whisper keeps
        try:
            return await self.engine.with_tokenizer(lambda tokenizer: decoder_prompt_ids(
                tokenizer, checkpoint.generation_config, req.language, req.task, req.prompt,
                max_prompt_tokens=max_prompt_tokens))
        except ValueError as e:  # (the task is the route's: the language is at fault)
            raise bad_request(str(e), "language") from None

    def _load_audio(self, data: bytes, checkpoint: AudioCheckpoint) -> tuple[Any, float]:
        """The upload decoded, at the checkpoint's rate, and its duration in seconds
        (AudioError for bad audio)."""
        waveform, rate = decode_audio(data, max_seconds=self.max_audio_seconds)
        return resample(waveform, rate, checkpoint.sampling_rate), len(waveform) / rate


def segment_of(start: float, end: float, output: RequestOutput, temperature: float,
               special: frozenset[int], seek: int) -> Segment:
    """A window's output as a segment: its tokens without a final hidden stop token, its
    mean logprob (the routes and `spindle transcribe`)."""
    completion = output.outputs[0]
    raise_if_aborted(completion)
    tokens = completion.token_ids[:logprob_token_count(completion, special, True)]
    return Segment(start=start, end=end, text=completion.text, tokens=tuple(tokens), seek=seek,
                   temperature=temperature, avg_logprob=_avg_logprob(completion))


def _avg_logprob(completion: CompletionOutput) -> float:
    """The mean logprob of every generated token, end of text included (as Whisper counts
    it); 0.0 when the request asked for no logprobs."""
    total = completion.cumulative_logprob
    if total is None or not completion.token_ids:
        return 0.0
    return finite_logprob(total / len(completion.token_ids)) or 0.0


def _render(req: TranscriptionRequest, segments: list[Segment],
            duration: float) -> dict[str, Any] | Response:
    language = (req.language or DEFAULT_LANGUAGE).strip().lower()
    body = render(req.response_format, segments, req.task, language, duration)
    if isinstance(body, dict):
        return body
    return Response(body, media_type=_TEXT_MEDIA_TYPES[req.response_format])


def _json_file(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with open(path) as f:
        return json.load(f)


# ---- routes -----------------------------------------------------------------------------
async def _form(file: UploadFile = File(...), model: str | None = Form(None),
                language: str | None = Form(None), prompt: str | None = Form(None),
                temperature: float = Form(0.0), response_format: str = Form("json"),
                stream: bool = Form(False),
                timestamp_granularities: list[str] = Form([], alias="timestamp_granularities[]"),
                ) -> TranscriptionRequest:
    """The form both routes take, as a transcription (the translation route sets its task)."""
    if stream:
        raise bad_request("stream is not supported for audio", "stream")
    if "word" in timestamp_granularities:
        raise bad_request("word timestamps are not supported (segment timestamps are)",
                          "timestamp_granularities")
    return TranscriptionRequest(audio=await file.read(), task="transcribe", model=model or None,
                                language=language or None, prompt=prompt,
                                temperature=temperature, response_format=response_format)


@router.post("/v1/audio/transcriptions")
async def create_transcription(request: Request,
                               body: TranscriptionRequest = Depends(_form)) -> Response:
    return await _serve(request, "trsc", body)


@router.post("/v1/audio/translations")
async def create_translation(request: Request,
                             body: TranscriptionRequest = Depends(_form)) -> Response:
    return await _serve(request, "trsl", replace(body, task="translate"))


async def _serve(request: Request, prefix: str, body: TranscriptionRequest) -> Response:
    from spindle.entrypoints.openai.api_server import serve_request

    return await serve_request(request, prefix, "prompt", lambda request_id:
                               request.app.state.routes.route(body.model).transcriptions.create(
                                   body, request_id))
