"""Typed engine configuration, built and validated once.

EngineArgs is the flat, user-facing list of knobs (the LLM constructor and the CLI
are both generated from its fields, so they cannot drift). create_engine_config()
turns it into frozen per-concern configs and raises ValueError naming the field and
the allowed values for anything out of range.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

_DTYPES = {
    "float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
    "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}
EXECUTOR_BACKENDS = ("uni", "mp", "ray")
WORKER_START_METHODS = ("auto", "fork", "spawn")
TASKS = ("auto", "generate", "embed")
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")
LOAD_FORMATS = ("auto", "dummy")
SPECULATIVE_METHODS = ("ngram", "draft_model")
DEFAULT_SPECULATION_BATCH_LIMIT = 4
DEVICES = ("auto", "cpu", "cuda")
# A fixed budget, not a share of free RAM: the same inputs give the same block count.
DEFAULT_CPU_KV_CACHE_GB = 4.0


def _arg(default: Any, help: str, **extra: Any) -> Any:
    return field(default=default, metadata={"help": help, **extra})


@dataclass
class EngineArgs:
    model: str = _arg(None, "Path to a Hugging Face checkpoint directory.")
    tokenizer: str | None = _arg(None, "Tokenizer directory (default: the model's).")
    dtype: str = _arg("auto", "Weight and activation dtype: auto (the checkpoint's; "
                      "float32 on CPU for half checkpoints; for a GGUF file on the CPU, "
                      "bfloat16 where the CPU computes in bf16, else float32), float32, "
                      "float16, bfloat16.")
    max_model_len: int | None = _arg(None, "Longest prompt + output in tokens "
                                     "(default: the model's max_position_embeddings).")
    seed: int = _arg(0, "Seed for weights-independent randomness (sampling without a request seed).")
    block_size: int = _arg(16, "Tokens per KV cache block.")
    enable_prefix_caching: bool = _arg(True, "Reuse KV blocks of identical prompt prefixes.")
    kv_cache_memory_bytes: int | None = _arg(None, "Pin the KV cache size in bytes, per "
                                             "worker (default: on GPU, measured from free "
                                             "memory; on CPU, cpu_kv_cache_gb).")
    gpu_memory_utilization: float = _arg(0.9, "Fraction of GPU memory the engine may use.")
    state_snapshot_slots: int | None = _arg(
        None, "Models with state-space layers, with prefix caching: state slots kept as "
        "prefix-cache entries (each layer's state at a block boundary), beside one per "
        "running sequence (default: max_num_seqs, within a quarter of the cache budget; "
        "0 turns prefix caching off for such models).")
    cpu_kv_cache_gb: float = _arg(
        DEFAULT_CPU_KV_CACHE_GB, "On CPU: GiB of RAM for the KV cache, shared by the "
        "engine's workers; capped by what max_num_seqs sequences of max_model_len tokens "
        "can use and by half of the available RAM.")
    max_num_seqs: int = _arg(256, "Most sequences in one step.")
    max_n: int = _arg(128, "Most samples (n) one request may ask for; more are refused "
                      "with a ValueError (400 from the server).")
    max_num_batched_tokens: int | None = _arg(None, "Token budget of one step "
                                              "(default: max(2048, max_model_len) capped at 8192).")
    enable_chunked_prefill: bool = _arg(True, "Split long prompts across steps.")
    max_num_encoder_tokens: int | None = _arg(
        None, "Encoder-decoder models (Whisper): encoder positions one step may compute, "
        "the encoder's compute budget (a Whisper window is 1500); requests whose encoder "
        "would pass it wait for a later step (default: max_num_batched_tokens, and at "
        "least 8 encoder inputs).")
    async_scheduling: bool = _arg(True, "Schedule and launch the next step while the "
                                  "current one runs on the device (uni and mp executors, without PP).")
    tensor_parallel_size: int = _arg(1, "Number of tensor-parallel ranks.")
    pipeline_parallel_size: int = _arg(1, "Number of pipeline stages.")
    pipeline_layer_partition: list[int] | None = _arg(
        None, "Decoder layers per pipeline stage (e.g. 3,5); default: an even split.")
    max_concurrent_batches: int | None = _arg(
        None, "Batches in flight at once with pipeline parallelism (default: "
        "pipeline_parallel_size, so that no stage idles; 1: one batch at a time).")
    distributed_executor_backend: str | None = _arg(None, "uni, mp or ray (default: uni "
                                                    "for one worker, mp for more).")
    worker_start_method: str = _arg(
        "auto", "How the mp backend starts worker processes: fork (CPU workers only; a "
        "script then needs no `if __name__ == '__main__':` guard), spawn (fresh "
        "interpreters, which run the main script again: it must be guarded), or auto "
        "(fork for CPU workers unless this process holds a CUDA context, else spawn).")
    step_timeout_s: float = _arg(900.0, "With the mp or ray backend: seconds a model step may "
                                 "take before it is taken for a hung worker; the executor "
                                 "then fails, naming where every rank is.")
    ray_address: str | None = _arg(None, "For the ray backend: the cluster to join (default: "
                                   "RAY_ADDRESS, else a Ray instance started for this engine).")
    ray_placement_strategy: str = _arg("PACK", "For the ray backend: placement group strategy "
                                       "(PACK, SPREAD, STRICT_PACK, STRICT_SPREAD).")
    device: str = _arg("auto", "cpu, cuda or auto.")
    device_ids: list[int] | None = _arg(None, "Device ids for the workers, one per worker "
                                        "(e.g. 2,3), as this process sees them: after "
                                        "CUDA_VISIBLE_DEVICES. The CPU has only device 0.")
    enforce_eager: bool = _arg(False, "Disable CUDA graphs.")
    cpu_threads: int | None = _arg(None, "Torch threads of each worker on the CPU (default: "
                                   "the cores this process may use, split among the "
                                   "workers; the in-process executor keeps torch's own "
                                   "setting). With the in-process executor this sets "
                                   "torch's thread count for the whole process.")
    attention_backend: str | None = _arg(None, "Attention backend: triton (CUDA default) or "
                                         "torch_sdpa (CPU default; the reference on CUDA).")
    max_cudagraph_batch_size: int | None = _arg(None, "Largest decode batch replayed from a "
                                                "CUDA graph (default: max_num_seqs, at most 512).")
    batch_invariant: bool = _arg(False, "Batch-invariant numerics: a request's tokens and "
                                 "logprobs are bitwise the same whatever shares its batch, "
                                 "however its prompt is chunked and whether its prefix came "
                                 "from the cache (fixed-order matmuls, attention and sampling; "
                                 "slower). Decoder models with full attention, without "
                                 "speculative decoding.")
    load_format: str = _arg("auto", "auto (the checkpoint's safetensors) or dummy (random "
                            "weights, reading only config.json and the tokenizer: for "
                            "benchmarks of shapes without a checkpoint).")
    quantization: str | None = _arg(
        None, "Weight quantization: fp8 (float8 e4m3 weights with a scale per output "
        "channel, quantized at load, and activations scaled per token; CUDA compute "
        "capability 8.9+ or the CPU); gguf (a GGUF file's 4- and 8-bit matrices kept as "
        "they are stored, through int4 matmuls: CPU only); or none. Default: fp8 for "
        "checkpoints stored in fp8 (transformers' fp8 or compressed-tensors), gguf for a "
        "GGUF file on the CPU, none otherwise; none loads an fp8 checkpoint or a GGUF file "
        "dequantized to dtype.")
    task: str = _arg("auto", "generate (text) or embed (one pooled vector per prompt); auto: "
                     "embed for encoder-only models, generate otherwise.")
    pooling_type: str | None = _arg(None, "For task=embed: mean, cls or last (default: the "
                                    "checkpoint's sentence-transformers config, else cls for "
                                    "encoders and last for decoders).")
    normalize_embeddings: bool | None = _arg(None, "For task=embed: L2-normalise embeddings "
                                             "(default: the checkpoint's config, else yes).")
    logprobs_mode: str = _arg("raw_logprobs", "What logprobs describe: raw_logprobs (the "
                              "model's distribution) or processed_logprobs (the one a token was "
                              "drawn from: after penalties, and temperature, min-p, top-k and "
                              "top-p for sampled requests).")
    speculative_config: dict | None = _arg(
        None, "Speculative decoding, as JSON: {\"method\": \"ngram\" | \"draft_model\", "
        "\"num_speculative_tokens\": k, and for ngram \"prompt_lookup_min\" / "
        "\"prompt_lookup_max\" (n-gram sizes, default 1 / 4), for draft_model \"model\" "
        "(a checkpoint directory with the target's vocabulary); \"disable_by_batch_size\": "
        "speculate only in steps with fewer running requests (default 4: measured on an "
        "H200, n-gram speculation doubles batch-1 decode and loses from 4 requests on).")
    enable_prompt_embeds: bool = _arg(False, "Accept prompts given as embeddings "
                                      "({'prompt_embeds': tensor}); needs prefix caching off.")
    enable_sleep_mode: bool = _arg(False, "Allow sleep(level=1|2): weights and KV cache give "
                                   "their device memory back until wake_up (turns on the "
                                   "cumem allocator on CUDA).")
    enable_cumem_allocator: bool = _arg(False, "Back weights and KV cache by CUDA virtual "
                                        "memory (tagged pools); CUDA only.")
    sleep_mode_backend: str | None = _arg(None, "Sleep-mode backend: cumem (CUDA default: "
                                          "addresses and CUDA graphs survive sleep), portable "
                                          "(any device; moves tensors out and back), or one "
                                          "registered by a plugin.")
    scheduling_policy: str = _arg("fcfs", "Which waiting request is admitted first: fcfs "
                                  "(first come, first served) or priority (the request's "
                                  "priority, lower first, then arrival; running requests "
                                  "of the lowest priority are preempted first).")
    enable_lora: bool = _arg(False, "Serve LoRA adapters (PEFT's format) beside the base "
                             "model: a request names one with a LoRARequest (the server: "
                             "with --lora-modules and the request's model).")
    max_loras: int = _arg(1, "With enable_lora: adapters the running requests may use at "
                          "once (each has a slot of device memory in every adapted "
                          "layer; a request whose adapter would be one more waits).")
    max_lora_rank: int = _arg(16, "With enable_lora: the largest adapter rank served (the "
                              "slots' size).")
    mm_ipc_gpu_memory_gb: float = _arg(0.0, "GiB of device memory set aside before the KV "
                                       "cache is sized, for decoded media: encoder-decoder "
                                       "models (Whisper) stage each step's encoder inputs in "
                                       "a buffer of this size, and a step starts no more "
                                       "than it holds.")

    def create_engine_config(self) -> "EngineConfig":
        from spindle.platforms import resolve_platform

        platform = resolve_platform(self.device)
        parallel = ParallelConfig.create(self)
        if parallel.distributed_executor_backend == "uni":  # the worker is in this process
            _start_in_process_worker_device(parallel, platform)
        model = ModelConfig.create(self, platform.device_type)
        sched = SchedulerConfig.create(self, model)
        config = EngineConfig(
            model=model,
            cache=_cache_config(self, model),
            parallel=parallel,
            scheduler=sched,
            device=DeviceConfig.create(self, platform),
            pooler=_pooler_config(self, model, sched),
            memory=MemoryConfig.create(self, platform),
            speculative=SpeculativeConfig.create(self.speculative_config, model, parallel),
            lora=LoRAConfig.create(self, model),
        )
        if config.device.batch_invariant:
            _check_batch_invariance_fits(config)
        if parallel.pipeline_parallel_size > 1:
            _check_pipeline_stages_fit(config)
        from spindle.runner.model_states import check_config

        check_config(config)  # the runner refuses what the model's state cannot serve
        return config


def _start_in_process_worker_device(parallel: ParallelConfig, platform) -> None:
    """Work the worker's start would begin with, begun now on threads so that it runs
    beside the config's import of transformers: Triton's cache key, and the device's
    runtime (platform.start_device_in_background). A bad device id is left for the
    executor to report."""
    from spindle.executor.devices import worker_device_indices

    if platform.compiles_kernels_on_first_use:
        from spindle.runner.compile_ahead import hash_triton_in_background

        hash_triton_in_background()
    try:
        index = worker_device_indices(parallel, platform)[0]
    except ValueError:
        return
    platform.start_device_in_background(platform.device_for_rank(index))


# The default encoder budget holds at least this many encoder inputs (Whisper windows):
# one a step would start requests one at a time, each step paying a whole eager step.
DEFAULT_ENCODER_INPUTS_PER_STEP = 8
API_KEY_ENV = "SPINDLE_API_KEY"  # the default of --api-key (spindle serve)


@dataclass
class ServerArgs:
    """Options of the OpenAI-compatible server (`spindle serve`), checked when made, so
    that a bad one is refused before the engine starts."""

    api_key: str | None = _arg(None, "Require `Authorization: Bearer KEY` on every route "
                               "but /health, /metrics and /version (the /v1 and dev routes) "
                               f"(default: ${API_KEY_ENV} when set, else no key).")
    allowed_origins: list[str] | None = _arg(
        None, "Browser origins allowed to call the server (CORS), e.g. "
        "https://app.example.com; repeat the flag for more, * for any (default: none, "
        "CORS off).")
    allowed_methods: list[str] | None = _arg(None, "With --allowed-origins: the HTTP methods "
                                             "a browser may use (default: all).")
    allowed_headers: list[str] | None = _arg(None, "With --allowed-origins: the request "
                                             "headers a browser may send (default: all).")
    allow_credentials: bool = _arg(False, "With --allowed-origins: let browsers send "
                                   "credentials (cookies, Authorization) cross-origin.")
    max_request_body_bytes: int = _arg(16 * 2**20, "Largest request body accepted, in "
                                       "bytes; a larger one gets 413 (default: 16 MiB).")
    max_audio_seconds: float = _arg(3600.0, "Longest audio upload /v1/audio/transcriptions "
                                    "and /v1/audio/translations accept, in seconds; a "
                                    "longer one gets 400 (default: one hour).")
    tool_call_parser: str | None = _arg(
        None, "How chat answers with tool_choice auto are read for tool calls: hermes "
        "(<tool_call>{...}</tool_call> blocks: Hermes, Qwen 2.5 and 3), llama3_json "
        "(Llama 3.1-3.3's JSON calls) or mistral ([TOOL_CALLS]). Default: none, and "
        "requests with tools must then force a choice (required or a named function).")
    reasoning_parser: str | None = _arg(
        None, "Split a reasoning model's <think>...</think> off its chat answers into "
        "reasoning_content: qwen3 (the answer opens <think> itself) or deepseek_r1 (the "
        "template opens it: DeepSeek-R1, Qwen3 2507 thinking). Default: none, all content.")
    lora_modules: list[str] | None = _arg(
        None, "LoRA adapters served as models of their own, NAME=PATH (a PEFT adapter "
        "directory; repeat the flag for more): a request whose model is NAME runs with that "
        "adapter. Needs --enable-lora.")
    allow_runtime_lora_updating: bool = _arg(
        False, "Mount POST /v1/load_lora_adapter ({\"lora_name\", \"lora_path\"}) and "
        "/v1/unload_lora_adapter ({\"lora_name\"}): adapters added and removed while the "
        "server runs. Needs --enable-lora.")

    def __post_init__(self) -> None:
        from spindle.entrypoints.reasoning import REASONING_PARSERS

        self.lora_requests()  # (a malformed --lora-modules fails here)
        from spindle.entrypoints.tool_calls import TOOL_CALL_PARSERS

        _require(self.tool_call_parser in (None, *TOOL_CALL_PARSERS), "tool_call_parser",
                 self.tool_call_parser, f"one of {', '.join(TOOL_CALL_PARSERS)}")
        _require(self.reasoning_parser in (None, *REASONING_PARSERS), "reasoning_parser",
                 self.reasoning_parser, f"one of {', '.join(REASONING_PARSERS)}")
        if self.api_key is not None:
            _require(bool(self.api_key) and self.api_key.isascii() and self.api_key.isprintable()
                     and not any(c.isspace() for c in self.api_key), "api_key", "<hidden>",
                     "a non-empty string of printable ASCII characters without spaces")
        _require(_is_int(self.max_request_body_bytes) and self.max_request_body_bytes >= 1,
                 "max_request_body_bytes", self.max_request_body_bytes, "an integer >= 1")
        _require(_is_real(self.max_audio_seconds) and self.max_audio_seconds > 0,
                 "max_audio_seconds", self.max_audio_seconds, "a number of seconds > 0")
        for name in ("allowed_origins", "allowed_methods", "allowed_headers"):
            values = getattr(self, name)
            _require(values is None or all(isinstance(v, str) and v for v in values), name,
                     values, "a list of non-empty strings")
        if self.allowed_origins is None:
            for name in ("allowed_methods", "allowed_headers", "allow_credentials"):
                _require(not getattr(self, name), name, getattr(self, name),
                         "left unset without allowed_origins (CORS is off)")


    def lora_requests(self) -> dict:
        """--lora-modules as {name: LoRARequest}, ids 1, 2, ... in flag order."""
        from spindle.lora import LoRARequest

        adapters = {}
        for i, entry in enumerate(self.lora_modules or []):
            name, sep, path = str(entry).partition("=")
            _require(bool(sep and name and path), "lora_modules", entry, "NAME=PATH")
            _require(name not in adapters, "lora_modules", entry, "one entry per name")
            adapters[name] = LoRARequest(name, i + 1, path)
        return adapters


@dataclass
class PoolArgs:
    """Options of a server of several models (`spindle serve PATH_A PATH_B ...`, a
    ModelPool), checked when made."""

    max_awake_models: int = _arg(1, "Most models awake at once; the others sleep until a "
                                 "request needs them.")
    device_memory_budget: float | None = _arg(
        None, "GiB of device memory the awake models' weights and KV caches may hold "
        "together (default: no limit beyond --max-awake-models).")
    sleep_level: str = _arg("auto", "How models sleep: auto (level 1, weights kept in host "
                            "RAM, while the host has room for them; else level 2, weights "
                            "reloaded from the checkpoint), 1 or 2; one value for every "
                            "model, or one per model, comma-separated.")
    swap_time_slice: float = _arg(5.0, "Seconds a busy model keeps the device while another "
                                  "model's requests wait; then its own requests freeze until "
                                  "its next turn.")
    model_overrides: dict | None = _arg(
        None, 'Engine options of single models, as JSON: {"NAME": {"gpu_memory_utilization": '
        '0.4}} (NAME as served).')

    def __post_init__(self) -> None:
        _require(_is_int(self.max_awake_models) and self.max_awake_models >= 1,
                 "max_awake_models", self.max_awake_models, "an integer >= 1")
        _require(self.device_memory_budget is None or (_is_real(self.device_memory_budget)
                                                       and self.device_memory_budget > 0),
                 "device_memory_budget", self.device_memory_budget, "a positive number of GiB")
        _require(_is_real(self.swap_time_slice) and self.swap_time_slice >= 0,
                 "swap_time_slice", self.swap_time_slice, "a number of seconds >= 0")
        if isinstance(self.model_overrides, str):
            self.model_overrides = _json_object("model_overrides", self.model_overrides)
        overrides = self.model_overrides
        _require(overrides is None or (isinstance(overrides, dict) and all(
            isinstance(v, dict) for v in overrides.values())), "model_overrides", overrides,
            'a JSON object of objects, {"NAME": {"FIELD": VALUE}}')
        known = {f.name for f in dataclasses.fields(EngineArgs)} - {"model"}
        for name, fields in (overrides or {}).items():
            unknown = sorted(set(fields) - known)
            _require(not unknown, "model_overrides", f"{name}: {', '.join(unknown)}",
                     "engine options (EngineArgs fields other than model)")
        self._sleep_level_values()  # checked now; their count once the models are known

    def _sleep_level_values(self) -> list[str]:
        values = [v.strip() for v in str(self.sleep_level).split(",")]
        _require(all(v in ("auto", "1", "2") for v in values), "sleep_level", self.sleep_level,
                 "auto, 1 or 2, or a comma-separated list of them, one per model")
        return values

    def sleep_levels(self, num_models: int) -> list[int | str]:
        """One sleep level per model: "auto", 1 or 2."""
        values = self._sleep_level_values()
        if len(values) == 1:
            values *= num_models
        _require(len(values) == num_models, "sleep_level", self.sleep_level,
                 f"one value, or one per model ({num_models})")
        return [v if v == "auto" else int(v) for v in values]


@dataclass(frozen=True)
class ModelConfig:
    model: str
    tokenizer: str
    dtype: torch.dtype
    max_model_len: int
    seed: int
    hf_config: Any = field(compare=False, repr=False)
    model_kind: str = "decoder"  # what the model class declares: "decoder" | "encoder"
    task: str = "generate"  # "generate" | "embed"
    enable_prompt_embeds: bool = False
    logprobs_mode: str = "raw_logprobs"  # see LOGPROBS_MODES
    quantization: str | None = None  # "fp8" (spindle.layers.fp8) or None
    load_format: str = "auto"  # see LOAD_FORMATS
    fp8_checkpoint: Any = None  # the checkpoint's float8 layout (models/fp8_checkpoint.py)
    gguf_file: str | None = None  # the GGUF file `model` was converted from (models/gguf.py)
    # Encoder-decoder models: the positions one encoder input makes (Whisper: 1500),
    # and the bytes of one input as the runner stages it (Whisper: float32 features).
    encoder_positions: int = 0
    encoder_input_bytes: int = 0
    # LongRoPE's original length where max_model_len goes past it: a sequence longer
    # than that rotates by the long factors, re-encoded once as it grows past it.
    long_rope_from: int | None = None

    @property
    def architecture(self) -> str:
        return self.hf_config.architectures[0]

    @property
    def vocab_size(self) -> int:
        return self.hf_config.vocab_size

    @staticmethod
    def create(args: EngineArgs, device_type: str) -> "ModelConfig":
        from spindle.models.fp8_checkpoint import fp8_checkpoint_format

        path, gguf_file = _resolve_model(args.model)
        hf_config = _load_hf_config(path)
        fp8_checkpoint = fp8_checkpoint_format(hf_config)
        quantization = _resolve_quantization(args.quantization, fp8_checkpoint, gguf_file,
                                             device_type)
        dtype = _resolve_dtype(args.dtype, hf_config, device_type, gguf_file is not None)
        from spindle.layers.rotary import longrope_original_length
        from spindle.models.registry import model_kind, resolve_model_class

        model_class = resolve_model_class(hf_config.architectures)
        kind = model_kind(model_class)
        limit = getattr(hf_config, "max_position_embeddings", None) or 2048
        limit_what = f"the model's max_position_embeddings ({limit})"
        if hasattr(model_class, "max_model_len"):  # (RoBERTa's offset table, MPT's field)
            limit = model_class.max_model_len(hf_config)
            limit_what = f"the longest context the model takes ({limit})"
        max_model_len = args.max_model_len or limit
        _require(isinstance(max_model_len, int) and max_model_len >= 1, "max_model_len",
                 max_model_len, "a positive integer")
        _require(max_model_len <= limit, "max_model_len", max_model_len, f"<= {limit_what}")
        _require(args.task in TASKS, "task", args.task, f"one of {TASKS}")
        task = args.task if args.task != "auto" else ("embed" if kind == "encoder" else "generate")
        _require(args.load_format in LOAD_FORMATS, "load_format", args.load_format,
                 f"one of {LOAD_FORMATS}")
        _require(args.logprobs_mode in LOGPROBS_MODES, "logprobs_mode", args.logprobs_mode,
                 f"one of {LOGPROBS_MODES}")
        _require(not (quantization == "gguf" and args.load_format == "dummy"), "load_format",
                 args.load_format, "auto with quantization='gguf' (the weights are the file's)")
        longrope = longrope_original_length(hf_config)
        encoder_positions = encoder_bytes = 0
        if hasattr(model_class, "encoder_input_positions"):
            encoder_positions = model_class.encoder_input_positions(hf_config)
            encoder_bytes = model_class.encoder_input_bytes(hf_config)
        return ModelConfig(model=str(path), tokenizer=str(args.tokenizer or path), dtype=dtype,
                           max_model_len=max_model_len, seed=args.seed, hf_config=hf_config,
                           model_kind=kind, task=task, encoder_positions=encoder_positions,
                           encoder_input_bytes=encoder_bytes,
                           enable_prompt_embeds=bool(args.enable_prompt_embeds),
                           logprobs_mode=args.logprobs_mode,
                           quantization=quantization,
                           fp8_checkpoint=fp8_checkpoint,
                           load_format=args.load_format,
                           gguf_file=str(gguf_file) if gguf_file is not None else None,
                           long_rope_from=(longrope if longrope is not None
                                           and max_model_len > longrope else None))


@dataclass(frozen=True)
class LoRAConfig:
    """LoRA adapters served beside the base model (spindle/lora/)."""

    max_loras: int
    max_lora_rank: int

    @staticmethod
    def create(args: EngineArgs, model: ModelConfig) -> "LoRAConfig | None":
        if not args.enable_lora:
            for name in ("max_loras", "max_lora_rank"):
                if getattr(args, name) != getattr(EngineArgs, name):
                    raise ValueError(f"{name} is set but enable_lora is off: pass "
                                     "enable_lora=True (--enable-lora) too")
            return None
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(args, name)
            _require(_is_int(value) and value >= 1, name, value, "an integer >= 1")
        _require(model.task == "generate" and model.model_kind in ("decoder", "hybrid"),
                 "enable_lora", True, f"a decoder model with task='generate' (not "
                 f"{model.architecture}, task={model.task!r})")
        _require(not args.batch_invariant, "enable_lora", True,
                 "off with batch_invariant (the adapters' matmuls are not fixed-order)")
        return LoRAConfig(max_loras=args.max_loras, max_lora_rank=args.max_lora_rank)


@dataclass(frozen=True)
class CacheConfig:
    block_size: int
    enable_prefix_caching: bool
    kv_cache_memory_bytes: int | None
    gpu_memory_utilization: float
    cpu_kv_cache_gb: float = DEFAULT_CPU_KV_CACHE_GB
    state_snapshot_slots: int | None = None

    @property
    def cpu_kv_cache_bytes(self) -> int:
        return int(self.cpu_kv_cache_gb * 2**30)

    @staticmethod
    def create(args: EngineArgs) -> "CacheConfig":
        _require(args.block_size in (1, 2, 4, 8, 16, 32, 64, 128), "block_size", args.block_size,
                 "a power of two from 1 to 128")
        _require(args.kv_cache_memory_bytes is None or args.kv_cache_memory_bytes > 0,
                 "kv_cache_memory_bytes", args.kv_cache_memory_bytes, "None or > 0")
        _require(0.0 < args.gpu_memory_utilization <= 1.0, "gpu_memory_utilization",
                 args.gpu_memory_utilization, "in (0, 1]")
        space = args.cpu_kv_cache_gb
        _require(_is_real(space) and space > 0, "cpu_kv_cache_gb", space, "a number of GiB > 0")
        snapshots = args.state_snapshot_slots
        _require(snapshots is None or (isinstance(snapshots, int) and snapshots >= 0),
                 "state_snapshot_slots", snapshots, "None or an integer >= 0")
        return CacheConfig(block_size=args.block_size, state_snapshot_slots=snapshots,
                           enable_prefix_caching=bool(args.enable_prefix_caching),
                           kv_cache_memory_bytes=args.kv_cache_memory_bytes,
                           gpu_memory_utilization=args.gpu_memory_utilization,
                           cpu_kv_cache_gb=float(space))


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int
    pipeline_parallel_size: int
    distributed_executor_backend: str
    device_ids: tuple[int, ...] | None
    pipeline_layer_partition: tuple[int, ...] | None = None
    ray_address: str | None = None
    ray_placement_strategy: str = "PACK"
    max_concurrent_batches: int = 1
    worker_start_method: str = "auto"
    step_timeout_s: float = 900.0

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @staticmethod
    def create(args: EngineArgs) -> "ParallelConfig":
        tp, pp = args.tensor_parallel_size, args.pipeline_parallel_size
        _require(isinstance(tp, int) and tp >= 1, "tensor_parallel_size", tp, "an integer >= 1")
        _require(isinstance(pp, int) and pp >= 1, "pipeline_parallel_size", pp, "an integer >= 1")
        backend = args.distributed_executor_backend or ("uni" if tp * pp == 1 else "mp")
        _require(backend in EXECUTOR_BACKENDS, "distributed_executor_backend", backend,
                 f"one of {EXECUTOR_BACKENDS}")
        _require(backend != "uni" or tp * pp == 1, "distributed_executor_backend", backend,
                 "'mp' or 'ray' when tensor_parallel_size * pipeline_parallel_size > 1")
        ids = tuple(args.device_ids) if args.device_ids is not None else None
        if ids is not None:
            _require(len(ids) == tp * pp and len(set(ids)) == len(ids), "device_ids", list(ids),
                     f"{tp * pp} distinct device ids (one per worker)")
            _require(all(isinstance(i, int) and i >= 0 for i in ids), "device_ids", list(ids),
                     "non-negative integers")
        partition = args.pipeline_layer_partition
        if partition is not None:
            partition = tuple(partition)
            _require(len(partition) == pp and all(isinstance(n, int) and n >= 1 for n in partition),
                     "pipeline_layer_partition", list(partition),
                     f"{pp} positive integers (layers per stage)")
        batches = args.max_concurrent_batches if args.max_concurrent_batches is not None else pp
        _require(isinstance(batches, int) and 1 <= batches <= max(pp, 1), "max_concurrent_batches",
                 batches, f"an integer in 1..pipeline_parallel_size ({pp})")
        strategies = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
        _require(args.ray_placement_strategy in strategies, "ray_placement_strategy",
                 args.ray_placement_strategy, f"one of {strategies}")
        _require(args.worker_start_method in WORKER_START_METHODS, "worker_start_method",
                 args.worker_start_method, f"one of {WORKER_START_METHODS}")
        timeout = args.step_timeout_s
        _require(_is_real(timeout) and math.isfinite(timeout) and timeout > 0,
                 "step_timeout_s", timeout, "a finite number of seconds > 0")
        return ParallelConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp,
                              distributed_executor_backend=backend, device_ids=ids,
                              pipeline_layer_partition=partition, ray_address=args.ray_address,
                              ray_placement_strategy=args.ray_placement_strategy,
                              max_concurrent_batches=batches,
                              worker_start_method=args.worker_start_method,
                              step_timeout_s=float(timeout))


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_chunked_prefill: bool
    async_scheduling: bool = False
    max_n: int = 128  # most samples one request may ask for
    max_num_encoder_tokens: int = 0  # encoder positions per step (encoder-decoder models)
    long_rope_from: int | None = None  # ModelConfig.long_rope_from
    max_loras: int = 0  # LoRA adapters the running requests may use at once (0: none served)
    scheduling_policy: str = "fcfs"  # or "priority" (engine/request_queue.py)

    @staticmethod
    def create(args: EngineArgs, model: ModelConfig) -> "SchedulerConfig":
        _require(isinstance(args.max_num_seqs, int) and args.max_num_seqs >= 1, "max_num_seqs",
                 args.max_num_seqs, "an integer >= 1")
        _require(args.scheduling_policy in ("fcfs", "priority"), "scheduling_policy",
                 args.scheduling_policy, "fcfs or priority")
        _require(_is_int(args.max_n) and args.max_n >= 1, "max_n", args.max_n,
                 "an integer >= 1")
        budget = args.max_num_batched_tokens or min(max(2048, model.max_model_len), 8192)
        _require(isinstance(budget, int) and budget >= 1, "max_num_batched_tokens", budget,
                 "an integer >= 1")
        if not args.enable_chunked_prefill:
            _require(budget >= model.max_model_len, "max_num_batched_tokens", budget,
                     f">= max_model_len ({model.max_model_len}) when chunked prefill is off")
        encoder_budget = _encoder_budget(args, model, budget) if model.encoder_positions else 0
        return SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=budget,
                               max_num_encoder_tokens=encoder_budget,
                               max_model_len=model.max_model_len,
                               enable_chunked_prefill=bool(args.enable_chunked_prefill),
                               async_scheduling=bool(args.async_scheduling), max_n=args.max_n,
                               long_rope_from=model.long_rope_from,
                               max_loras=args.max_loras if args.enable_lora else 0,
                               scheduling_policy=args.scheduling_policy)


def _encoder_budget(args: EngineArgs, model: ModelConfig, token_budget: int) -> int:
    """Encoder positions one step may compute: max_num_encoder_tokens, by default the
    step's token budget and at least DEFAULT_ENCODER_INPUTS_PER_STEP inputs; with
    mm_ipc_gpu_memory_gb, never more inputs than that media buffer holds."""
    positions = model.encoder_positions
    default = max(token_budget, DEFAULT_ENCODER_INPUTS_PER_STEP * positions)
    reserved = int(args.mm_ipc_gpu_memory_gb * 2**30)
    fit = reserved // model.encoder_input_bytes if reserved else None
    if fit is not None:
        _require(fit >= 1, "mm_ipc_gpu_memory_gb", args.mm_ipc_gpu_memory_gb,
                 f"0 or room for one encoder input ({model.encoder_input_bytes / 2**20:.2f} MiB)")
        default = min(default, fit * positions)
    encoder_budget = args.max_num_encoder_tokens or default
    _require(_is_int(encoder_budget) and encoder_budget >= positions, "max_num_encoder_tokens",
             encoder_budget, f"an integer >= one encoder input's positions ({positions})")
    if fit is not None:
        _require(encoder_budget <= fit * positions, "max_num_encoder_tokens", encoder_budget,
                 f"<= {fit * positions}: the {fit} encoder inputs mm_ipc_gpu_memory_gb's media "
                 "buffer holds")
    return encoder_budget


@dataclass(frozen=True)
class DeviceConfig:
    device_type: str  # "cpu" | "cuda"
    enforce_eager: bool  # True: no CUDA graphs (always on platforms without them)
    attention_backend: str
    max_cudagraph_batch_size: int
    batch_invariant: bool = False  # fixed-order numerics (layers/batch_invariant.py)
    cpu_threads: int | None = None  # torch threads per worker (None: executor's default)

    @staticmethod
    def create(args: EngineArgs, platform: Any) -> "DeviceConfig":
        from spindle.attention.backends.registry import BATCH_INVARIANT_BACKEND, registered_backends

        if args.batch_invariant:
            _require(args.attention_backend in (None, BATCH_INVARIANT_BACKEND),
                     "attention_backend", args.attention_backend,
                     f"unset (or {BATCH_INVARIANT_BACKEND!r}) with batch_invariant: its "
                     "attention has a fixed reduction order")
            backend = BATCH_INVARIANT_BACKEND
        else:
            backend = args.attention_backend or platform.default_attention_backend
        _require(backend in registered_backends(), "attention_backend", backend,
                 f"one of {registered_backends()}")
        graph_max = args.max_cudagraph_batch_size or min(args.max_num_seqs, 512)
        _require(isinstance(graph_max, int) and graph_max >= 1, "max_cudagraph_batch_size",
                 graph_max, "an integer >= 1")
        _require(args.cpu_threads is None or (_is_int(args.cpu_threads) and args.cpu_threads >= 1),
                 "cpu_threads", args.cpu_threads, "an integer >= 1 (or unset)")
        return DeviceConfig(device_type=platform.device_type,
                            enforce_eager=args.enforce_eager or not platform.supports_cuda_graphs(),
                            attention_backend=backend,
                            max_cudagraph_batch_size=min(graph_max, args.max_num_seqs),
                            batch_invariant=bool(args.batch_invariant),
                            cpu_threads=args.cpu_threads)


@dataclass(frozen=True)
class MemoryConfig:
    """How device memory is allocated and whether the engine may sleep."""

    enable_sleep_mode: bool = False
    enable_cumem_allocator: bool = False
    sleep_mode_backend: str | None = None  # None when sleep mode is off
    reserved_bytes: int = 0  # set aside before the KV cache is sized (mm_ipc_gpu_memory_gb)

    @staticmethod
    def create(args: EngineArgs, platform: Any) -> "MemoryConfig":
        _require(args.mm_ipc_gpu_memory_gb >= 0, "mm_ipc_gpu_memory_gb",
                 args.mm_ipc_gpu_memory_gb, ">= 0")
        reserved = int(args.mm_ipc_gpu_memory_gb * 2**30)
        backend = args.sleep_mode_backend
        if backend is not None and not args.enable_sleep_mode:
            raise ValueError("sleep_mode_backend is set but enable_sleep_mode is off: "
                             "pass enable_sleep_mode=True (--enable-sleep-mode) too")
        if not args.enable_sleep_mode:
            if args.enable_cumem_allocator and not platform.is_cumem_allocator_available():
                raise ValueError(f"enable_cumem_allocator needs CUDA and cuda-python "
                                 f"(cuda.bindings); not available on {platform!r}")
            return MemoryConfig(enable_cumem_allocator=bool(args.enable_cumem_allocator),
                                reserved_bytes=reserved)
        from spindle.memory.sleep_backend import default_backend_name, get_backend_class

        backend = backend or default_backend_name(platform)
        backend_class = get_backend_class(backend)  # ValueError naming the known backends
        backend_class.check_available(platform)  # ValueError saying what is missing
        cumem = bool(args.enable_cumem_allocator) or backend_class.needs_cumem_allocator
        return MemoryConfig(enable_sleep_mode=True, enable_cumem_allocator=cumem,
                            sleep_mode_backend=backend, reserved_bytes=reserved)


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (spindle/runner/spec_decode/): a proposer guesses
    num_speculative_tokens tokens per request and one target forward verifies them."""

    method: str  # one of SPECULATIVE_METHODS
    num_speculative_tokens: int
    prompt_lookup_min: int = 1  # ngram: shortest n-gram matched
    prompt_lookup_max: int = 4  # ngram: longest n-gram matched (tried first)
    draft: ModelConfig | None = None  # draft_model: the draft checkpoint's config
    # Steps with this many running requests or more do not speculate (docs/benchmarks.md:
    # on an H200 n-gram speculation gave 2.0x at batch 1 and 0.93x at batch 4).
    disable_by_batch_size: int = DEFAULT_SPECULATION_BATCH_LIMIT

    KEYS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
            "model", "disable_by_batch_size")

    @property
    def num_lookahead_tokens(self) -> int:
        """Cache slots past a step's tokens that proposing writes: a draft model writes
        its own keys and values for the tokens it proposes."""
        return self.num_speculative_tokens if self.method == "draft_model" else 0

    @staticmethod
    def create(spec: "dict | str | None", model: ModelConfig,
               parallel: "ParallelConfig") -> "SpeculativeConfig | None":
        if spec is None:
            return None
        if isinstance(spec, str):
            spec = _json_object("speculative_config", spec)
        _require(isinstance(spec, dict), "speculative_config", spec, "a dict (or a JSON object)")
        unknown = sorted(set(spec) - set(SpeculativeConfig.KEYS))
        _require(not unknown, "speculative_config", unknown,
                 f"keys among {SpeculativeConfig.KEYS}")
        method = spec.get("method")
        _require(method in SPECULATIVE_METHODS, "speculative_config.method", method,
                 f"one of {SPECULATIVE_METHODS}")
        k = spec.get("num_speculative_tokens")
        _require(_is_int(k) and 1 <= k <= 32, "speculative_config.num_speculative_tokens", k,
                 "an integer from 1 to 32")
        limit = spec.get("disable_by_batch_size", DEFAULT_SPECULATION_BATCH_LIMIT)
        _require(_is_int(limit) and limit >= 1, "speculative_config.disable_by_batch_size",
                 limit, "an integer >= 1")
        _check_speculation_fits(model, parallel)
        if method == "ngram":
            _require("model" not in spec, "speculative_config.model", spec.get("model"),
                     "left out for method 'ngram' (it proposes from the request's own tokens)")
            low, high = spec.get("prompt_lookup_min", 1), spec.get("prompt_lookup_max", 4)
            for name, value in (("prompt_lookup_min", low), ("prompt_lookup_max", high)):
                _require(_is_int(value) and value >= 1, f"speculative_config.{name}", value,
                         "an integer >= 1")
            _require(low <= high, "speculative_config.prompt_lookup_min", low,
                     f"<= prompt_lookup_max ({high})")
            return SpeculativeConfig(method, k, low, high, disable_by_batch_size=limit)
        for name in ("prompt_lookup_min", "prompt_lookup_max"):
            _require(name not in spec, f"speculative_config.{name}", spec[name] if name in spec
                     else None, "left out for method 'draft_model' (an ngram setting)")
        _require(spec.get("model") is not None, "speculative_config.model", None,
                 "a draft checkpoint directory for method 'draft_model'")
        draft = _draft_model_config(spec["model"], model)
        return SpeculativeConfig(method, k, draft=draft, disable_by_batch_size=limit)


