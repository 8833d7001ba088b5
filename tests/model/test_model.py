"""The local model: deterministic making, the catalog, and resolving names."""

from __future__ import annotations

import hashlib

import pytest

from pdlab import model


def digest_dir(path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir()) if p.is_file()}


def test_same_seed_same_bytes(tmp_path, monkeypatch):
    monkeypatch.setenv("PDLAB_HOME", str(tmp_path / "a"))
    first = digest_dir(model.make_model("pdlab-tiny"))
    monkeypatch.setenv("PDLAB_HOME", str(tmp_path / "b"))
    second = digest_dir(model.make_model("pdlab-tiny"))
    assert first == second
    assert {"config.json", "model.safetensors", "tokenizer.json", model.MARKER_FILE} <= set(first)


def test_made_model_is_a_llama_with_a_working_tokenizer(tmp_path, monkeypatch):
    monkeypatch.setenv("PDLAB_HOME", str(tmp_path))
    import json

    from tokenizers import Tokenizer

    path = model.make_model("pdlab-tiny")
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["torch_dtype" if "torch_dtype" in config
                                                                        else "dtype"] == "float32"
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    ids = tokenizer.encode("The river ran slowly past the old mill.").ids
    assert ids[0] == tokenizer.token_to_id("<s>") and len(ids) > 3
    assert config["vocab_size"] == tokenizer.get_vocab_size()
    assert model.describe("pdlab-tiny")["made"]


def test_catalog_has_a_default_and_a_test_size():
    from pdlab.settings import DEFAULT_MODEL

    assert DEFAULT_MODEL in model.CATALOG and "pdlab-tiny" in model.CATALOG
    assert model.CATALOG["pdlab-tiny"].hidden_size < model.CATALOG[DEFAULT_MODEL].hidden_size


def test_resolve(tmp_path):
    assert model.resolve("meta-llama/Llama-3.1-8B-Instruct") == "meta-llama/Llama-3.1-8B-Instruct"
    with pytest.raises(model.ModelError, match="not found"):
        model.resolve(str(tmp_path / "missing"))
    with pytest.raises(model.ModelError, match="not a model directory"):
        model.resolve(str(tmp_path))
    with pytest.raises(model.ModelError, match="unknown catalog model"):
        model.make_model("pdlab-huge")
