#!/usr/bin/env bash
# What was built without a GPU and waits for one: its tests with the switches on, then
# the measurements that decide the switches' defaults. Run from the repository root on
# a CUDA machine (one H200 or H100). Results go to $OUT (default ./gpu_out). Each step
# is bounded so that one stuck step does not take the rest; the parts are meant for one
# device call each (each stays under the 10-minute limit of a call). On an H200, `h200`
# first: the measurements issue 16's open targets wait for, in one call.
#
#   bash benchmarks/pending_gpu_checks.sh [h200|pages|tests|models|ab|kernels|all]
#   (default: all)
#
# On the lent device machines (transformers 5.17 in the image; the tests' oracle for the
# newer families needs 5.25): download these wheels into .whl here and install them
# there first, as the device tool's README says (pip download --no-deps
# --only-binary=:all: --python-version 3.12 --platform manylinux_2_17_x86_64 ...):
#   transformers==5.25.0 huggingface_hub==2.4.0 kernels==0.19.1 httpx2==2.17.0
#   httpcore2==2.17.0 tomlkit==0.15.3 hf-xet==1.8.0 click==8.5.1 truststore==0.10.5
# then: pip install --no-index --no-deps --target /tmp/site .whl/*.whl and
# PYTHONPATH=/tmp/site:$PWD before this script.
#
# Pending (2026-12-07, forty-third session; one H100 after two failed H200 starts): `pages`
# passed on the H100 (14 kernel cases, 5 engine cases) and changed nothing there (the
# kernel reads at copy bandwidth on either layout and page size; nano 0.749 main against
# 0.746 head-major, six rounds). Still: on an H200, `h200` (now the kernel on both
# layouts and 16-/32-token pages first, then nano, then the advance's batch-1 A/B).
# Pending (2026-12-07, forty-second session; one H100 after an H200's failed start): every
# GPU test file has now run with the advance on (the first step of `tests`: 31, 28 hybrid,
# 57 more; none failed). Still: on an H200, `h200` first (its batch-1 A/B).
# New, written after the session's device time: SPINDLE_KV_HEAD_MAJOR=1 (off), KV pages
# allocated heads first (one head's page one run of 4 KiB instead of 16 pieces 2 KiB
# apart), for decode attention's 0.88 of copy bandwidth on the H200. Interpreter-tested
# only. On any GPU, `pages` (its GPU tests, the kernel alone in both layouts, nano A/B);
# on an H200 `h200` measures it too. On by default if it gains on the H200's nano.
# Pending (2026-12-07, forty-first session; one H100 after two failed starts):
# SPINDLE_GRAPH_ADVANCE is on by default now. With it and the ring on, test_cuda_e2e.py's
# first 50 cases (every CUDA-graph case among them), test_spec_decode_gpu.py and
# test_sleep_mode_gpu.py passed (60; the 51st is eager, the 52nd the pageable copies).
# First on any GPU: `tests`, which starts with the GPU files not yet run with the
# advance; on an H200, `h200` first: its batch-1 A/B (main, now with the advance, against
# SPINDLE_GRAPH_ADVANCE=0) says whether the default holds there.
# Pending (2026-12-07, fortieth session): test_compile_gpu.py whole passed on an H100 with
# both graph switches on (6, the mixed-steps case among them: its failure was likely the
# shared kernel plan, d92561e). Still to run with them: `tests`'s engine tests (first); on
# an H200 the batch-1 A/B (`h200`, first); then turn SPINDLE_GRAPH_ADVANCE on if it gains.
# Pending (2026-12-07, thirty-ninth session; one H100 after four failed starts): the
# decode graphs that advance their own inputs (SPINDLE_GRAPH_ADVANCE=1, with
# SPINDLE_GRAPH_TOKENS_TO_HOST=1 their tokens written to a pinned host ring), both off.
# First (`tests`): test_compile_gpu.py's mixed-steps case with and without them; with
# them it failed once on the H100 and the call ended before its message (the other
# compile cases, the kernel tests and test_cuda_e2e.py -k argmax passed with them; the
# kernel plan's fingerprint now covers the switches, d92561e: that case had loaded the
# first case's plan, made without its SPINDLE_DECODE_TARGET_PROGRAMS=16). If
# it passes with them, or fails without them too: on an H200 the batch-1 A/B (`h200`,
# first; the H100 gave +1.2% for either, 7 rounds), the rest of the engine tests with
# them (`tests`), and turn them on if they gain there.
# Pending (2026-12-07, thirty-eighth session; H100s only): on an H200, the `h200` part,
# which now also runs host_phases.py (a batch-1 step's host work phase by phase,
# unprofiled): on four H100 machines the device set the pace at batch 1 (host work
# 206-408 us a step against a 736-744 us replay) but for batch1_profile.py's unprofiled
# part on one (16 of 129 steps late, after its profiled runs in the same process). The
# tokens' copy back now reuses its pinned buffers (8fad198; 9 us a step off the host's
# work on an H100 host; its GPU test, the e2e argmax and logprob cases and, with -x, 20
# of test_spec_decode_gpu.py + test_cuda_e2e.py passed before a 290 s cut).
# Pending (2026-12-07, thirty-seventh session; H100s came, eleven calls): on an H200, the
# `h200` part: the decode tiles' A/B (on the H100 the default gave nano 0.772 against
# 0.758 for the former 64x4x2), batch1_profile.py and nano_breakdown.py: is the H200
# host-bound there (on the H100 the host waited on the device at full batch and at
# batch 1; batch1_profile.py now counts the steps the host was late for)? Done on the
# H100 this session: the prefill
# kernel's new tiles passed test_triton_attention.py -m gpu -k "not decode" (214) and
# held nano (0.783 against 0.775 with a0cb1d7's spindle, 3 rounds, within the spread);
# SPINDLE_DECODE_OVERLAP lost (the 256-request replay 1.907 -> 2.217 ms, nano 0.768 ->
# 0.746) and is gone, as the twenty-first session's halves were; the engine tests
# (test_cuda_e2e.py, test_compile_gpu.py, test_pdl.py: 48 before a 560 s cut, then
# test_pdl.py and test_compile_gpu.py to a 110 s cut), test_spec_decode_gpu.py and
# test_sliding_window.py (8), test_whisper_gpu.py (10), test_lora.py (2): none failed.
# Passed on an H100 in the thirty-sixth session: test_triton_attention.py -m gpu -k
# decode whole (713, the new decode tiles), the engine tests to a 330 s cut (36).
# Pending (2026-12-07, thirty-fifth session; an H200 came): the decode loop loads its
# block ids an iteration ahead (num_stages 3: two K/V buffers), and the per-KV-head
# kernel's default tiles are by size (32x2x3 from 1,025 request x KV-head pairs, 64x4x3
# below). On one H200, 32x2x3 everywhere gave nano 0.703 x roofline against 0.676 for
# the former 64x4x2 (5 and 10 runs); on a second, one round, the new default and 32x2x3
# both 0.673, the old one not run. First in `ab`: tiles_before (the former default)
# against main, three rounds or more; then the decode tests whole with the new
# defaults (`tests`; cut by the call's limit so far, no failure). SPINDLE_GRAPH_FEED is
# on by default since (its test passed; batch 1 1,495 against 1,466 tok/s, medians).
# Batch 1's 35 us between replays are now mostly idle (one host-to-device copy, the
# tokens' copy back): batch1_profile.py (`kernels`, first) now also times the host's
# own work per step, unprofiled: is the host what keeps the device waiting? The
# prefill kernel's loop loads its block ids ahead too (still 2 stages, compiled as
# before): mixed_attention.py's 3-stage tiles (`kernels`) now keep a tile in flight.
# Pending (2026-12-07, thirty-fourth session; no machine came at all): three changes
# written without a GPU. (1) SPINDLE_GRAPH_FEED (off until measured): the small decode
# graphs leave their argmax in their own input ids, and a greedy step of the same
# requests neither stages nor feeds them; its GPU test is test_cuda_e2e.py -k argmax
# (`tests`, first; it sets the switch itself), its speed the batch-1 A/B with
# SPINDLE_GRAPH_FEED=1 against main (`ab`): on by default if it passes and gains.
# (2) Block tables are copied only when they changed (no switch; every engine test runs
# it; its gain is a batch-1 A/B against 96e012b's spindle package, a variant with
# PYTHONPATH=/tmp/site:<its copy>). (3) SPINDLE_DECODE_PREFETCH (default off): the
# per-KV-head decode kernel loads its next tile into registers ahead, since Triton's
# pipeliner gives its loop one buffer whatever num_stages (sm_90 code compiled on the
# CPU): `kernels` sweeps it with decode_attention.py --prefetch, `ab` runs nano with it.
# Pending (2026-12-07, thirty-third session; one H100 call, no H200 came): the decode
# tiles on an H200 (`kernels`; on the H100 the default already reads at copy bandwidth at
# 256 requests and 64x4x3 gains 4% at 128), then nano with SPINDLE_DECODE_TILES=64x4x3
# against main (`ab`); batch1_profile.py on an H200 (the 35 us between replays: what it
# is made of). The L2 prefetch of the next GEMV's weight was measured slower on the H100
# and not kept (docs/benchmarks.md).
# Done on an H200 (2026-12-06, thirty-second session): the `ab` part's engine A/B (every
# switch's default stands; docs/benchmarks.md "The speed targets on an H200 again"),
# nano_breakdown --probe-queue, a cold start, test_argmax_kernel.py whole (after a fix
# to compiling_ahead's device); on an H100 test_whisper_gpu.py whole, first_calls.py.
# Still pending: mixed_step_latency.py and lora_overhead.py (`ab`), the `kernels` part
# on an H200 (first: decode attention's tiles, since nano's decode steps there are bound
# by that kernel at 0.88 of copy bandwidth), test_hybrid_gpu.py whole (`models`), the
# engine tests (`tests`).
# Pending (2026-12-06, thirty-first session): the greedy argmax's chunk ids start as zeros
# (a bf16 Whisper start after float32 engines in one process recorded a warm-up token
# from unwritten memory): test_argmax_kernel.py's compile-ahead case (`tests`) and
# test_whisper_gpu.py whole, its bf16 case after the float32 ones (`models`): neither
# run on a GPU since. Nano's prompt steps were found device-bound (H100); the `kernels`
# part's nano_breakdown --probe-queue and host_launch.py have answered what they asked.
# Pending (2026-12-06, thirtieth session): mixed steps' single-token requests in the
# decode kernel (SPINDLE_MIXED_DECODE_KERNEL, on by default) were measured on an H100
# only (a layer's attention at 248 decoding requests 1,034 -> 509 us; nano within
# noise): its A/B on an H200 (`ab`, with mixed_step_latency.py: what 200 streams wait
# while 4 prompts prefill; written after the session's device time, run on the CPU
# only), mixed_attention.py (`kernels`); its GPU tests
# passed on an H100 (`tests` runs them again). The hybrid, spec-decode, sliding-window
# and Whisper GPU files were cut by the calls' limits with it, none failing: run them
# whole (`models`). Nano's steps with prompt tokens launch their forward as slowly as
# the device runs them (0.7-1.1 ms a layer; F.linear 62 us a call in cProfile): the
# host or launches blocking behind the device? nano_breakdown.py --probe-queue, and
# host_launch.py with a layer's four projections in turn under either BLAS (`kernels`).
# Pending (2026-12-06, twenty-ninth session): still no H200 figure since the kernels of
# sessions 24-28 (the `ab` part gives them). On the H100 the 64- and 256-request graphs
# replay ~90 us slower in main than with SPINDLE_GRAPH_ARGMAX=0, all of it idle between
# kernels (docs/benchmarks.md); re-capturing them after the small graphs, and
# SPINDLE_PDL=0, left it as it was (30th session; graph_gaps.py, in `kernels`).
# Pending (2026-12-06, twenty-eighth session): the greedy argmax inside the decode
# graphs (SPINDLE_GRAPH_ARGMAX, SPINDLE_GREEDY_KERNEL, on by default) was measured on an
# H100 only (batch 1 +1.0%, nano +0.9%): its A/B on an H200 (`ab`). (The large graphs'
# slower replays it brought: see the twenty-ninth session's line above.)
# Pending (2026-12-06, twenty-seventh session): the per-head decode attention kernel
# (SPINDLE_DECODE_PER_HEAD, on by default for one or two requests) was measured on an
# H100 only (batch 1 +2.1%): its A/B on an H200 (`ab`) and `layer_chain.py --context`
# with and without it (`kernels`). Its test cases all passed on an H100 (28th session).
# Pending (2026-12-06, twenty-sixth session): the one-row TMA GEMV with the norms inside
# (SPINDLE_TMA_GEMV, on by default) was measured on an H100 only (batch 1 +19%, nano
# +2.9%): its A/B on an H200 (`ab`), `layer_chain.py` with and without it (`kernels`),
# test_skinny_gemm.py's one-row cases (which now take it on Hopper) and the last of
# test_cuda_e2e.py's one-request bf16 cases (`tests`).
# Pending (2026-12-06, twenty-fifth session): SPINDLE_GRAPH_LOGITS (the LM head inside
# the decode graphs, on by default) measured on an H100 only (nano +1.6%, batch 1 -1%):
# its A/B on an H200 (the `ab` part runs it). Its GPU tests passed on an H100 (e2e, spec
# decode, sleep, compile, LoRA graphs, batch-invariant, Bamba graphs: 31).
# Pending (2026-12-06, twenty-fourth session): the LoRA kernel's cost (lora_overhead.py
# with SPINDLE_LORA_KERNEL=1 and 0; its tests passed), which decides its default (off);
# the skinny GEMM's 64-row bound with silu_and_mul (test_skinny_gemm.py -k deferred);
# the engine tests under longest-first decode attention (the default) finished no call
# yet, though none failed; SPINDLE_GDN_TRITON_PREFILL's engine default (off), the
# Granite 3.x GPU cases, the rest of the kernel tests (structured outputs on CUDA).
# Passed on an H100 in the twenty-fourth session: the LoRA kernel and LoRA in CUDA graphs
# with and without adapters (27), after the graph-capture fix.
# Passed on an H100 in the twenty-third session: ALiBi and chunked attention in the
# Triton kernels (41), LoRA adapters in CUDA graphs against PEFT (before the kernel),
# BLOOM, MPT, Helium, Phi-4-mini's partial rotary, Llama 4 and Phi-3's LongRoPE in CUDA
# graphs (6), Phi-3.5-MoE and Hunyuan in the fused MoE kernels (2), Qwen3-Next and
# Qwen3.5 with the Triton gated-delta prefill (4). Earlier: the twentieth session's
# dense families (14), DeepSeek-V3, gpt-oss, Qwen2-MoE (21st); Zamba2, prompt logprobs,
# fused MoE (20th).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
what=${1:-all}
t0=$(date +%s)
stamp() { echo "== $1 ($(( $(date +%s) - t0 )) s)"; }