def _check_speculation_fits(model: ModelConfig, parallel: "ParallelConfig") -> None:
    """What speculative decoding cannot serve, refused by name."""
    if model.task != "generate":
        raise ValueError(f"speculative_config needs task='generate', not {model.task!r}")
    if model.enable_prompt_embeds:
        raise ValueError("speculative_config cannot be combined with enable_prompt_embeds "
                         "(prompts given as embeddings have no token ids to propose from)")
    if parallel.pipeline_parallel_size > 1:
        raise ValueError("speculative_config is not supported with pipeline_parallel_size > 1")
    if model.model_kind != "decoder":
        raise ValueError(f"speculative_config needs a decoder model; {model.architecture} is "
                         f"a {model.model_kind!r} model (its state-space layers cannot roll "
                         "back rejected tokens)")


def _check_pipeline_stages_fit(config: "EngineConfig") -> None:
    """Refused by name before any worker starts: a model class that cannot be cut into
    stages, or a config that does not say how many layers there are to cut."""
    from spindle.models.registry import resolve_model_class

    hf_config = config.model.hf_config
    model_class = resolve_model_class(hf_config.architectures)
    if not getattr(model_class, "supports_pipeline_parallel", False):
        raise ValueError(f"{model_class.__name__} does not support pipeline_parallel_size > 1")
    if not isinstance(getattr(hf_config, "num_hidden_layers", None), int):
        raise ValueError("pipeline_parallel_size > 1 needs the model config's "
                         "num_hidden_layers, which it does not give")


