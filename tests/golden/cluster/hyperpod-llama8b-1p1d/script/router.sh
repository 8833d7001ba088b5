#!/usr/bin/env bash
# Rendered by `pdlab cluster render --target script`; edit the lab spec, not this file.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
# The pdlab router: run on a host that reaches every replica (pip install pdlab huggingface_hub).
# It counts prompt tokens with the model's tokenizer: fetch the tokenizer files once.
[ -f "$here/tokenizer/tokenizer.json" ] || python3 -c "import sys; from huggingface_hub import snapshot_download; snapshot_download('meta-llama/Llama-3.1-8B-Instruct', allow_patterns=['tokenizer*', 'config.json', '*.jinja'], local_dir=sys.argv[1])" "$here/tokenizer"
exec pdlab router serve \
    --decode http://llama8b-pd-decode-0:8000 \
    --prefill http://llama8b-pd-prefill-0:8000 \
    --model meta-llama/Llama-3.1-8B-Instruct \
    --tokenizer "$here/tokenizer" \
    --max-model-len 32768 \
    --lmcache-init-ports 7300 \
    --lmcache-alloc-ports 7400 \
    --prefill-strategy prefixaware \
    --decode-strategy prefixaware \
    --kv-protocol lmcache \
    --host 0.0.0.0