if [[ $what == pages ]]; then
    stamp "head-major KV pages: the kernels' tests and the engine against transformers"
    timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_triton_attention.py \
        tests/test_cache_groups.py -k head_major 2>&1 | tail -3
    timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_cuda_e2e.py \
        -k head_major 2>&1 | tail -3
fi

if [[ $what == h200 || $what == pages ]]; then
    stamp "head-major KV pages: decode attention alone, both layouts, page sizes, context ranges"
    (cd benchmarks && timeout 150 python3 decode_attention.py --batches 256 128 \
        --pages token head --page-sizes 16 32 --longest 1200 2048 \
        --json "$OUT/pages_kernel.json" 2>&1 | tail -66)
    stamp "decode tiles at nano-like contexts: fewer keys or warps, more programs an SM"
    (cd benchmarks && timeout 90 python3 decode_attention.py --batches 256 --longest 1200 \
        --tiles 32x2x3 32x1x3 16x1x3 16x2x3 64x4x3 --json "$OUT/short_tiles.json" 2>&1 \
        | tail -22)
    stamp "head-major KV pages on nano (16-token pages, then 32), two rounds"
    timeout 270 python3 benchmarks/switch_ab.py --rounds 2 --json "$OUT/pages_ab.json" \
        --out-dir "$OUT/pages_runs" \
        --variant main= --variant head_major=SPINDLE_KV_HEAD_MAJOR=1 \
        --variant head_major_32=SPINDLE_KV_HEAD_MAJOR=1,--block-size=32 2>&1 | tail -7
