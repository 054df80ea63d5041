#!/usr/bin/env bash
# Run a command as an AVX2-only x86 CPU would (no AVX-512, no native bf16): oneDNN, ATen and
# MKL capped at AVX2 (specflow.cpu.AVX2_ONLY_ENV).  On an AVX-512 machine this exercises the
# real fallback path -- oneDNN then refuses bf16 exactly as on an AMD Zen 3 -- and on an
# AVX2-only machine it changes nothing.  Timings under it are an AVX-512 core running AVX2
# code, not a real AVX2 CPU: name them so.
#
#   bash scripts/as_avx2.sh .venv/bin/python run.py +experiment=sps
exec env ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 "$@"
