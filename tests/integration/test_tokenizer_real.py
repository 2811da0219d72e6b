from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
from tokenizers import pre_tokenizers

from engine.errors import InvalidRequestError
from engine.model_files import default_model_path
from engine.tokenizer import Tokenizer

BATTERY = [
    "Hello, world! How are you today?",
    "12345 and 3.14",
    "v1.2.3 released on 2024-01-01 at 10:30, costs $1,000,000",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    'for (int i = 0; i < 10; ++i) { printf("%d\\n", i); }',
    "Café naïve résumé façade Ångström",
    "日本語のテキスト、中文测试，한국어 텍스트입니다",
    "Emoji: 😀👍🏽🇺🇸 and ❤️",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text<|im_end|><file_sep>",
    "  leading and trailing spaces  ",
    "\n\n\nnewlines\n\ttabs\r\n",
    "I'm sure they'll say it's fine, don't you think?",
    "",
    " ",
]

# Whitespace right before a digit. The real SmolLM2 tokenizer.json pre-tokenizes with
# Sequence[Digits(individual_digits=True), ByteLevel], as llama.cpp's 'smollm' does; transformers' GGUF
# conversion drops the Digits step, so for these it splits "  2" into "Ġ","Ġ","2" instead of "ĠĠ","2".
DIGIT_SPACING = ["  2", "a  12\n\n3", "x\n 1", "\t\t7", "1 2  3   4", "Total:\n\n  42 items"]

CONVERSATIONS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "user", "content": "Tell me a joke."},
        {"role": "assistant", "content": "Why did the 🐔 cross the road?"},
        {"role": "user", "content": "Why?"},
    ],
]


@pytest.fixture(scope="module")
def path() -> Path:
    return default_model_path()


@pytest.fixture(scope="module")
def ours(path: Path) -> Tokenizer:
    return Tokenizer.from_gguf(path)


@pytest.fixture(scope="module")
def hf(path: Path) -> Any:
    os.environ["HF_HUB_OFFLINE"] = "1"
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="module")
def smollm2_reference(hf: Any) -> Any:
    """HF's GGUF tokenizer with the pre-tokenizer of SmolLM2's own tokenizer.json put back."""
    backend = type(hf.backend_tokenizer).from_str(hf.backend_tokenizer.to_str())
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    return backend


def test_loads_from_gguf_fast(path: Path) -> None:
    start = time.perf_counter()
    Tokenizer.load(path)
    assert time.perf_counter() - start < 2.0


@pytest.mark.parametrize("text", BATTERY)
def test_encode_matches_hf(ours: Tokenizer, hf: Any, text: str) -> None:
    assert ours.encode(text) == hf.encode(text)


@pytest.mark.parametrize("text", BATTERY + DIGIT_SPACING)
def test_encode_matches_smollm2_pre_tokenizer(ours: Tokenizer, smollm2_reference: Any, text: str) -> None:
    assert ours.encode(text) == smollm2_reference.encode(text, add_special_tokens=False).ids


def test_digits_are_split_individually(ours: Tokenizer) -> None:
    ids = ours.encode("  2024")
    assert [ours.id_to_token(i) for i in ids] == ["ĠĠ", "2", "0", "2", "4"]


@pytest.mark.parametrize("text", BATTERY + DIGIT_SPACING)
def test_decode_round_trips(ours: Tokenizer, hf: Any, text: str) -> None:
    ids = ours.encode(text)
    assert ours.decode(ids, skip_special_tokens=False) == text
    assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)


def test_special_ids(ours: Tokenizer, hf: Any) -> None:
    assert ours.vocab_size == 49152 == len(hf)
    assert (ours.bos_token_id, ours.eos_token_id) == (1, 2) == (hf.bos_token_id, hf.eos_token_id)
    assert ours.id_to_token(1) == "<|im_start|>" and ours.id_to_token(2) == "<|im_end|>"
    assert ours.stop_token_ids == {0, 2}  # <|im_end|> (eos) and <|endoftext|>
    assert ours.special_token_ids == set(range(17)) == {i for i, t in hf.added_tokens_decoder.items() if t.special}
    assert ours.id_to_token(49152) is None


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_hf(
    ours: Tokenizer, hf: Any, messages: list[dict[str, str]], add_generation_prompt: bool
) -> None:
    expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    rendered = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    assert rendered == expected
    assert ours.encode(rendered) == hf.encode(expected)


def test_chat_template_default_system_prompt(ours: Tokenizer) -> None:
    assert ours.apply_chat_template([{"role": "user", "content": "hi"}]) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )


@pytest.mark.parametrize(
    "messages",
    [[], "hello", [{"role": "user"}], [{"role": "user", "content": 3}], [["user", "hi"]], [{"content": "hi"}]],
)
def test_invalid_messages_raise(ours: Tokenizer, messages: Any) -> None:
    with pytest.raises(InvalidRequestError) as info:
        ours.apply_chat_template(messages)
    assert info.value.param == "messages"


def test_from_hf_dir(hf: Any, tmp_path: Path) -> None:
    hf.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    tok = Tokenizer.load(tmp_path)
    assert (tok.bos_token_id, tok.eos_token_id, tok.vocab_size) == (1, 2, 49152)
    assert tok.stop_token_ids == {0, 2}
    assert tok.special_token_ids == set(range(17))
    for text in BATTERY:
        assert tok.encode(text) == hf.encode(text)
    messages = CONVERSATIONS[1]
    assert tok.apply_chat_template(messages) == hf.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