fi

if [[ $what == h200 ]]; then
    stamp "batch 1: graphs that advance their inputs (the default), then without"
    timeout 170 python3 benchmarks/switch_ab.py --skip-nano --rounds 5 \
        --json "$OUT/advance_ab.json" --variant main= \
        --variant no_advance=SPINDLE_GRAPH_ADVANCE=0 2>&1 | tail -4
    cd benchmarks
    stamp "batch 1: the host's work phase by phase, no profiler in the process"
    timeout 70 python3 host_phases.py --json "$OUT/host_phases.json" 2>&1 | grep -A26 "^phase"
    cd ..
fi

if [[ $what == tests || $what == all ]]; then
    stamp "the graph advance (on by default since the 41st session): its kernel, then the GPU files"
    timeout 100 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_graph_advance.py \
        tests/test_argmax_kernel.py 2>&1 | tail -3
    timeout 450 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_hybrid_gpu.py \
        tests/test_whisper_gpu.py tests/test_lora.py tests/test_multiproc_gpu.py \
        tests/test_model_pool_gpu.py tests/test_weight_transfer_gpu.py \
        tests/test_batch_invariant_gpu.py tests/test_fp8_gpu.py \
        tests/test_cuda_e2e.py::test_steps_copy_nothing_from_pageable_memory 2>&1 | tail -4
    stamp "the new kernel paths first: ALiBi and chunked attention (interpreter-tested only)"
    timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_triton_attention.py \
        -k "alibi or chunk" 2>&1 | tail -3
    stamp "kernel tests, switches off"
    timeout 300 python3 -m pytest -q -x -p no:cacheprovider -m gpu tests/test_skinny_gemm.py \
        tests/test_triton_attention.py tests/test_gated_delta.py \
        tests/test_selective_scan.py tests/test_prompt_logprobs.py tests/test_fused_moe.py \
        tests/test_structured_outputs.py 2>&1 | tail -3
    stamp "the greedy argmax: its kernel, greedy tokens through the graphs (the graph feed)"
    timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_argmax_kernel.py \
        tests/test_cuda_e2e.py -k "argmax" 2>&1 | tail -3
    stamp "the TMA GEMV: its tests, the skinny GEMM's one-row cases, one-request bf16 decode"
    timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_tma_gemv.py \
        tests/test_skinny_gemm.py 2>&1 | tail -3
    timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_cuda_e2e.py \
        -k one_request 2>&1 | tail -3
    stamp "mixed steps split between the kernels: kernels, end to end, compiling"
    timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_triton_attention.py \
        -k mixed 2>&1 | tail -3
    timeout 250 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_cuda_e2e.py \
        tests/test_compile_gpu.py -k mixed_steps 2>&1 | tail -3
    stamp "engine tests (longest-first decode attention is the default)"
    timeout 360 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_cuda_e2e.py \
        tests/test_compile_gpu.py tests/test_pdl.py 2>&1 | tail -4