def _check_batch_invariance_fits(config: "EngineConfig") -> None:
    """What batch_invariant cannot serve, refused by name (sliding-window layers are
    refused when the model is built: the runner names them)."""
    model = config.model
    if model.task != "generate":
        raise ValueError(f"batch_invariant needs task='generate', not {model.task!r}")
    if model.model_kind != "decoder":
        raise ValueError(f"batch_invariant needs a decoder model; {model.architecture} is a "
                         f"{model.model_kind!r} model (its state-space scan is chunked by the "
                         "schedule)")
    if model.quantization is not None:
        raise ValueError(f"batch_invariant cannot be combined with quantization="
                         f"{model.quantization!r}: its GEMMs have no fixed-order variant")
    if config.speculative is not None:
        raise ValueError("batch_invariant cannot be combined with speculative_config: "
                         "speculation runs only in small batches, so a sampled request's "
                         "random draws would change with what shares its batch")


def _draft_model_config(path: str, target: ModelConfig) -> ModelConfig:
    """The draft checkpoint's ModelConfig: the target's dtype and length limit, and a
    vocabulary of the target's size (token ids must mean the same in both)."""
    draft_dir = model_directory(path)
    hf_config = _load_hf_config(draft_dir)
    from spindle.models.registry import model_kind, resolve_model_class

    kind = model_kind(resolve_model_class(hf_config.architectures))
    if kind != "decoder":
        raise ValueError(f"speculative_config.model must be a decoder checkpoint; "
                         f"{draft_dir} holds a {kind!r} model")
    if hf_config.vocab_size != target.vocab_size:
        raise ValueError(f"speculative_config.model has a vocabulary of {hf_config.vocab_size} "
                         f"tokens, the target {target.vocab_size}: they must share a tokenizer")
    limit = getattr(hf_config, "max_position_embeddings", None) or 2048
    if limit < target.max_model_len:
        raise ValueError(f"the draft model handles {limit} positions, fewer than max_model_len "
                         f"({target.max_model_len}): lower max_model_len or pick another draft")
    return ModelConfig(model=str(draft_dir), tokenizer=target.tokenizer, dtype=target.dtype,
                       max_model_len=target.max_model_len, seed=target.seed, hf_config=hf_config)


