#!/usr/bin/env bash
# Headless Chromium + its WebDriver for the Flower browser test (Debian packages).
# Idempotent: does nothing when both are installed. Needs root or sudo for apt.
set -euo pipefail
if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then
  exit 0
fi
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq || true   # a stale index is fine when the packages resolve
$SUDO apt-get install -y -qq --no-install-recommends chromium chromium-driver >/dev/null
command -v chromium && command -v chromedriver