fi

if [[ $what == models || $what == all ]]; then
    stamp "DeepSeek-V3 (latent attention), gpt-oss (sinks, biased experts), Qwen2-MoE on CUDA"
    timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_moe_models.py \
        -k "deepseek or gpt_oss or qwen2_moe or hunyuan or phimoe" 2>&1 | tail -4
    stamp "Gated DeltaNet models with the Triton prefill"
    SPINDLE_GDN_TRITON_PREFILL=1 timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu \
        tests/test_hybrid_gpu.py -k "qwen3_next or qwen3_5" 2>&1 | tail -4
    stamp "Whisper, the bf16 case after the float32 ones (the argmax's zeroed chunk ids)"
    timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_whisper_gpu.py \
        2>&1 | tail -3
    stamp "hybrids, spec decode, sliding windows (mixed steps split since the 30th)"
    timeout 400 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_hybrid_gpu.py \
        tests/test_spec_decode_gpu.py tests/test_sliding_window.py 2>&1 | tail -4
    stamp "LoRA adapters in CUDA graphs against PEFT (new)"
    timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_lora.py 2>&1 | tail -3
    stamp "the twenty-first and -second sessions' families in CUDA graphs vs CUDA transformers"
    timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_cuda_e2e.py \
        -k "more_families and (bloom or mpt or helium or phi3-partial or llama4 \
        or phi3-longrope)" 2>&1 | tail -4
