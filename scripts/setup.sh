#!/usr/bin/env bash
# Create .venv with luce-tune and everything its tests need (CPU build of torch).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# The CPU wheel; an unpinned torch would pull a multi-GB CUDA build.
.venv/bin/python -m pip install -q torch==2.13.0
.venv/bin/python -m pip install -q -e '.[dev,dashboard,postgres]'
