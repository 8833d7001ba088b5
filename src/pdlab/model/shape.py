"""The shape of a Llama-architecture model, and what it decides: FLOPs and bytes of a prefill or a decode step,
and the KV cache bytes one token occupies.

Counting conventions (the formulas the tests check exactly):
- FLOPs are 2 per multiply-add of the matrix products (the projections, the MLP, the LM head, and attention's
  QK^T and attention-weights x V over the causal context). Norms, rotary embeddings, softmax and activations are
  left out: they are a few percent of the total for these shapes.
- Bytes are what must come from memory at least once: the weights of every matrix product and the norms, the
  embedding rows of the input tokens, the KV cache read by decode attention and the KV written for new tokens.
  Activations are left out (they are small and mostly stay in cache).
- Prefill computes logits for the last prompt token only, as a serving engine does.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a Llama-architecture model that decide its FLOPs and bytes."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    dtype_bytes: int = 4

    @classmethod
    def from_config(cls, config: Any, dtype_bytes: int = 4) -> ModelShape:
        """From a transformers `LlamaConfig` (or anything with the same attribute names)."""
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(
            hidden_size=config.hidden_size,
            num_layers=config.num_hidden_layers,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            head_dim=head_dim,
            intermediate_size=config.intermediate_size,
            vocab_size=config.vocab_size,
            dtype_bytes=dtype_bytes,
        )

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def layer_matmul_params(self) -> int:
        """Weights of one decoder layer's matrix products: q, k, v, o projections and the gated MLP (3 matrices)."""
        h = self.hidden_size
        return h * self.q_dim + 2 * h * self.kv_dim + self.q_dim * h + 3 * h * self.intermediate_size

    @property
    def weight_bytes(self) -> int:
        """Bytes of the weights every forward pass reads: all layers' matrices and norms, the final norm and the
        LM head (the embedding table is not read whole: only the input tokens' rows)."""
        h = self.hidden_size
        params = self.num_layers * (self.layer_matmul_params + 2 * h) + h + h * self.vocab_size
        return params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """KV cache bytes one token occupies: K and V, in every layer."""
        return 2 * self.num_layers * self.kv_dim * self.dtype_bytes

    def attention_flops(self, queries: int, keys_seen: int) -> int:
        """Attention FLOPs in all layers for `queries` new tokens after `keys_seen` cached ones, causal: query i
        (0-based) attends to keys_seen + i + 1 keys; each key costs 2*q_dim for QK^T and 2*q_dim for x V."""
        keys = queries * keys_seen + queries * (queries + 1) // 2
        return self.num_layers * 4 * self.q_dim * keys

    def prefill_flops(self, tokens: int) -> int:
        """One prompt of `tokens` tokens, from an empty cache, logits for the last token only."""
        return 2 * tokens * self.num_layers * self.layer_matmul_params + self.attention_flops(tokens, 0) + (
            2 * self.hidden_size * self.vocab_size
        )

    def prefill_bytes(self, tokens: int) -> int:
        return self.weight_bytes + tokens * self.hidden_size * self.dtype_bytes + tokens * self.kv_bytes_per_token

    def decode_flops(self, batch: int, context: int) -> int:
        """One decode step: `batch` sequences, each with `context` tokens already in its KV cache, one new token."""
        per_sequence = 2 * self.num_layers * self.layer_matmul_params + self.attention_flops(1, context) + (
            2 * self.hidden_size * self.vocab_size
        )
        return batch * per_sequence

    def decode_bytes(self, batch: int, context: int) -> int:
        """The weights once for the whole batch; per sequence its input embedding row, its KV cache read, and the
        new token's KV written."""
        per_sequence = self.hidden_size * self.dtype_bytes + (context + 1) * self.kv_bytes_per_token
        return self.weight_bytes + batch * per_sequence

    def prefill_intensity(self, tokens: int) -> float:
        """Arithmetic intensity of a prefill, FLOP/byte."""
        return self.prefill_flops(tokens) / self.prefill_bytes(tokens)

    def decode_intensity(self, batch: int, context: int) -> float:
        """Arithmetic intensity of a decode step, FLOP/byte."""
        return self.decode_flops(batch, context) / self.decode_bytes(batch, context)

    def with_dtype(self, dtype_bytes: int) -> ModelShape:
        """The same model stored in another precision (e.g. 2 for bf16 on a GPU)."""
        return ModelShape(**{**asdict(self), "dtype_bytes": dtype_bytes})


def shape_of_dir(model_dir: str | Path, dtype_bytes: int = 4) -> ModelShape:
    """The shape from a model directory's `config.json`, without loading torch (e.g. a served model's)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return ModelShape.from_config(SimpleNamespace(**config), dtype_bytes=dtype_bytes)