fi

if [[ $what == ab || $what == all ]]; then
    stamp "first: the decode tiles on nano, three rounds"
    timeout 600 python3 benchmarks/switch_ab.py --rounds 3 --json "$OUT/tiles_ab.json" \
        --variant main= --variant tiles_before=SPINDLE_DECODE_TILES=64x4x2 2>&1 | tail -10
    stamp "engine A/B (batch 1, graph replays, nano)"
    timeout 600 python3 benchmarks/switch_ab.py --rounds 2 --json "$OUT/switch_ab.json" \
        --variant main= --variant skinny_one_row=SPINDLE_TMA_GEMV=0 \
        --variant per_kv_head=SPINDLE_DECODE_PER_HEAD=0 \
        --variant argmax_outside=SPINDLE_GRAPH_ARGMAX=0 \
        --variant torch_argmax=SPINDLE_GRAPH_ARGMAX=0,SPINDLE_GREEDY_KERNEL=0 \
        --variant head_outside=SPINDLE_GRAPH_LOGITS=0 \
        --variant mixed_one_kernel=SPINDLE_MIXED_DECODE_KERNEL=0 \
        --variant batch_order=SPINDLE_DECODE_LONGEST_FIRST=0 \
        --variant tiles_before=SPINDLE_DECODE_TILES=64x4x2 \
        --variant tiles_32x2x3=SPINDLE_DECODE_TILES=32x2x3 \
        --variant no_graph_feed=SPINDLE_GRAPH_FEED=0 2>&1 | tail -15
    stamp "streams' wait while prompts prefill beside them: split (default), one kernel"
    for round in 1 2; do
        for split in 1 0; do
            SPINDLE_MIXED_DECODE_KERNEL=$split timeout 150 python3 \
                benchmarks/mixed_step_latency.py --json "$OUT/mixed_latency_${split}_$round.json" \
                2>&1 | tail -3
        done
    done
    stamp "LoRA's cost in CUDA graphs (Qwen3-0.6B shape: 64 requests, then 1)"
    for kernel in 1 0; do
        for batch in 64 1; do
            SPINDLE_LORA_KERNEL=$kernel timeout 150 python3 benchmarks/lora_overhead.py \
                --device cuda --qwen3-shape --batch $batch --prompt-len 128 --new 128 \
                --json "$OUT/lora_${batch}_kernel$kernel.json" 2>&1 | tail -7
        done
    done
