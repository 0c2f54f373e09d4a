#!/usr/bin/env bash
# Install Debian's headless-capable Chromium for the dashboard's browser test (skipped without it).
# Needs root and apt; does nothing when chromium is already on PATH.
set -euo pipefail
if command -v chromium >/dev/null 2>&1; then
  exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
  echo "chromium.sh: chromium is not installed and installing it needs root" >&2
  exit 0
fi
{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    chromium fonts-dejavu-core; } >&2
