"""Exact prompt token counts with the served model's own tokenizer, the way vLLM counts them.

- Completions: the prompt encoded with special tokens (vLLM's `add_special_tokens=True` default), so the BOS the
  tokenizer's post-processor adds is counted. Token-id prompts are counted as they are.
- Chat: the messages rendered through the model's chat template with `add_generation_prompt=True` (the way
  Hugging Face's `apply_chat_template` renders it, which vLLM calls), then encoded without special tokens
  (vLLM's chat default: the template is responsible for them).

Hostile input is cheap to refuse: with `max_tokens`, a text too long to fit (more characters than `max_tokens`
tokens of the longest vocabulary entry could cover) is refused before it is tokenized; `*_async` tokenize long
texts on a worker thread (the `tokenizers` batch call releases the GIL), so the router's event loop keeps serving.
Counts are cached (LRU) once they are known to fit, bounded in bytes, keyed by a digest of the text (the text
itself is not kept); benchmarks and chat sessions send the same prompts again and again.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import threading
from array import array
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

#: Default byte budget of the token-count cache.
CACHE_BYTES = 64 * 2**20
#: Texts up to this many characters are tokenized on the calling thread (about a millisecond); longer ones go to
#: a worker thread.
INLINE_CHARS = 2048
#: Worker threads tokenizing long texts (more would only queue for the same cores).
WORKERS = 2
#: Cache bookkeeping per entry beyond the token ids (key, dict and object overhead), for the byte budget.
_ENTRY_OVERHEAD = 200
#: Chat template variables a request's `chat_template_kwargs` may not replace.
_RESERVED_TEMPLATE_VARS = frozenset({"messages"})


class PromptError(ValueError):
    """A prompt that cannot be tokenized as given; `param` names the request field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


class PromptTooLong(PromptError):
    """A prompt longer than the context: `tokens` is its count, or a lower bound when it was refused untokenized."""

    def __init__(self, tokens: int, max_tokens: int, param: str, exact: bool):
        what = f"{tokens} input tokens" if exact else f"at least {tokens} input tokens"
        super().__init__(f"This model's maximum context length is {max_tokens} tokens. However, your prompt "
                         f"contains {what}.", param)
        self.tokens = tokens


@dataclass(frozen=True)
class TokenizedPrompt:
    token_ids: array | tuple[int, ...]
    """`array('I')` (4 bytes a token), or a tuple for a prompt given as token ids."""

    @property
    def count(self) -> int:
        return len(self.token_ids)


