"""Prompt text with an exact token count for the served model, made from the words of pdlab's corpus.

Why exact: the router decides by token count (threshold 4096 means 4096, not "about 4,000 words"), and HOL
blocking scales with prefill length, so a lab must know how many tokens each prompt really is.

How: the text is a run of pieces " word" (a space, then a corpus word). The tokenizer's byte-level
pre-tokenizer never merges across a leading space, so a text's token count is the sum of its pieces' counts,
and a piece that would overshoot is replaced by one-token filler pieces. Every prompt is re-encoded at the end
and a mismatch is an error, never a silent approximation.
"""

from __future__ import annotations

import hashlib
import random
from pathlib import Path

from tokenizers import Tokenizer

from pdlab.config.workload import Api
from pdlab.router.tokens import PromptError as RouterPromptError
from pdlab.router.tokens import PromptTokenizer, TokenizedPrompt
from pdlab.settings import data_dir


class PromptError(RuntimeError):
    """A prompt that cannot be made with the asked token count."""


def corpus_words(path: Path | None = None) -> list[str]:
    """The words of `data/corpus/serving-notes.txt` (or `path`), in order."""
    path = path or data_dir() / "corpus" / "serving-notes.txt"
    words = path.read_text().split()
    if not words:
        raise PromptError(f"{path} holds no words")
    return words


def as_sent(tokenizer: PromptTokenizer, prompt: str, api: Api = "completions") -> TokenizedPrompt:
    """`prompt` tokenized as vLLM and the router see it when pdlab's load generator sends it: completion text, or
    one user message rendered with the chat template."""
    if api == "chat":
        return tokenizer.chat([{"role": "user", "content": prompt}])
    return tokenizer.completion(prompt)


class PromptBuilder:
    """Makes prompts of an exact token count for one tokenizer (a model directory with tokenizer.json).

    Counts follow vLLM's `usage.prompt_tokens`: for `/v1/completions` the encoded text plus the BOS token the
    tokenizer's post-processor adds; for `/v1/chat/completions` the rendered chat template, encoded without
    special tokens (vLLM's default for chat)."""

    def __init__(self, model_dir: str | Path, words: list[str] | None = None):
        model_dir = Path(model_dir)
        tokenizer_file = model_dir / "tokenizer.json"
        if not tokenizer_file.exists():
            raise PromptError(f"{model_dir} has no tokenizer.json: prompts cannot be sized for this model")
        # Counting is the router's: one implementation of "how many tokens vLLM will see".
        self.counter = PromptTokenizer(model_dir)
        self.tokenizer = self.counter.tokenizer
        self.words = words or corpus_words()
        self.piece_tokens = _PieceCounter(self.tokenizer)
        self.filler = self._one_token_piece()

    def _one_token_piece(self) -> str:
        for word in ("the", "a", "and", *self.words):
            if self.piece_tokens(" " + word) == 1:
                return " " + word
        raise PromptError("no corpus word is a single token: cannot pad prompts to an exact length")

    # -- token counts as vLLM reports them ------------------------------------------------------------------

    def count(self, prompt: str, api: Api = "completions") -> int:
        try:
            return as_sent(self.counter, prompt, api).count
        except RouterPromptError as error:
            raise PromptError(str(error)) from None

    # -- text --------------------------------------------------------------------------------------------------

    def body(self, tokens: int, key: str) -> str:
        """Text of exactly `tokens` tokens (no BOS), starting at a corpus position derived from `key`."""
        if tokens < 0:
            raise PromptError(f"cannot make a text of {tokens} tokens")
        start = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") % len(self.words)
        pieces: list[str] = []
        left, i = tokens, start
        while left > 0:
            piece = " " + self.words[i % len(self.words)]
            i += 1
            size = self.piece_tokens(piece)
            if size <= left:
                pieces.append(piece)
                left -= size
            else:
                pieces.extend([self.filler] * left)
                left = 0
        return "".join(pieces)

    def prompt(self, tokens: int, key: str, api: Api = "completions", prefix: str = "") -> str:
        """A prompt counting exactly `tokens` tokens for `api`, starting with `prefix` (itself made of pieces)."""
        prefix_tokens = self.body_tokens(prefix)
        need = tokens - self.count("", api) - prefix_tokens
        for _ in range(3):  # the chat template's newline next to empty content can tokenize differently
            if need < 0:
                raise PromptError(f"a {api} prompt of {tokens} tokens is too short for its template and prefix")
            text = prefix + self.body(need, key)
            got = self.count(text, api)
            if got == tokens:
                return text
            need += tokens - got
        raise PromptError(f"made a prompt of {got} tokens instead of {tokens} (key {key!r})")

    def body_tokens(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False).ids) if text else 0


class _PieceCounter:
    """Token count of one " word" piece, memoised per builder (corpus words repeat)."""

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer
        self._counts: dict[str, int] = {}

    def __call__(self, piece: str) -> int:
        if piece not in self._counts:
            self._counts[piece] = len(self._tokenizer.encode(piece, add_special_tokens=False).ids)
        return self._counts[piece]


def seeded_rng(seed: int, *parts: object) -> random.Random:
    """A Random seeded from `seed` and labels, so independent streams (arrivals, classes) do not interfere."""
    digest = hashlib.sha256(repr((seed, *parts)).encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))
