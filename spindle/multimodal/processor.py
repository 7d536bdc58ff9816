"""Media inputs of a request, turned into what the model's encoder reads, before the
request reaches the engine core.

Audio (Whisper): a prompt dict with ``"multi_modal_data": {"audio": (waveform,
sample_rate)}`` (a 1-D float array, numpy or torch, or a list; any positive rate) is
resampled to the checkpoint's rate when it differs (audio_io.resample), then made
into log-mel features [mels, frames] by the checkpoint's own WhisperFeatureExtractor
(its preprocessor_config.json), padded to one window of ``chunk_length`` seconds.
Audio longer than one window is refused here: the transcription routes of the server
split it into windows, one request each.

The features are a float32 CPU tensor that travels with the request (once, when the
runner first sees it) and feeds the encoder in the step that computes the request's
first decoder token.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import torch

MM_KEY = "multi_modal_data"


def has_media(prompt: Any) -> bool:
    return isinstance(prompt, dict) and MM_KEY in prompt


class AudioFeatures:
    """The checkpoint's feature extractor, loaded once, safe to share between threads."""

    def __init__(self, model_dir: str | Path) -> None:
        from transformers import WhisperFeatureExtractor

        path = Path(model_dir) / "preprocessor_config.json"
        if not path.is_file():
            raise ValueError(f"{model_dir} has no preprocessor_config.json: an audio model needs "
                             "its feature extractor's settings (WhisperFeatureExtractor)")
        self.extractor = WhisperFeatureExtractor.from_pretrained(str(model_dir))
        self.sampling_rate = int(self.extractor.sampling_rate)
        self.window_samples = int(self.extractor.n_samples)
        self._lock = threading.Lock()  # (the extractor keeps no state, but to be sure)

    @property
    def window_seconds(self) -> float:
        return self.window_samples / self.sampling_rate

    def __call__(self, media: Any) -> torch.Tensor:
        """Features [mels, frames] of one prompt's multi_modal_data; ValueError naming
        what is wrong with it."""
        waveform = self.waveform(media)
        with self._lock:
            features = self.extractor(waveform, sampling_rate=self.sampling_rate,
                                      return_tensors="np").input_features[0]
        return torch.from_numpy(np.ascontiguousarray(features, dtype=np.float32))

    def waveform(self, media: Any) -> np.ndarray:
        """The checked mono waveform at the checkpoint's rate."""
        if not isinstance(media, dict) or set(media) != {"audio"}:
            keys = sorted(media) if isinstance(media, dict) else type(media).__name__
            raise ValueError(f"multi_modal_data must be {{'audio': (waveform, sample_rate)}} "
                             f"for this model, got {keys}")
        audio = media["audio"]
        if not isinstance(audio, (tuple, list)) or len(audio) != 2:
            raise ValueError("multi_modal_data['audio'] must be a pair (waveform, sample_rate)")
        waveform, rate = audio
        if isinstance(rate, bool) or not isinstance(rate, (int, np.integer)) or rate <= 0:
            raise ValueError(f"the audio's sample_rate must be a positive integer, got {rate!r}")
        if isinstance(waveform, torch.Tensor):
            waveform = waveform.detach().to("cpu", torch.float32).numpy()
        try:
            waveform = np.asarray(waveform, dtype=np.float32)
        except (TypeError, ValueError) as e:
            raise ValueError(f"the audio waveform must be an array of numbers: {e}") from None
        if waveform.ndim != 1:
            raise ValueError(f"the audio waveform must be 1-D (mono samples), got shape "
                             f"{waveform.shape}")
        if waveform.size == 0:
            raise ValueError("the audio is empty (0 samples)")
        if not np.isfinite(waveform).all():
            raise ValueError("the audio holds NaN or infinite samples")
        if rate != self.sampling_rate:
            from spindle.multimodal.audio_io import resample

            waveform = resample(waveform, int(rate), self.sampling_rate)
        if waveform.size > self.window_samples:
            raise ValueError(
                f"the audio is {waveform.size / self.sampling_rate:.2f} s long; one request "
                f"takes at most {self.window_seconds:g} s (the model's window): split longer "
                "audio into windows (the server's /v1/audio/transcriptions does)")
        return waveform
