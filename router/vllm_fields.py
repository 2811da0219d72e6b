"""vLLM's request extensions past those router/requests.py reads: the ones served here, and the
ones refused, with a 400 naming the field, when sent with a value that would change the answer.
Unknown fields are ignored (router/bodies.py), as OpenAI-compatible servers do; a vLLM field a
client counts on is not unknown, and ignoring it answered otherwise than asked without a word
(`min_p` had been).

Served:
- `prompt_logprobs: N` (0 to 20; not streamed, as in vLLM): each prompt token's logprob, rank and
  top N (router/responses.py);
- `include_stop_str_in_output`: the stop string that ended the answer stays in its text;
- `allowed_token_ids`: only these tokens are sampled (engine/penalties.py; not with a guide);
- `truncate_prompt_tokens: k`: the prompt's last k tokens are served and counted (-1: as many as
  leave the answer's max_tokens room; vLLM's -1, the context's worth, leaves none) (router/prompt_tokens.py);
  a text past the context is then tokenized, not refused;
- `return_tokens_as_token_ids`: logprobs name each token `token_id:<id>` (what a client with
  the ids needs where a token's text is not one piece of UTF-8);
- `bad_words`: no answer goes on to complete one of them (engine/penalties.py; each word's tokens
  as vLLM reads them, `bad_word_ids`);
- `cache_salt`: the prefix cache (its hits, its timing, the router's routing by it) is shared
  only among requests with the same salt (engine/cache_keys.py), as in vLLM: one tenant cannot
  learn another's prompts from a cached hit;
- `guided_grammar`: the answer is text an EBNF grammar derives (xgrammar's dialect, llama.cpp's
  GBNF: `root ::= ...`; engine/grammar.py), a guide as `guided_regex` is;
- `chat_template_kwargs` and `documents` (chats): more variables for the chat template, as vLLM
  and HF pass them (a template that reads none, as SmolLM2's, renders as without).

Refused unless neutral (`NEUTRAL`: the values that ask for nothing; clients send some of them
on every request): beam search and its length penalty, `spaces_between_special_tokens: false`,
the guides this server does not compile (`structural_tag`, `guided_whitespace_pattern`),
`logits_processors`, `vllm_xargs`, `kv_transfer_params`; on chats a custom
`chat_template`, `echo` and `mm_processor_kwargs`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import Field

from engine.sampling_params import MAX_BAD_WORDS, MAX_SALT_CHARS
from engine.tokenizer import Tokenizer
from router.bodies import StrictBody
from router.errors import APIError

NEUTRAL: dict[str, tuple[Any, ...]] = {
    "use_beam_search": (False,),
    "length_penalty": (1.0,),
    "spaces_between_special_tokens": (True,),
    "structural_tag": (),
    "guided_whitespace_pattern": (),
    "logits_processors": ([],),
    "vllm_xargs": ({},),
    "kv_transfer_params": ({},),
}
CHAT_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "chat_template": (),
    "echo": (False,),
    "mm_processor_kwargs": ({},),
}


def bad_word_ids(tokenizer: Tokenizer, words: Sequence[str] | None) -> tuple[tuple[int, ...], ...]:
    """vLLM's reading of `bad_words`: each word's tokens as written (its leading spaces stripped),
    and as a word after a space where that starts with another token and is as long."""
    sequences: list[tuple[int, ...]] = []
    for word in words or ():
        bare = tuple(tokenizer.encode(word.lstrip()))
        if not bare:
            raise APIError(400, "bad_words: a word must be more than spaces", param="bad_words")
        spaced = tuple(tokenizer.encode(" " + word.lstrip()))
        sequences += [bare, spaced] if spaced[0] != bare[0] and len(spaced) == len(bare) else [bare]
    return tuple(sequences)


def refuse_set(body: StrictBody, neutral: dict[str, tuple[Any, ...]]) -> None:
    """APIError (400) for the first field of `neutral` that `body` has with another value."""
    for name, values in neutral.items():
        value = getattr(body, name)
        if value is not None and value not in values:
            raise APIError(400, f"{name} is not supported by this server (a vLLM extension)", param=name)


class VLLMFields(StrictBody):
    prompt_logprobs: int | None = None  # each prompt token's logprob, rank and top N (router/responses.py)
    include_stop_str_in_output: bool = False
    allowed_token_ids: list[int] | None = Field(default=None, min_length=1, max_length=1 << 17)
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)  # 0 refused
    guided_grammar: str | None = None  # router/response_format.py
    bad_words: list[str] | None = Field(default=None, max_length=MAX_BAD_WORDS)
    cache_salt: str | None = Field(default=None, min_length=1, max_length=MAX_SALT_CHARS)
    return_tokens_as_token_ids: bool = False
    use_beam_search: Any = None  # NEUTRAL's: typed as sent, refused unless neutral
    length_penalty: Any = None
    spaces_between_special_tokens: Any = None
    structural_tag: Any = None
    guided_whitespace_pattern: Any = None
    logits_processors: Any = None
    vllm_xargs: Any = None
    kv_transfer_params: Any = None

    def check_vllm_fields(self, stream: bool) -> None:
        """APIError (400) for a field refused, or out of its range."""
        refuse_set(self, NEUTRAL)
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:  # -1 (vLLM: all) too
            why = f"prompt_logprobs must be from 0 to 20 (got {self.prompt_logprobs})"
            raise APIError(400, why, param="prompt_logprobs")
        if self.truncate_prompt_tokens == 0:
            raise APIError(400, "truncate_prompt_tokens must be -1 or at least 1", param="truncate_prompt_tokens")
        if stream and self.prompt_logprobs:  # vLLM's rule, in its words
            raise APIError(400, "`prompt_logprobs` are not available when `stream=True`.", param="prompt_logprobs")


class VLLMChatFields(StrictBody):
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, Any]] | None = None  # the template's `documents`, as vLLM and HF pass them
    chat_template: Any = None  # CHAT_NEUTRAL's
    echo: Any = None
    mm_processor_kwargs: Any = None

    def refuse_unserved_chat(self) -> None:
        refuse_set(self, CHAT_NEUTRAL)

    @property
    def template_variables(self) -> dict[str, Any]:
        """What the chat template reads past the messages: `chat_template_kwargs`, and `documents`."""
        documents = {"documents": self.documents} if self.documents else {}
        return {**(self.chat_template_kwargs or {}), **documents}
