#!/usr/bin/env bash
# Set up (venv, requirements, test tools, the SmolLM2-135M integration model) and run the
# test suite.  Unit tests use tiny random models built in code; integration tests use
# SmolLM2-135M.  Tests that need the Qwen models are marked `heavy` and skipped here.
# One pytest worker per core (pytest-xdist), each file's tests on one worker (its fixtures made
# once), each worker on one thread (tests/conftest.py): the tiny models' operators gain
# nothing from a second thread, and two workers keep both cores busy through the tests that
# wait on subprocesses.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --dev --models smollm2-135m
.venv/bin/python -m ruff check .
.venv/bin/python -m pytest -q -m "not heavy and not gpu" -n auto --dist loadfile "$@"
