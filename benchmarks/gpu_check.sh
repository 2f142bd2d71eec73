#!/usr/bin/env bash
# One-command GPU check (issue 4): kernel tests on CUDA + bandwidth / EMA / boundary numbers.
#   benchmarks/gpu_check.sh [--out results/gpu_check] [--peak-gbps N] [--smoke]
# Needs a CUDA build of torch and triton in $PYTHON (default: .venv/bin/python, else python3).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
[ -x "$PYTHON" ] || PYTHON=python3
exec timeout 480 "$PYTHON" benchmarks/gpu_check.py "$@"