fi

if [[ $what == kernels || $what == all ]]; then
    cd benchmarks
    stamp "batch 1: kernels, idle between replays, the host's own work per step"
    timeout 150 python3 batch1_profile.py --json "$OUT/batch1_profile.json" 2>&1 | tail -26
    stamp "28 layers' dense part at one and two rows: TMA GEMV (default), then skinny"
    timeout 100 python3 layer_chain.py --rows 1 2 2>&1 | tail -4
    SPINDLE_TMA_GEMV=0 timeout 100 python3 layer_chain.py --rows 1 2 2>&1 | tail -4
    stamp "the same with decode attention: per-head kernel (default), then per-KV-head"
    timeout 150 python3 layer_chain.py --rows 1 2 4 --context 0 640 2048 2>&1 | tail -10
    SPINDLE_DECODE_PER_HEAD=0 timeout 150 python3 layer_chain.py --rows 1 2 4 \
        --context 640 2048 2>&1 | tail -7
    stamp "host time of a prefill step's GEMMs: the four projections in turn, both BLAS"
    for blas in cublas cublaslt; do
        timeout 60 python3 host_launch.py --blas $blas 2>&1 | tail -9
    done
    stamp "nano's steps with prompt tokens: is the device behind when the forward is launched?"
    timeout 150 python3 nano_breakdown.py --probe-queue --json "$OUT/nano_probe.json" 2>&1 \
        | grep -A20 "^tokens reqs"
    stamp "first calls after ready: cuBLAS's first use of a kernel, syncs in the steps"
    timeout 150 python3 first_calls.py --sync-check --json "$OUT/first_calls.json" 2>&1 | tail -12
    stamp "a mixed step's attention: one kernel, split, tiles"
    timeout 120 python3 mixed_attention.py --json "$OUT/mixed_attention.json" 2>&1 | tail -52
    stamp "decode attention, both orders"
    timeout 120 python3 decode_attention.py --batches 256 192 128 96 64 32 \
        --json "$OUT/decode_attention.json" 2>&1 | tail -14
    stamp "nano's steps by size, host wait per bucket (host-bound on an H200?)"
    timeout 120 python3 nano_breakdown.py --json "$OUT/nano_breakdown.json" 2>&1 \
        | grep -A8 "^steps"
    stamp "decode attention's tiles (on an H200 it reads the KV at 0.88 of copy bandwidth)"
    timeout 200 python3 decode_attention.py --batches 256 192 128 96 64 --tiles 64x4x2 \
        64x4x3 32x4x3 32x2x3 --json "$OUT/decode_tiles.json" 2>&1 | tail -42
    stamp "the skinny GEMM's tiles past 16 rows (default 16: cuBLAS won from 64, 2026-12-06)"
    SPINDLE_SKINNY_MAX_M=256 timeout 200 python3 skinny_gemm.py --m 64 128 256 \
        --shapes qkv_proj gate_up_proj o_proj down_proj --sweep \
        --tiles 64x128 128x64 128x128 32x128 --stages 3 --iters 60 2>&1 | tail -16
    stamp "idle between a large graph's kernels, argmax in the small graphs or not"
    for env in SPINDLE_GRAPH_ARGMAX=1 SPINDLE_GRAPH_ARGMAX=0 \
               "SPINDLE_GRAPH_ARGMAX=1 SPINDLE_PDL=0" "SPINDLE_GRAPH_ARGMAX=0 SPINDLE_PDL=0"; do
        echo "$env"
        env $env timeout 120 python3 graph_gaps.py --sizes 64 256 --recapture 2>&1 | tail -8
    done
    stamp "batch-1 layers as one persistent kernel (experiment)"
    timeout 200 python3 persistent_layers.py --json "$OUT/persistent.json" 2>&1 | tail -12
    stamp "gated delta prefill (torch by request, batched, Triton)"
    timeout 120 python3 gated_delta_prefill.py --device cuda --json "$OUT/gdn.json" 2>&1 | tail -12
fi
stamp done