class PromptTokenizer:
    """Tokenizes completion prompts and chat conversations for one model directory."""

    def __init__(self, model_dir: str | Path, cache_bytes: int = CACHE_BYTES):
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
        # An upper bound of the characters one token covers: its vocabulary string's length (byte-level entries
        # map each byte to one character, so they cover no more characters than they have), doubled for
        # normalizers that merge characters (NFC composition).
        vocab = self._tokenizer.get_vocab(with_added_tokens=True)
        self.max_chars_per_token = 2 * max((len(token) for token in vocab), default=1)
        self._cache: OrderedDict[bytes, array] = OrderedDict()
        self._lock = threading.Lock()  # the event loop and the worker threads share the cache
        self.cache_bytes = cache_bytes
        self.cached_bytes = 0
        self._workers: ThreadPoolExecutor | None = None

    @property
    def tokenizer(self) -> Tokenizer:
        return self._tokenizer

    # --- counting -----------------------------------------------------------------------------------------------

    def completion(self, prompt: Any, max_tokens: int | None = None) -> TokenizedPrompt:
        """A `/v1/completions` prompt: a string, a list of token ids, or a one-element list of either.
        (vLLM treats longer lists as a batch of prompts; the router routes one prompt per request.) With
        `max_tokens`, a longer prompt raises PromptTooLong (and is never cached)."""
        text = self._completion_text(prompt, max_tokens)
        if not isinstance(text, str):
            return text
        return TokenizedPrompt(self._encode(b"text", text, True, max_tokens, "prompt", inline=True))

    def chat(self, messages: Any, chat_template_kwargs: Any = None, max_tokens: int | None = None
             ) -> TokenizedPrompt:
        """A `/v1/chat/completions` conversation, rendered with the model's chat template."""
        rendered = self._render(messages, chat_template_kwargs, max_tokens)
        return TokenizedPrompt(self._encode(b"chat", rendered, False, max_tokens, "messages", inline=True))

    async def completion_async(self, prompt: Any, max_tokens: int | None = None) -> TokenizedPrompt:
        """`completion`, with a long text tokenized on a worker thread."""
        text = self._completion_text(prompt, max_tokens)
        if not isinstance(text, str):
            return text
        hit = self._lookup(b"text", text, "prompt")
        if hit is not None:
            return TokenizedPrompt(hit)
        if len(text) <= INLINE_CHARS:
            return TokenizedPrompt(self._encode(b"text", text, True, max_tokens, "prompt", inline=True))
        return TokenizedPrompt(await self._off_loop(self._encode, b"text", text, True, max_tokens, "prompt", False))

    async def chat_async(self, messages: Any, chat_template_kwargs: Any = None, max_tokens: int | None = None
                         ) -> TokenizedPrompt:
        """`chat`, rendered and tokenized on a worker thread when the conversation is long."""
        if _conversation_chars(messages) <= INLINE_CHARS:
            return self.chat(messages, chat_template_kwargs, max_tokens)

        def render_and_encode() -> array:
            rendered = self._render(messages, chat_template_kwargs, max_tokens)
            return self._encode(b"chat", rendered, False, max_tokens, "messages", inline=False)

        return TokenizedPrompt(await self._off_loop(render_and_encode))

    # --- internals ----------------------------------------------------------------------------------------------

    async def _off_loop(self, function: Any, *args: Any) -> array:
        if self._workers is None:
            self._workers = ThreadPoolExecutor(WORKERS, thread_name_prefix="pdlab-tokenize")
        return await asyncio.get_running_loop().run_in_executor(self._workers, function, *args)

    def _completion_text(self, prompt: Any, max_tokens: int | None) -> str | TokenizedPrompt:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            self._check_chars(prompt, max_tokens, "prompt")
            return prompt
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            if not prompt:
                raise PromptError("prompt is an empty list of token ids", "prompt")
            if max_tokens is not None and len(prompt) > max_tokens:
                raise PromptTooLong(len(prompt), max_tokens, "prompt", exact=True)
            return TokenizedPrompt(tuple(prompt))
        raise PromptError("prompt must be a string, a list of token ids, or a one-element list of either "
                          "(the router routes one prompt per request)", "prompt")

    def _check_chars(self, text: str, max_tokens: int | None, param: str) -> None:
        """Refuse, untokenized, a text with more characters than `max_tokens` tokens can cover."""
        if max_tokens is not None and len(text) > max_tokens * self.max_chars_per_token:
            raise PromptTooLong(-(-len(text) // self.max_chars_per_token), max_tokens, param, exact=False)

    def _render(self, messages: Any, chat_template_kwargs: Any, max_tokens: int | None) -> str:
        if not isinstance(messages, list) or not messages:
            raise PromptError("messages must be a non-empty list of {role, content} objects", "messages")
        normalized = []
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise PromptError(f"messages[{i}] must be an object with a string 'role'", f"messages.{i}")
            normalized.append({**message, "content": _text_content(message.get("content"), i)})
        if self._chat_template is None:
            raise PromptError("the served model has no chat template; use /v1/completions", "messages")
        if chat_template_kwargs is None:
            chat_template_kwargs = {}
        if not isinstance(chat_template_kwargs, dict) or not all(isinstance(k, str) for k in chat_template_kwargs):
            raise PromptError("chat_template_kwargs must be an object of template variables", "chat_template_kwargs")
        if reserved := sorted(_RESERVED_TEMPLATE_VARS & set(chat_template_kwargs)):
            raise PromptError(f"chat_template_kwargs may not set {reserved}", "chat_template_kwargs")
        variables = {**self._special, "add_generation_prompt": True, **chat_template_kwargs}
        try:
            rendered = self._chat_template.render(messages=normalized, **variables)
        except PromptError:
            raise
        except (TemplateError, TypeError, ValueError, AttributeError, KeyError, IndexError, RecursionError) as error:
            raise PromptError(f"the chat template failed on these messages: {type(error).__name__}: {error}"[:500],
                              "messages") from None
        self._check_chars(rendered, max_tokens, "messages")
        return rendered

    def _key(self, kind: bytes, text: str, param: str) -> bytes:
        try:
            data = text.encode()
        except UnicodeEncodeError:
            raise PromptError(f"{param} is not valid Unicode (a lone surrogate such as \\ud800)", param) from None
        return hashlib.blake2b(data, digest_size=16, person=kind).digest()

    def _lookup(self, kind: bytes, text: str, param: str) -> array | None:
        return self._cached(self._key(kind, text, param))

    def _cached(self, key: bytes) -> array | None:
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
            return hit

    def _encode(self, kind: bytes, text: str, special: bool, max_tokens: int | None, param: str,
                inline: bool) -> array:
        key = self._key(kind, text, param)
        hit = self._cached(key)
        if hit is not None:
            return hit
        if inline:
            ids = self._tokenizer.encode(text, add_special_tokens=special).ids
        else:  # the batch call releases the GIL while it tokenizes
            ids = self._tokenizer.encode_batch([text], add_special_tokens=special)[0].ids
        if max_tokens is not None and len(ids) > max_tokens:
            raise PromptTooLong(len(ids), max_tokens, param, exact=True)
        tokens = array("I", ids)
        self._store(key, tokens)
        return tokens

    def _store(self, key: bytes, tokens: array) -> None:
        size = _ENTRY_OVERHEAD + 4 * len(tokens)
        if size > self.cache_bytes:
            return
        with self._lock:
            self._store_locked(key, tokens, size)

    def _store_locked(self, key: bytes, tokens: array, size: int) -> None:
        previous = self._cache.pop(key, None)  # another thread may have stored it meanwhile
        if previous is not None:
            self.cached_bytes -= _ENTRY_OVERHEAD + 4 * len(previous)
        self._cache[key] = tokens
        self.cached_bytes += size
        while self.cached_bytes > self.cache_bytes:
            _, evicted = self._cache.popitem(last=False)
            self.cached_bytes -= _ENTRY_OVERHEAD + 4 * len(evicted)


def _conversation_chars(messages: Any) -> int:
    """A cheap size of a conversation (its text content), to decide where to render it."""
    if not isinstance(messages, list):
        return 0
    total = 0
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            total += sum(len(p.get("text", "")) for p in content if isinstance(p, dict)
                         and isinstance(p.get("text"), str))
        total += 16
    return total


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

