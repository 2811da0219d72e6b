"""Structured output (engine/grammar.py) with the real tokenizer and random logits: whatever the
logits say, greedy or sampled, the tokens the sampler picks under `allowed_tokens` spell JSON
that the schema accepts, and the engine's checks refuse what cannot be guided."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

from engine.errors import InvalidRequestError
from engine.grammar import Grammars, Guide, allowed_tokens, grammatical
from engine.model import LlamaModel
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer
from tests.unit.tiny import make_engine

pytest.importorskip("xgrammar", reason="structured output needs xgrammar (make setup installs it)")

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "temp": {"type": "integer"},
        "rain": {"type": "boolean"},
    },
    "required": ["city", "temp", "rain"],
    "additionalProperties": False,
}


def guided_text(tok: Tokenizer, grammars: Grammars, guide: Guide, params: SamplingParams, seed: int) -> str:
    """Tokens drawn from random logits under the guide until its grammar ends it (at most 200)."""
    vocab = tok.vocab_size
    matcher = grammars.matcher(guide)
    gen = torch.Generator().manual_seed(seed)
    sampler, ids = Sampler(), []
    for i in range(200):
        logits = torch.randn(1, vocab, generator=gen) * 3
        allowed = allowed_tokens([matcher], vocab, logits.device)
        assert allowed is not None and allowed.shape == (1, vocab) and 0 < int(allowed.sum()) < vocab
        out = sampler(logits, [params], [i], [None], allowed)
        token = out.token_ids[0]
        assert allowed[0, token], "never a token the grammar rules out"
        if out.logprobs[0] is not None:  # the model's logprob, as without the mask
            assert out.logprobs[0].logprob == pytest.approx(torch.log_softmax(logits, -1)[0, token].item(), abs=1e-5)
        assert matcher.accept_token(token)
        if matcher.is_terminated():
            break
        ids.append(token)
    assert matcher.is_terminated(), "it ends within 200 tokens: the schema bounds it"
    return tok.decode(ids)


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=5, logprobs=1)],
    ids=["greedy", "sampled"],
)
def test_random_logits_under_a_schema_spell_an_instance_of_it(
    smollm_tokenizer: Tokenizer, params: SamplingParams, seed: int
) -> None:
    grammars = Grammars(smollm_tokenizer, smollm_tokenizer.vocab_size)
    text = guided_text(smollm_tokenizer, grammars, Guide("json_schema", json.dumps(SCHEMA)), params, seed)
    value: Any = json.loads(text)
    assert set(value) == {"city", "temp", "rain"} and isinstance(value["temp"], int)
    assert isinstance(value["city"], str) and len(value["city"]) <= 12 and isinstance(value["rain"], bool)


def test_json_object_is_an_object_and_unguided_rows_are_left_alone(smollm_tokenizer: Tokenizer) -> None:
    tok = smollm_tokenizer
    grammars = Grammars(tok, tok.vocab_size)
    matcher = grammars.matcher(Guide("json"))
    assert all(matcher.accept_token(t) for t in tok.encode('{"a": [1, 2], "b": {"c": null}}'))
    assert matcher.accept_token(tok.eos_token_id) and matcher.is_terminated(), "complete: it may end"
    matcher = grammars.matcher(Guide("json"))
    mask = allowed_tokens([None, matcher, None], tok.vocab_size, torch.device("cpu"))
    assert mask is not None and mask[0].all() and mask[2].all()
    assert mask[1, tok.encode("{")[0]] and not mask[1, tok.encode("[")[0]] and not mask[1, tok.eos_token_id]
    assert allowed_tokens([None, None], 10, torch.device("cpu")) is None, "no guided row: no mask"


def test_what_cannot_be_guided_is_refused(smollm_tokenizer: Tokenizer) -> None:
    with pytest.raises(InvalidRequestError, match="not JSON"):
        Guide("json_schema", "{not json")
    grammars = Grammars(smollm_tokenizer, smollm_tokenizer.vocab_size)
    with pytest.raises(InvalidRequestError, match="cannot be used") as refused:
        grammars.matcher(Guide("json_schema", '{"type": "nonsense"}'))
    assert refused.value.param == "response_format"
    with pytest.raises(InvalidRequestError, match="cannot be used") as refused:  # router/tools.py's
        grammars.matcher(Guide("json_schema", '{"type": "nonsense"}', field="tools"))
    assert refused.value.param == "tools"
    with pytest.raises(InvalidRequestError, match="no tokenizer"):
        Grammars(None, 128).matcher(Guide("json"))
    with pytest.raises(InvalidRequestError, match="min_tokens"):
        SamplingParams(guide=Guide("json"), min_tokens=3)


def test_a_burst_of_first_guided_requests_builds_one_compiler(
    smollm_tokenizer: Tokenizer, caplog: pytest.LogCaptureFixture
) -> None:
    """The compiler (transformers' copy of the tokenizer, xgrammar's view of the vocabulary) is
    built once, the requests that came with the first waiting for it, not once by each."""
    grammars = Grammars(smollm_tokenizer, smollm_tokenizer.vocab_size)
    guides = [Guide("json"), Guide.choice(["yes", "no"]), Guide("regex", "[0-9]+"), Guide("json")] * 2
    with caplog.at_level("INFO", logger="engine.grammar"), ThreadPoolExecutor(len(guides)) as pool:
        compiled = list(pool.map(grammars.compiled, guides))
    assert all(c is not None for c in compiled)
    assert sum("compiler built" in r.getMessage() for r in caplog.records) == 1


def test_a_worker_compiles_before_it_takes_the_engine_lock(tiny_model: LlamaModel) -> None:
    """`Engine.prepare` compiles a guided request's grammar ahead (or refuses it), and passes
    any other request by; `add_request` then refuses the same."""
    engine = make_engine(tiny_model, num_blocks=16)  # token ids only: no tokenizer, no grammar
    engine.prepare(SamplingParams())
    guided = SamplingParams(guide=Guide("json"))
    with pytest.raises(InvalidRequestError, match="no tokenizer"):
        engine.prepare(guided)
    with pytest.raises(InvalidRequestError, match="no tokenizer"):
        engine.add_request("r", [1, 2, 3], guided)
    engine.check_integrity()
    assert engine.kv.num_free_blocks == 16 and not engine.has_unfinished()


def test_a_regex_or_a_choice_is_matched_whole(smollm_tokenizer: Tokenizer) -> None:
    """vLLM's guided_regex and guided_choice: random logits spell what the pattern matches."""
    tok = smollm_tokenizer
    grammars = Grammars(tok, tok.vocab_size)
    greedy = SamplingParams(temperature=0)
    for seed in (1, 2):
        text = guided_text(tok, grammars, Guide("regex", r"[A-Z]{3}-[0-9]{2,4}"), greedy, seed)
        assert re.fullmatch(r"[A-Z]{3}-[0-9]{2,4}", text), text
        options = ["yes", "no", "not sure (a.b)"]
        assert guided_text(tok, grammars, Guide.choice(options), greedy, seed) in options
    with pytest.raises(InvalidRequestError, match="guided_choice"):
        Guide.choice([])
    with pytest.raises(InvalidRequestError, match="cannot be used") as refused:
        grammars.matcher(Guide("regex", "(unclosed"))
    why = str(refused.value)  # xgrammar's reason, without its time and C++ source line
    assert "not closed" in why and ".cc:" not in why and "[" not in why and "\n" not in why, why


