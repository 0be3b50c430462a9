#!/usr/bin/env bash
# The CRD validators for the Kubernetes manifest test (npm packages generated from KEDA's
# and the Prometheus Operator's published CRD schemas), installed once into tests/deploy.
# Built-in kinds and the compose file are checked with PyPI packages (the dev extra).
set -euo pipefail
cd "$(dirname "$0")/../tests/deploy"
if [ -d node_modules/@kubernetes-models/keda ] && [ -d node_modules/@kubernetes-models/prometheus-operator ]; then
  exit 0
fi
command -v npm >/dev/null || { echo "npm is needed for the CRD schemas (Debian: apt-get install nodejs npm)" >&2; exit 1; }
npm install --silent --no-audit --no-fund --no-package-lock