def _json_object(name: str, text: str) -> Any:
    import json

    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{name} must be a JSON object, got {text!r}: {e}") from None


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    parallel: ParallelConfig
    scheduler: SchedulerConfig
    device: DeviceConfig
    pooler: Any = None  # spindle.pooler_config.PoolerConfig when task == "embed"
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    speculative: "SpeculativeConfig | None" = None
    lora: "LoRAConfig | None" = None  # set where LoRA adapters are served

    def replace(self, **changes: Any) -> "EngineConfig":
        return dataclasses.replace(self, **changes)


def _cache_config(args: EngineArgs, model: ModelConfig) -> CacheConfig:
    """The cache settings; encoder-decoder models without prefix caching: their decoder
    tokens say nothing of the audio their keys and values were computed from."""
    cache = CacheConfig.create(args)
    if model.model_kind == "encoder_decoder" and cache.enable_prefix_caching:
        logging.getLogger(__name__).info(
            "prefix caching is off for %s: an encoder-decoder's cached decoder blocks "
            "depend on the encoder's input, which block hashes do not cover", model.architecture)
        cache = dataclasses.replace(cache, enable_prefix_caching=False)
    return cache


def _pooler_config(args: EngineArgs, model: ModelConfig, sched: SchedulerConfig) -> Any:
    """The PoolerConfig of an embed engine (None for generate). Pooling prompts are
    never chunked, so the step budget must hold the longest one."""
    if model.task != "embed":
        return None
    from spindle.pooler_config import PoolerConfig

    pooler = PoolerConfig.create(model.model, model.model_kind, model.max_model_len,
                                 args.pooling_type, args.normalize_embeddings)
    _require(sched.max_num_batched_tokens >= pooler.max_seq_len, "max_num_batched_tokens",
             sched.max_num_batched_tokens,
             f">= the embedding truncation length ({pooler.max_seq_len}) for task='embed'")
    return pooler


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _require(ok: bool, name: str, value: object, allowed: str) -> None:
    if not ok:
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