def test_a_grammar_derives_the_text_and_a_bad_one_is_refused_by_its_field(smollm_tokenizer: Tokenizer) -> None:
    """vLLM's guided_grammar: random logits spell a sentence of the EBNF grammar (GBNF's syntax)."""
    tok = smollm_tokenizer
    grammars = Grammars(tok, tok.vocab_size)
    ebnf = 'root ::= answer " because " reason "."\nanswer ::= "yes" | "no"\n'
    ebnf += 'reason ::= [a-z]{1,8} (" " [a-z]{1,8}){0,3}'
    for seed in (1, 2, 3):
        text = guided_text(tok, grammars, Guide("grammar", ebnf), SamplingParams(temperature=1.0, seed=seed), seed)
        assert re.fullmatch(r"(yes|no) because [a-z]{1,8}( [a-z]{1,8}){0,3}\.", text), text
    with pytest.raises(InvalidRequestError, match="cannot be used") as refused:
        grammars.matcher(Guide("grammar", "root ::= missing", field="guided_grammar"))
    assert refused.value.param == "guided_grammar" and 'Rule "missing" is not defined' in str(refused.value)


def test_a_draft_is_cut_to_its_grammar_and_each_position_masked_after_it(smollm_tokenizer: Tokenizer) -> None:
    """Speculation (engine/speculation.py): `grammatical` keeps what the grammar allows and
    leaves the matcher where it was; a row after k draft tokens gets the mask of that state."""
    tok = smollm_tokenizer
    grammars = Grammars(tok, tok.vocab_size)
    matcher = grammars.matcher(Guide.choice(["yes please", "no thanks"]))
    yes, please, no = tok.encode("yes")[0], tok.encode(" please")[0], tok.encode("no")[0]
    # short of the stop token: the row after "please" samples it, and no row asks the finished grammar for a mask
    assert grammatical(matcher, [yes, please, tok.eos_token_id, no]) == (yes, please)
    assert grammatical(matcher, [no, please]) == (no,), "cut where it breaks"
    assert not matcher.is_terminated() and matcher.accept_token(yes), "left where it was"
    matcher = grammars.matcher(Guide.choice(["yes please", "no thanks"]))
    drafted = grammatical(matcher, [yes, please, tok.eos_token_id])
    masks = allowed_tokens([matcher] * 3, tok.vocab_size, torch.device("cpu"), [drafted[:i] for i in range(3)])
    assert masks is not None
    fresh, after_yes, done = masks
    assert fresh[yes] and fresh[no] and not fresh[please]
    assert after_yes[please] and not after_yes[yes] and not after_yes[no]
    assert set(done.nonzero().flatten().tolist()) <= tok.stop_token_ids and done[tok.eos_token_id], "only the end"
    assert matcher.accept_token(no), "given back after the fill"


def test_a_mask_after_a_draft_the_grammar_refuses_gives_back_only_what_it_took(smollm_tokenizer: Tokenizer) -> None:
    """A draft token the matcher refuses ends what it takes in; the fill gives back only what it
    took, leaving the matcher where it was (it rolled back one token too many, past its start)."""
    tok = smollm_tokenizer
    matcher = Grammars(tok, tok.vocab_size).matcher(Guide.choice(["yes please", "no thanks"]))
    yes, please, no = tok.encode("yes")[0], tok.encode(" please")[0], tok.encode("no")[0]
    assert matcher.accept_token(yes)
    masks = allowed_tokens([matcher], tok.vocab_size, torch.device("cpu"), [[please, no]])
    assert masks is not None and not masks[0][please], "the mask of the state after what it took"
    assert matcher.accept_token(please), "left after `yes`, where it was"
