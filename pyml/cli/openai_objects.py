"""OpenAI's reply objects as pyml writes them: a completion's choices and envelope, its usage and
finish reasons. pyml-serve answers with them, and pyml-batch writes them for lines in OpenAI's batch
format; one place, so both say the same."""

from __future__ import annotations

import uuid

FINISH = {"eos": "stop", "stop": "stop", "max_tokens": "length", "context": "length", "cancelled": "stop"}


def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]


def choice(chat: bool, text: str | None, finish: str | None, delta: bool = False, index: int = 0,
           logprobs=None) -> dict:
    """One choice of a reply (chat: a message, or a stream's delta; completions: its text)."""
    if chat:
        content = {"delta": {} if text is None else {"content": text}} if delta else \
            {"message": {"role": "assistant", "content": text}}
        return {"index": index, **content, "finish_reason": finish, "logprobs": logprobs}
    return {"index": index, "text": text or "", "finish_reason": finish, "logprobs": logprobs}


def envelope(chat: bool, delta: bool, reply_id: str, created: int, model: str, choices: list) -> dict:
    kind = ("chat.completion.chunk" if delta else "chat.completion") if chat else "text_completion"
    return {"id": reply_id, "object": kind, "created": created, "model": model, "system_fingerprint": "pyml",
            "choices": choices}


def usage(*prompts: list) -> dict:
    """OpenAI's usage of a request's choices (a list of results per prompt): each prompt counted
    once, every choice's tokens."""
    n_prompt = sum(len(results[0].prompt_tokens) for results in prompts)
    n_gen = sum(len(r.tokens) for results in prompts for r in results)
    return {"prompt_tokens": n_prompt, "completion_tokens": n_gen, "total_tokens": n_prompt + n_gen,
            "prompt_tokens_details": {"cached_tokens": sum(results[0].cached_tokens for results in prompts)}}