def model_directory(model: str | os.PathLike | None) -> Path:
    """The checkpoint directory model names: a Hugging Face directory, a GGUF file
    (converted once, models/gguf.py), or a known short name (gguf.KNOWN_MODELS)."""
    return _resolve_model(model)[0]


def _resolve_model(model: str | os.PathLike | None) -> tuple[Path, Path | None]:
    """(checkpoint directory, the GGUF file it was converted from or None); see
    model_directory."""
    from spindle.models import gguf

    if model is None:
        raise ValueError("model must be a path to a Hugging Face checkpoint directory, got None")
    path = Path(model).expanduser()
    gguf_file = None
    try:
        if not path.exists() and str(model) in gguf.KNOWN_MODELS:
            path = gguf.known_model_file(str(model))
        if gguf.is_gguf_file(path):
            gguf_file = path.resolve()
            path = gguf.gguf_checkpoint(path)
    except gguf.GGUFUnavailable as e:
        raise ValueError(str(e)) from e
    if not path.is_dir():
        raise ValueError(f"model path {str(path)!r} does not exist or is not a directory "
                         "(spindle loads local Hugging Face checkpoint directories, GGUF "
                         f"files and the known models {', '.join(gguf.KNOWN_MODELS)})")
    if not (path / "config.json").is_file():
        raise ValueError(f"model path {str(path)!r} has no config.json: not a Hugging Face checkpoint")
    return path, gguf_file


