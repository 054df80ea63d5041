#!/usr/bin/env bash
# Run a command as an AVX2-only x86 CPU would (no AVX-512, no native bf16): oneDNN, ATen,
# MKL and the quantized rows kernel (its avx2 build) capped at AVX2
# (specflow.cpu.detect.AVX2_ONLY_ENV).  On an AVX-512 machine this exercises the
# real fallback path -- oneDNN then refuses bf16 exactly as on an AMD Zen 3 -- and on an
# AVX2-only machine it changes nothing.  Timings under it are an AVX-512 core running AVX2
# code, not a real AVX2 CPU: name them so.  llama.cpp keeps the build it was compiled with.
#
#   bash scripts/as_avx2.sh .venv/bin/python run.py +experiment=sps
exec env ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 SPECFLOW_QUANT_KERNEL=avx2 "$@"
