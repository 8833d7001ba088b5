#!/usr/bin/env bash
# Rendered by `pdlab cluster render --target script`; edit the lab spec, not this file.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
# The pdlab router: run on a host that reaches every replica (pip install pdlab).
exec pdlab router serve \
    --config "$here/router-config.yaml" \
    --host 0.0.0.0 \
    --port 8000
