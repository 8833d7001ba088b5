#!/usr/bin/env bash
# Rendered by `pdlab cluster render --target script`; edit the lab spec, not this file.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
# decode replica: run on each of llama70b-pd-decode-0, llama70b-pd-decode-1 (GPUs: 8, EFA interfaces: 16).
export PYTHONHASHSEED=0
export FI_PROVIDER=efa
export FI_EFA_USE_DEVICE_RDMA=1
export FI_EFA_FORK_SAFE=1
export LMCACHE_CONFIG_FILE="$here/lmcache-decode.yaml"
: "${HF_TOKEN?set HF_TOKEN (empty for models that are not gated)}"
exec vllm serve meta-llama/Llama-3.1-70B-Instruct \
    --port 8000 \
    --served-model-name meta-llama/Llama-3.1-70B-Instruct \
    --dtype bfloat16 \
    --max-model-len 65536 \
    --tensor-parallel-size 8 \
    --gpu-memory-utilization 0.9 \
    --max-num-seqs 128 \
    --enable-prefix-caching \
    --kv-transfer-config '{"kv_connector":"LMCacheConnectorV1","kv_role":"kv_consumer","kv_buffer_device":"cuda","kv_connector_extra_config":{"discard_partial_chunks":false}}' \
    --host 0.0.0.0
