"""Token counts equal what vLLM counts: Hugging Face's tokenizer on the same model directory (vLLM tokenizes
with it: completions with special tokens, chat through `apply_chat_template(add_generation_prompt=True)`)."""

from __future__ import annotations

import json

import pytest

from pdlab.router.tokens import PromptError, PromptTokenizer, PromptTooLong

PROMPTS = ["hello", "The quick brown fox jumps over the lazy dog.", "  spaces\tand\nnewlines  ", "ünïcödé ✓ 数字",
           "word " * 500]
CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is P/D disaggregation?"},
     {"role": "assistant", "content": "Splitting prefill and decode."}, {"role": "user", "content": "Why?"}],
    [{"role": "user", "content": [{"type": "text", "text": "two"}, {"type": "text", "text": "parts"}]}],
]



@pytest.fixture(scope="module")
def hf(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.mark.parametrize("text", PROMPTS)
def test_completion_count_matches_hf_with_bos(model_dir, hf, text):
    counted = PromptTokenizer(model_dir).completion(text)
    expected = hf(text)["input_ids"]  # add_special_tokens=True: the post-processor's BOS included
    assert list(counted.token_ids) == expected
    assert counted.token_ids[0] == hf.bos_token_id


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_chat_count_matches_hf_chat_template(model_dir, hf, messages):
    counted = PromptTokenizer(model_dir).chat(messages)
    hf_messages = [{**m, "content": "\n".join(p["text"] for p in m["content"]) if isinstance(m["content"], list)
                    else m["content"]} for m in messages]
    expected = hf.apply_chat_template(hf_messages, add_generation_prompt=True, tokenize=True)["input_ids"]
    assert list(counted.token_ids) == list(expected)


def test_token_id_prompts_and_batches_of_one(model_dir):
    tokenizer = PromptTokenizer(model_dir)
    assert tokenizer.completion([5, 6, 7]).count == 3
    assert tokenizer.completion([[5, 6]]).count == 2
    assert tokenizer.completion(["hello"]).count == tokenizer.completion("hello").count


@pytest.mark.parametrize(("prompt", "param"), [(["a", "b"], "prompt"), ([], "prompt"), (3, "prompt"),
                                               ([1, "x"], "prompt")])
def test_bad_completion_prompts(model_dir, prompt, param):
    with pytest.raises(PromptError) as caught:
        PromptTokenizer(model_dir).completion(prompt)
    assert caught.value.param == param


@pytest.mark.parametrize(("messages", "param"), [([], "messages"), ("hi", "messages"), ([{"content": "x"}],
                                                                                         "messages.0"),
                                                 ([{"role": "user", "content": 5}], "messages.0")])
def test_bad_chat_messages(model_dir, messages, param):
    with pytest.raises(PromptError) as caught:
        PromptTokenizer(model_dir).chat(messages)
    assert caught.value.param == param


def test_cache_returns_the_same_count(model_dir):
    tokenizer = PromptTokenizer(model_dir, cache_bytes=500)  # room for two short prompts
    first = tokenizer.completion("again and again")
    for text in ("x", "y", "z"):  # push it out of the cache
        tokenizer.completion(text)
    assert tokenizer.completion("again and again") == first


def test_cache_is_bounded_in_bytes_and_keeps_no_prompt_text(model_dir):
    """Distinct long prompts fill the cache only up to its byte budget; entries are keyed by a digest, so the
    prompt text is not kept (a 5k-token prompt costs its 4-byte token ids, not its text and a tuple of ints)."""
    budget = 256 * 1024
    tokenizer = PromptTokenizer(model_dir, cache_bytes=budget)
    for i in range(60):
        tokenizer.completion(f"prompt {i} " + "many words in a long prompt " * 500)
    assert 0 < tokenizer.cached_bytes <= budget
    assert all(isinstance(key, bytes) and len(key) == 16 for key in tokenizer._cache)


def test_a_prompt_over_the_context_is_never_cached_and_a_far_too_long_one_is_not_tokenized(model_dir):
    tokenizer = PromptTokenizer(model_dir)
    with pytest.raises(PromptTooLong, match="maximum context length is 100 tokens"):
        tokenizer.completion("word " * 200, max_tokens=100)
    assert tokenizer.cached_bytes == 0
    huge = "x" * (100 * tokenizer.max_chars_per_token + 1)
    calls = []
    tokenizer._tokenizer = _Spy(tokenizer._tokenizer, calls)
    with pytest.raises(PromptTooLong, match="at least"):
        tokenizer.completion(huge, max_tokens=100)
    assert calls == []  # refused by its length in characters alone


class _Spy:
    def __init__(self, inner, calls):
        self.inner, self.calls = inner, calls

    def encode(self, *args, **kwargs):
        self.calls.append(args)
        return self.inner.encode(*args, **kwargs)


@pytest.mark.parametrize("kwargs", [["not", "an", "object"], {"messages": []}, {1: 2}, {"add_generation_prompt": [1]}])
def test_bad_chat_template_kwargs_are_prompt_errors(model_dir, kwargs):
    tokenizer = PromptTokenizer(model_dir)
    try:
        tokenizer.chat([{"role": "user", "content": "hi"}], kwargs)
    except PromptError as error:
        assert error.param in ("chat_template_kwargs", "messages")


def test_a_lone_surrogate_is_a_prompt_error(model_dir):
    with pytest.raises(PromptError, match="lone surrogate"):
        PromptTokenizer(model_dir).completion(json.loads(r'"bad \ud800 text"'))
