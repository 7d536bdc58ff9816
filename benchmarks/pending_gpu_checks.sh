#!/usr/bin/env bash
# What was built without a GPU and waits for one: its tests with the switches on, then
# the measurements that decide the switches' defaults. Run from the repository root on
# a CUDA machine (one H200 or H100). Results go to $OUT (default ./gpu_out). Each step
# is bounded so that one stuck step does not take the rest; the parts are meant for one
# device call each (each stays under the 10-minute limit of a call). On an H200, `h200`
# then `h200ab` first: the measurements issue 16's open targets wait for, in two calls;
# or, where H200s are scarce, `h200one`: what matters most of both in one call.
#
#   bash benchmarks/pending_gpu_checks.sh
#       [h200|h200ab|h200one|pages|tests|models|ab|kernels|all]
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
# What each part waits for (2026-12-07, forty-fourth session; each session's results, and
# the history these notes used to keep, are in docs/benchmarks.md):
#   h200     On an H200, first: where nano's decode attention loses its bandwidth (0.88 x
#            copy inside the engine's full-batch steps, 1.05 alone at contexts of
#            100-2,048). The kernel alone on token- and head-major pages
#            (SPINDLE_KV_HEAD_MAJOR, off), 16- and 32-token pages, contexts up to 1,200
#            and 2,048 tokens (nano's full-batch steps average about 640), and every
#            context one length from 128 to 2,048; smaller tiles at the shorter
#            contexts; the kernel alone with the engine's inputs (q/k norms and rotary
#            fused in); the kernel inside 28 layers of GEMMs and norms at nano-like
#            contexts (layer_chain.py --drawn). Whichever of these first reads near 0.88
#            says where the loss is. About 60 s on an H100. (There, 44th session: the kernel
#            reads in the chain as alone on the engine's inputs, 10-18 us a launch
#            plus the KV at 1.07 x copy; 45th: PDL through the whole chain, skinny GEMMs
#            at every size, hides about 2 us of it at 256 rows; see docs/benchmarks.md.)
#   h200ab   On an H200, next: the batch-1 A/B of the graph advance (SPINDLE_GRAPH_ADVANCE,
#            on by default since the 41st session: +1.2% on an H100; back off if it loses
#            on an H200); nano with head-major pages (on by default if they gain there);
#            host_phases.py. About 400 s.
#   h200one  On an H200 that may not come twice: h200's kernel diagnostics, the
#            batch-1 A/B, then the head-major nano A/B (h200ab without host_phases.py).
#            About 530 s: give the call its whole 600.
#   pages    Any GPU: the head-major pages' GPU tests, the kernel on both layouts, a nano
#            A/B. Done on an H100 (43rd session: tests passed, no change in speed there).
#   tests    Any GPU: the GPU test files, a regression sweep after kernel or graph changes
#            (every file passed on an H100 with the advance on, 41st-42nd sessions).
#   models   Any GPU: the model families' GPU files, likewise; KimiLinear first (48th
#            session: written without a GPU, its kernels tested under the interpreter).
#   ab       The tiles A/B and the engine A/B of every switch (on an H200 last in the
#            32nd and 35th sessions; the defaults follow them); then mixed_step_latency.py
#            (what decoding streams wait while prompts prefill, SPINDLE_MIXED_DECODE_KERNEL
#            on and off) and lora_overhead.py with SPINDLE_LORA_KERNEL on and off (both
#            first run on an H100 in the 44th session: the defaults held).
#   kernels  Profiles and kernel sweeps behind the figures in docs/benchmarks.md; rerun
#            on an H200 after a kernel changes.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
what=${1:-all}
case $what in
    h200|h200ab|h200one|pages|tests|models|ab|kernels|all) ;;
    *) echo "unknown part '$what': h200, h200ab, h200one, pages, tests, models, ab," \
           "kernels or all" >&2; exit 2 ;;
esac
t0=$(date +%s)
stamp() { echo "== $1 ($(( $(date +%s) - t0 )) s)"; }

if [[ $what == pages ]]; then
    stamp "head-major KV pages: the kernels' tests and the engine against transformers"
    timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_triton_attention.py \
        tests/test_cache_groups.py -k head_major 2>&1 | tail -3
    timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_cuda_e2e.py \
        -k head_major 2>&1 | tail -3
fi

if [[ $what == h200 || $what == h200one || $what == pages ]]; then
    stamp "head-major KV pages: decode attention alone, both layouts, page sizes, context ranges"
    (cd benchmarks && timeout 150 python3 decode_attention.py --batches 256 128 \
        --pages token head --page-sizes 16 32 --longest 1200 2048 \
        --json "$OUT/pages_kernel.json" 2>&1 | tail -66)
fi

if [[ $what == h200 || $what == h200one ]]; then
    stamp "decode attention alone, every context the same length: the read rate by length"
    (cd benchmarks && timeout 90 python3 decode_attention.py --batches 256 --uniform \
        --longest 128 256 640 1200 2048 --json "$OUT/uniform_kernel.json" 2>&1 | tail -22)
    stamp "decode tiles at nano-like contexts: fewer keys or warps, more programs an SM"
    (cd benchmarks && timeout 90 python3 decode_attention.py --batches 256 --longest 1200 \
        --tiles 32x2x3 32x1x3 16x1x3 16x2x3 64x4x3 --json "$OUT/short_tiles.json" 2>&1 \
        | tail -22)
    stamp "decode attention alone on the engine's inputs: q/k norms and rotary fused in"
    (cd benchmarks && timeout 90 python3 decode_attention.py --batches 256 128 --longest 1200 \
        --rope off on --json "$OUT/rope_kernel.json" 2>&1 | tail -18)
    stamp "decode attention inside 28 layers at nano-like contexts (drawn, mean 640)"
    (cd benchmarks && timeout 120 python3 layer_chain.py --rows 256 128 --context 0 640 \
        --drawn 2>&1 | tail -6)
fi

if [[ $what == h200ab || $what == h200one ]]; then
    stamp "batch 1: graphs that advance their inputs (the default), then without"
    timeout 170 python3 benchmarks/switch_ab.py --skip-nano --rounds 5 \
        --json "$OUT/advance_ab.json" --variant main= \
        --variant no_advance=SPINDLE_GRAPH_ADVANCE=0 2>&1 | tail -4
fi

if [[ $what == h200ab || $what == h200one || $what == pages ]]; then
    stamp "head-major KV pages on nano (16-token pages, then 32), two rounds"
    timeout 270 python3 benchmarks/switch_ab.py --rounds 2 --json "$OUT/pages_ab.json" \
        --out-dir "$OUT/pages_runs" \
        --variant main= --variant head_major=SPINDLE_KV_HEAD_MAJOR=1 \
        --variant head_major_32=SPINDLE_KV_HEAD_MAJOR=1,--block-size=32 2>&1 | tail -7
fi

if [[ $what == h200ab ]]; then
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
    stamp "KimiLinear on CUDA (new, 48th session: its kernels interpreter-tested only)"
    timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_hybrid_gpu.py \
        tests/test_kimi_linear.py tests/test_gated_delta.py -k "kimi or per_key" 2>&1 | tail -4
    timeout 120 python3 benchmarks/gated_delta_prefill.py --device cuda --key-heads 8 \
        --value-heads 8 --per-key-decay --chunk-size 16 --json "$OUT/kda_prefill.json" \
        2>&1 | tail -6
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
