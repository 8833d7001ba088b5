#!/usr/bin/env bash
# Rendered by `pdlab cluster render --target script`; edit the lab spec, not this file.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
# The pdlab router: run on a host that reaches every replica (pip install pdlab huggingface_hub).
# It counts prompt tokens with the model's tokenizer: fetch the tokenizer files once.
[ -f "$here/tokenizer/tokenizer.json" ] || python3 -c "import sys; from huggingface_hub import snapshot_download; snapshot_download('meta-llama/Llama-3.1-70B-Instruct', allow_patterns=['tokenizer*', 'config.json', '*.jinja'], local_dir=sys.argv[1])" "$here/tokenizer"
exec pdlab router serve \
    --model meta-llama/Llama-3.1-70B-Instruct \
    --tokenizer "$here/tokenizer" \
    --prefill http://llama70b-pd-prefill-0:8000 \
    --prefill http://llama70b-pd-prefill-1:8000 \
    --decode http://llama70b-pd-decode-0:8000 \
    --decode http://llama70b-pd-decode-1:8000 \
    --max-model-len 65536 \
    --threshold 2048 \
    --prefill-strategy kvaware \
    --decode-strategy kvaware \
    --fallback fallback \
    --max-in-flight 256 \
    --upstream-timeout 600.0 \
    --session-header x-session-id \
    --host 0.0.0.0 \
    --port 8000 \
    --kv-protocol lmcache \
    --lmcache-init-ports 7300,7301,7302,7303,7304,7305,7306,7307 \
    --lmcache-alloc-ports 7400,7401,7402,7403,7404,7405,7406,7407
