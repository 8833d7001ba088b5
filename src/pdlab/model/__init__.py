"""The local model: a small Llama-architecture model with seeded weights and a BPE tokenizer trained on text
shipped in `data/corpus/`, made deterministically into pdlab's cache. No model hub is needed.

The weights are random, so the text it writes is gibberish; what matters for the lab is that vLLM serves it
with the same code paths, KV cache layout and transfer protocol as a real Llama.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from pdlab.model.shape import ModelShape
from pdlab.settings import data_dir, models_dir

#: Chat template for the local models (they have none of their own): role-tagged turns, then the assistant tag.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>"]
MARKER_FILE = "pdlab-model.json"


@dataclass(frozen=True)
class ModelRecipe:
    """How to make one catalog model. Changing any field changes the model's bytes."""

    name: str
    description: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    max_position_embeddings: int
    vocab_size: int
    seed: int = 0

    @property
    def shape(self) -> ModelShape:
        """The model's shape (float32, as pdlab makes it)."""
        return ModelShape(num_layers=self.num_layers, hidden_size=self.hidden_size, num_heads=self.num_heads,
                          num_kv_heads=self.num_kv_heads, head_dim=self.hidden_size // self.num_heads,
                          intermediate_size=self.intermediate_size, vocab_size=self.vocab_size, dtype_bytes=4,
                          source=f"pdlab.model.CATALOG[{self.name!r}] (the recipe the local model is made from)")


#: The catalog: the one place that says which local models exist.
CATALOG: dict[str, ModelRecipe] = {
    recipe.name: recipe
    for recipe in (
        ModelRecipe(
            name="pdlab-small",
            description="default: ~26M parameters; a 4,000-token prefill takes a few seconds on one core",
            hidden_size=512,
            num_layers=8,
            num_heads=8,
            num_kv_heads=4,
            intermediate_size=1536,
            max_position_embeddings=8192,
            vocab_size=2048,
        ),
        ModelRecipe(
            name="pdlab-tiny",
            description="for fast tests: ~4M parameters; a 4,000-token prefill takes about half a second",
            hidden_size=256,
            num_layers=4,
            num_heads=4,
            num_kv_heads=2,
            intermediate_size=768,
            max_position_embeddings=8192,
            vocab_size=2048,
        ),
    )
}


class ModelError(RuntimeError):
    """A model that cannot be found or made; the message says what to do."""


def corpus_files() -> list[Path]:
    files = sorted((data_dir() / "corpus").glob("*.txt"))
    if not files:
        raise ModelError(f"no training text found under {data_dir() / 'corpus'}")
    return files


def model_path(name: str) -> Path:
    return models_dir() / name


def is_made(name: str) -> bool:
    return (model_path(name) / MARKER_FILE).exists()


def _train_tokenizer(recipe: ModelRecipe, texts: list[Path], out: Path) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=recipe.vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train([str(path) for path in texts], trainer)
    bos = tokenizer.token_to_id("<s>")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        model_max_length=recipe.max_position_embeddings,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return tokenizer.get_vocab_size()


def _build_weights(recipe: ModelRecipe, vocab_size: int, out: Path) -> int:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=recipe.hidden_size,
        intermediate_size=recipe.intermediate_size,
        num_hidden_layers=recipe.num_layers,
        num_attention_heads=recipe.num_heads,
        num_key_value_heads=recipe.num_kv_heads,
        max_position_embeddings=recipe.max_position_embeddings,
        bos_token_id=SPECIAL_TOKENS.index("<s>"),
        eos_token_id=SPECIAL_TOKENS.index("</s>"),
        pad_token_id=SPECIAL_TOKENS.index("<pad>"),
        tie_word_embeddings=False,
        dtype="float32",
    )
    torch.manual_seed(recipe.seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    return sum(p.numel() for p in model.parameters())


def make_model(name: str, force: bool = False) -> Path:
    """Make catalog model `name` into the cache (atomically), unless it is already there. Returns its directory."""
    if name not in CATALOG:
        raise ModelError(f"unknown catalog model {name!r}; the catalog has: {', '.join(CATALOG)}")
    target = model_path(name)
    if is_made(name) and not force:
        return target
    recipe = CATALOG[name]
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    try:
        texts = corpus_files()
        vocab = _train_tokenizer(recipe, texts, staging)
        params = _build_weights(recipe, vocab, staging)
        corpus_digest = hashlib.sha256(b"".join(p.read_bytes() for p in texts)).hexdigest()
        marker = {"name": name, "recipe": recipe.__dict__, "vocab_size": vocab, "parameters": params,
                  "corpus_sha256": corpus_digest}
        (staging / MARKER_FILE).write_text(json.dumps(marker, indent=2, sort_keys=True) + "\n")
        if target.exists():
            shutil.rmtree(target)
        os.replace(staging, target)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return target


def describe(name: str) -> dict:
    """Catalog entry plus, when made, what was made (parameter count, vocabulary)."""
    recipe = CATALOG[name]
    info: dict = {"name": name, "description": recipe.description, "made": is_made(name), "path": str(model_path(name))}
    if info["made"]:
        marker = json.loads((model_path(name) / MARKER_FILE).read_text())
        info.update(parameters=marker["parameters"], vocab_size=marker["vocab_size"])
    return info


_HF_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def resolve(name: str, make: bool = True) -> str:
    """What to pass to vLLM's `--model` for `name`: a catalog model's directory (made if missing and `make`),
    an existing local directory, or a Hugging Face id (passed through, for GPU users with hub access)."""
    if name in CATALOG:
        if not is_made(name):
            if not make:
                raise ModelError(f"model {name!r} is not made yet: run `pdlab model make {name}`")
            make_model(name)
        return str(model_path(name))
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ModelError(f"{path} has no config.json: it is not a model directory")
        return str(path.resolve())
    looks_like_path = name.startswith(("/", ".", "~")) or os.sep in name and not _HF_ID.match(name)
    if looks_like_path or not _HF_ID.match(name):
        raise ModelError(
            f"model {name!r} not found: it is not in pdlab's catalog ({', '.join(CATALOG)}), "
            "not an existing directory, and not a Hugging Face id (org/name)"
        )
    return name
