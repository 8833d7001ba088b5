"""The shape of a Llama-architecture (decoder-only) model, and what it decides: its weights, the FLOPs and bytes of a
prefill or a decode step, and the KV cache bytes one token occupies. One type for every model pdlab reasons about:
the local models (from their recipe or a model directory's `config.json`), the catalog's (`data/catalog/models.yaml`,
`pdlab.model.catalog`), and the roofline of notebook 01.

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
from functools import cached_property
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from pydantic import Field

from pdlab.config.base import Spec

#: Bytes per element of each dtype a model is served in (`auto` is the local models' float32).
DTYPE_BYTES = {"float32": 4, "auto": 4, "bfloat16": 2, "float16": 2}


class ModelShape(Spec):
    """A decoder-only transformer's shape: enough to count its FLOPs and bytes."""

    num_layers: int = Field(gt=0)
    hidden_size: int = Field(gt=0)
    num_heads: int = Field(gt=0)
    num_kv_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    intermediate_size: int = Field(gt=0)
    vocab_size: int = Field(gt=0)
    tie_word_embeddings: bool = False
    mlp_matrices: int = Field(default=3, ge=2, le=3)
    """Weight matrices of a layer's MLP: 3 for a gated one (gate, up, down: Llama, Qwen), 2 for a plain one (up,
    down: the OPT models of the P/D papers' setups, labs/sim/published/)."""
    dtype_bytes: int = Field(default=2, ge=1, le=8)
    """Bytes per weight and KV element: 2 for bf16 (a GPU's default), 4 for the local float32 models."""
    source: str = ""
    """Where the figures come from (a config.json, a recipe); every entry of data/catalog/models.yaml gives one."""
    assumed: list[str] = []
    """Fields that are assumptions rather than sourced figures."""
    hub_ids: list[str] = []
    """Hugging Face ids of checkpoints with this shape (base and instruct): how a cluster lab's model is found."""

    @classmethod
    def from_config(cls, config: Any, dtype_bytes: int = 4, source: str = "") -> ModelShape:
        """From a transformers `LlamaConfig` (or anything with the same attribute names)."""
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(hidden_size=config.hidden_size, num_layers=config.num_hidden_layers,
                   num_heads=config.num_attention_heads,
                   num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
                   head_dim=head_dim, intermediate_size=config.intermediate_size, vocab_size=config.vocab_size,
                   tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
                   dtype_bytes=dtype_bytes, source=source)

    def with_dtype(self, dtype_bytes: int) -> ModelShape:
        """The same model stored in another precision (e.g. 2 for bf16 on a GPU)."""
        return self.model_copy(update={"dtype_bytes": dtype_bytes})

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @cached_property
    def layer_params(self) -> int:
        """Weights of one decoder layer's matrix products: q, k, v, o projections and the MLP (`mlp_matrices`)."""
        h = self.hidden_size
        return h * self.q_dim + 2 * h * self.kv_dim + self.q_dim * h + self.mlp_matrices * h * self.intermediate_size

    @cached_property
    def params(self) -> int:
        """Every layer's matrices and the embeddings (input and, unless tied, output); norms are negligible."""
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * self.layer_params + embeddings

    @property
    def weight_bytes(self) -> int:
        """Bytes of the weights every forward pass reads: all layers' matrices and norms, the final norm and the
        LM head (the embedding table is not read whole: only the input tokens' rows)."""
        h = self.hidden_size
        params = self.num_layers * (self.layer_params + 2 * h) + h + h * self.vocab_size
        return params * self.dtype_bytes

    def kv_bytes_per_token(self, dtype_bytes: int | None = None) -> int:
        """KV cache bytes one token of context occupies: K and V, in every layer (in `dtype_bytes` per element,
        default the shape's own)."""
        return 2 * self.num_layers * self.kv_dim * (dtype_bytes or self.dtype_bytes)

    def attention_flops(self, queries: int, keys_seen: int) -> int:
        """Attention FLOPs in all layers for `queries` new tokens after `keys_seen` cached ones, causal: query i
        (0-based) attends to keys_seen + i + 1 keys; each key costs 2*q_dim for QK^T and 2*q_dim for x V."""
        keys = queries * keys_seen + queries * (queries + 1) // 2
        return self.num_layers * 4 * self.q_dim * keys

    def prefill_flops(self, tokens: int) -> int:
        """One prompt of `tokens` tokens, from an empty cache, logits for the last token only."""
        return 2 * tokens * self.num_layers * self.layer_params + self.attention_flops(tokens, 0) + (
            2 * self.hidden_size * self.vocab_size
        )

    def prefill_bytes(self, tokens: int) -> int:
        return self.weight_bytes + tokens * self.hidden_size * self.dtype_bytes + tokens * self.kv_bytes_per_token()

    def decode_flops(self, batch: int, context: int) -> int:
        """One decode step: `batch` sequences, each with `context` tokens already in its KV cache, one new token."""
        per_sequence = 2 * self.num_layers * self.layer_params + self.attention_flops(1, context) + (
            2 * self.hidden_size * self.vocab_size
        )
        return batch * per_sequence

    def decode_bytes(self, batch: int, context: int) -> int:
        """The weights once for the whole batch; per sequence its input embedding row, its KV cache read, and the
        new token's KV written."""
        per_sequence = self.hidden_size * self.dtype_bytes + (context + 1) * self.kv_bytes_per_token()
        return self.weight_bytes + batch * per_sequence

    def prefill_intensity(self, tokens: int) -> float:
        """Arithmetic intensity of a prefill, FLOP/byte."""
        return self.prefill_flops(tokens) / self.prefill_bytes(tokens)

    def decode_intensity(self, batch: int, context: int) -> float:
        """Arithmetic intensity of a decode step, FLOP/byte."""
        return self.decode_flops(batch, context) / self.decode_bytes(batch, context)


def shape_of_dir(model_dir: str | Path, dtype_bytes: int = 4) -> ModelShape:
    """The shape from a model directory's `config.json`, without loading torch (e.g. a served model's)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return ModelShape.from_config(SimpleNamespace(**config), dtype_bytes=dtype_bytes)


def shape_of(name: str, dtype_bytes: int = 4) -> ModelShape:
    """The shape of a local catalog model (from its recipe: no need to have made it) or of a model directory."""
    from pdlab.model import CATALOG

    if name in CATALOG:
        return CATALOG[name].shape.with_dtype(dtype_bytes)
    if not (Path(name) / "config.json").is_file():
        raise ValueError(f"model {name!r}: not in pdlab's catalog and no directory with a config.json")
    return shape_of_dir(name, dtype_bytes)
