"""pyml-serve's log-probabilities in OpenAI's two shapes, from nlp/logprobs.py's TokenLogprobs.

Chat (`logprobs: true`, `top_logprobs: n`): `{"content": [{"token", "logprob", "bytes",
"top_logprobs": [...]}], "refusal": null}`. Completions (legacy, `logprobs: n`, `echo`): `{"tokens",
"token_logprobs", "top_logprobs", "text_offset"}`, parallel lists; with echo the prompt's tokens come
first, the first one's log-probability and top null (nothing comes before it), as OpenAI's and
llama-server's. A token is named by its text; a token that is not whole UTF-8 on its own (a piece of a
character) is written `bytes:\\xe2\\x80`, as OpenAI writes it, and `bytes` carries its raw bytes.
"""

from __future__ import annotations

from pyml.nlp.logprobs import TokenLogprob


class TokenNames:
    """Each token id's text and bytes, as the replies name them (looked up once per id)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.known = tokenizer, {}

    def bytes(self, token: int) -> bytes:
        return self.tokenizer.token_bytes(token) if self.tokenizer is not None else b""

    def text(self, token: int) -> str:
        if token not in self.known:
            raw = self.bytes(token)
            try:
                self.known[token] = raw.decode("utf-8")
            except UnicodeDecodeError:
                self.known[token] = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
        return self.known[token]


def chat_content(names: TokenNames, entries: list[TokenLogprob]) -> list:
    """The chat API's `logprobs.content` items for these tokens."""
    def item(token: int, logprob: float) -> dict:
        return {"token": names.text(token), "logprob": logprob, "bytes": list(names.bytes(token))}
    return [{**item(e.token, e.logprob), "top_logprobs": [item(t, v) for t, v in e.top]} for e in entries]


def chat_logprobs(names: TokenNames, entries: list[TokenLogprob]) -> dict:
    return {"content": chat_content(names, entries), "refusal": None}


class CompletionLogprobs:
    """The completions API's `logprobs` objects of one choice, in order (a whole reply is one call,
    a stream one per chunk): `text_offset` runs on across calls from where the choice's text starts."""

    def __init__(self, names: TokenNames, offset: int = 0):
        self.names, self.offset = names, offset

    def first_token(self, token: int) -> dict:
        """The prompt's first token under echo: named, with no log-probability."""
        return self._object([(token, None, None)])

    def of(self, entries: list[TokenLogprob]) -> dict:
        return self._object([(e.token, e.logprob, {self.names.text(t): v for t, v in e.top}) for e in entries])

    def _object(self, rows) -> dict:
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token, logprob, top in rows:
            text = self.names.text(token)
            out["tokens"].append(text)
            out["token_logprobs"].append(logprob)
            out["top_logprobs"].append(top)
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        return out


def joined(parts: list[dict]) -> dict:
    """Completions logprobs objects one after another, as one."""
    return {key: [v for p in parts for v in p[key]] for key in ("tokens", "token_logprobs", "top_logprobs",
                                                                  "text_offset")}


class Replies:
    """One request's log-probabilities as its reply carries them: a choice's whole, or a stream's a
    chunk at a time (the tokens whose text the chunk carries; a token that added no text, such as the
    end token, goes in a chunk of its own before the last). Every method gives None when none were asked."""

    def __init__(self, tokenizer, request, chat: bool, prompt_ids: list):
        self.top, self.chat, self.echo, self.prompt_ids = request.logprobs, chat, request.echo, prompt_ids
        self.names = TokenNames(tokenizer)
        self.offset = 0 if self.echo else len(request.prompt)  # where the generated text starts in a choice's
        self.lines: dict = {}  # choice index -> its CompletionLogprobs (text offsets run on)
        self.pending: dict = {}  # choice index -> TokenLogprobs not yet sent

    def whole(self, result) -> dict | None:
        if self.top is None:
            return None
        if self.chat:
            return chat_logprobs(self.names, result.logprobs)
        line = CompletionLogprobs(self.names, self.offset)
        parts = [line.first_token(self.prompt_ids[0]), line.of(result.prompt_logprobs)] if self.echo else []
        return joined(parts + [line.of(result.logprobs)])

    def prompt(self, index: int, entries: list | None) -> dict | None:
        """A stream's echoed prompt (completions)."""
        if self.top is None:
            return None
        line = self._line(index)
        return joined([line.first_token(self.prompt_ids[0]), line.of(entries)])

    def add(self, index: int, entries: list) -> None:
        self.pending.setdefault(index, []).extend(entries)

    def take(self, index: int) -> dict | None:
        entries = self.pending.pop(index, [])
        if self.top is None:
            return None
        return chat_logprobs(self.names, entries) if self.chat else self._line(index).of(entries)

    def waiting(self) -> list[int]:
        return [i for i, entries in self.pending.items() if entries]

    def _line(self, index: int) -> CompletionLogprobs:
        return self.lines.setdefault(index, CompletionLogprobs(self.names, self.offset))