def _load_hf_config(path: Path) -> Any:
    # transformers' AutoConfig, imported only now (hf_config.py).
    from spindle.hf_config import load_hf_config, read_config_json

    from spindle.models.registry import text_model_config

    raw = read_config_json(path)
    if not raw.get("architectures"):
        raise ValueError(f"{path / 'config.json'} names no 'architectures'")
    return text_model_config(load_hf_config(path, raw))


def _resolve_quantization(name: str | None, fp8_checkpoint: Any, gguf_file: Path | None,
                          device_type: str) -> str | None:
    """"fp8", "gguf" or None: the user's choice, else fp8 for a checkpoint stored in fp8
    and gguf for a GGUF file on the CPU."""
    from spindle.layers.fp8 import check_quantization

    if name is None:
        if fp8_checkpoint is not None:
            return "fp8"
        if gguf_file is None or device_type != "cpu":
            return None
        from spindle.models.gguf_weights import ARCHITECTURES, architecture_of

        return "gguf" if architecture_of(gguf_file) in ARCHITECTURES else None
    if name == "none":
        return None
    if name == "gguf":
        if gguf_file is None:
            raise ValueError("quantization='gguf' keeps a GGUF file's weights quantized; the "
                             "model is not a GGUF file")
        if device_type != "cpu":
            raise ValueError("quantization='gguf' runs on the CPU (torch's int4 CPU kernels); "
                             "on a GPU a GGUF file is read dequantized (quantization none)")
        return name
    check_quantization(name)
    return name


def _resolve_dtype(name: str, hf_config: Any, device_type: str,
                   from_gguf: bool = False) -> torch.dtype:
    if name == "auto" and from_gguf and device_type == "cpu":
        # The converted config says float32, which is the conversion's, not the
        # file's: compute in bf16 where the CPU has it (int4 matmuls run in bf16).
        from spindle.platforms.cpu import cpu_has_native_bf16

        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    if name == "auto":
        declared = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
        if isinstance(declared, str):
            declared = _DTYPES.get(declared, torch.float32)
        dtype = declared if isinstance(declared, torch.dtype) else torch.float32
        # Half precision on CPU is slow and inexact; follow vLLM and compute in float32.
        if device_type == "cpu" and dtype == torch.float16:
            dtype = torch.float32
        return dtype
    if name not in _DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(sorted(set(_DTYPES)))}, got {name!r}")
    return _DTYPES[name]
