#!/usr/bin/env bash
# Rendered by `pdlab cluster render --target script`; edit the lab spec, not this file.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
# The pdlab router: run on a host that reaches every replica (pip install pdlab huggingface_hub).
# It counts prompt tokens with the model's tokenizer: fetch the tokenizer files once.
[ -f "$here/tokenizer/tokenizer.json" ] || python3 -c "import sys; from huggingface_hub import snapshot_download; snapshot_download('meta-llama/Llama-3.1-70B-Instruct', allow_patterns=['tokenizer*', 'config.json', '*.jinja'], local_dir=sys.argv[1])" "$here/tokenizer"
exec pdlab router serve \
    --decode http://llama70b-pd-decode-0:8000 \
    --decode http://llama70b-pd-decode-1:8000 \
    --prefill http://llama70b-pd-prefill-0:8000 \
    --prefill http://llama70b-pd-prefill-1:8000 \
    --model meta-llama/Llama-3.1-70B-Instruct \
    --tokenizer "$here/tokenizer" \
    --max-model-len 65536 \
    --lmcache-init-ports 7300 \
    --lmcache-init-ports 7301 \
    --lmcache-init-ports 7302 \
    --lmcache-init-ports 7303 \
    --lmcache-init-ports 7304 \
    --lmcache-init-ports 7305 \
    --lmcache-init-ports 7306 \
    --lmcache-init-ports 7307 \
    --lmcache-alloc-ports 7400 \
    --lmcache-alloc-ports 7401 \
    --lmcache-alloc-ports 7402 \
    --lmcache-alloc-ports 7403 \
    --lmcache-alloc-ports 7404 \
    --lmcache-alloc-ports 7405 \
    --lmcache-alloc-ports 7406 \
    --lmcache-alloc-ports 7407 \
    --threshold 2048 \
    --prefill-strategy kvaware \
    --decode-strategy kvaware \
    --kv-protocol lmcache \
    --host 0.0.0.0
