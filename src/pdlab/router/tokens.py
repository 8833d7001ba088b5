"""Exact prompt token counts with the served model's own tokenizer, the way vLLM counts them.

- Completions: the prompt encoded with special tokens (vLLM's `add_special_tokens=True` default), so the BOS the
  tokenizer's post-processor adds is counted. Token-id prompts are counted as they are.
- Chat: the messages rendered through the model's chat template with `add_generation_prompt=True` (the way
  Hugging Face's `apply_chat_template` renders it, which vLLM calls), then encoded without special tokens
  (vLLM's chat default: the template is responsible for them).

Counts are cached (LRU), since benchmarks and chat sessions send the same prompts again and again.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer


class PromptError(ValueError):
    """A prompt that cannot be tokenized as given; `param` names the request field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class TokenizedPrompt:
    token_ids: tuple[int, ...]

    @property
    def count(self) -> int:
        return len(self.token_ids)


class PromptTokenizer:
    """Tokenizes completion prompts and chat conversations for one model directory."""

    def __init__(self, model_dir: str | Path, cache_size: int = 4096):
        model_dir = Path(model_dir)
        tokenizer_file = model_dir / "tokenizer.json"
        if not tokenizer_file.exists():
            raise FileNotFoundError(f"{tokenizer_file} not found: the router needs the served model's tokenizer.json")
        self._tokenizer = Tokenizer.from_file(str(tokenizer_file))
        config_file = model_dir / "tokenizer_config.json"
        config: dict[str, Any] = json.loads(config_file.read_text()) if config_file.exists() else {}
        template_file = model_dir / "chat_template.jinja"
        template_source = template_file.read_text() if template_file.exists() else config.get("chat_template")
        if isinstance(template_source, list):  # named templates: take the default one
            template_source = next((t["template"] for t in template_source if t.get("name") == "default"), None)
        # Same environment as transformers' chat template rendering.
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.globals["raise_exception"] = _raise_template_error
        self._chat_template = env.from_string(template_source) if template_source else None
        self._special = {key: _token_text(config.get(key)) for key in ("bos_token", "eos_token", "unk_token",
                                                                        "pad_token")}
        self._cache: OrderedDict[tuple[str, str], TokenizedPrompt] = OrderedDict()
        self._cache_size = cache_size

    @property
    def tokenizer(self) -> Tokenizer:
        return self._tokenizer

    def _cached(self, key: tuple[str, str], make) -> TokenizedPrompt:
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            return hit
        value = make()
        self._cache[key] = value
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return value

    def completion(self, prompt: Any) -> TokenizedPrompt:
        """A `/v1/completions` prompt: a string, a list of token ids, or a one-element list of either.
        (vLLM treats longer lists as a batch of prompts; the router routes one prompt per request.)"""
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return self._cached(("text", prompt), lambda: TokenizedPrompt(
                tuple(self._tokenizer.encode(prompt, add_special_tokens=True).ids)))
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            if not prompt:
                raise PromptError("prompt is an empty list of token ids", "prompt")
            return TokenizedPrompt(tuple(prompt))
        raise PromptError("prompt must be a string, a list of token ids, or a one-element list of either "
                          "(the router routes one prompt per request)", "prompt")

    def chat(self, messages: Any, chat_template_kwargs: dict[str, Any] | None = None) -> TokenizedPrompt:
        """A `/v1/chat/completions` conversation, rendered with the model's chat template."""
        if not isinstance(messages, list) or not messages:
            raise PromptError("messages must be a non-empty list of {role, content} objects", "messages")
        normalized = []
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise PromptError(f"messages[{i}] must be an object with a string 'role'", f"messages.{i}")
            normalized.append({**message, "content": _text_content(message.get("content"), i)})
        if self._chat_template is None:
            raise PromptError("the served model has no chat template; use /v1/completions", "messages")
        kwargs = {"add_generation_prompt": True, **(chat_template_kwargs or {})}
        rendered = self._chat_template.render(messages=normalized, **self._special, **kwargs)
        return self._cached(("chat", rendered), lambda: TokenizedPrompt(
            tuple(self._tokenizer.encode(rendered, add_special_tokens=False).ids)))


def _text_content(content: Any, index: int) -> str:
    """vLLM's 'string' content format: text parts joined by newlines."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            else:
                raise PromptError(f"messages[{index}].content: only text parts are supported", f"messages.{index}")
        return "\n".join(texts)
    raise PromptError(f"messages[{index}].content must be a string or a list of text parts", f"messages.{index}")


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # AddedToken serialized form
        return value.get("content")
    return value


def _raise_template_error(message: str) -> None:
    raise PromptError(f"chat template: {message}", "messages")
