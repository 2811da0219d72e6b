"""The router over a real cluster (Ray, redis-server, the real model), spoken to with the
official `openai` SDK and plain httpx, served by uvicorn on a loopback port.

One cluster and one router for the module; tests that resize pools put them back to 1 + 1.
"""

from __future__ import annotations

import json
import signal
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import ray
import uvicorn
from openai.lib.streaming.chat import ChatCompletionStreamState
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.parser import text_string_to_metric_families

from cli.admin import main as admin_cli
from cluster.cluster import Cluster, ClusterConfig
from cluster.routing import RoutingPolicy
from engine.engine import Engine
from engine.kv_cache import prefix_hashes
from router.app import create_app
from router.backend import ClusterBackend
from router.server import http_server
from router.settings import RouterSettings
from router.tracing import new_provider
from tests.integration.otlp_collector import Collector, Received, otlp_collector
from tests.integration.serving import serving_engine
from tests.integration.waits import until
from tests.unit.test_dashboard import SPEC_ONLY, dashboard_metrics

TOKEN = "itest-admin-token"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
QUESTION: Any = [{"role": "user", "content": "What is the capital of France?"}]


SPANS = InMemorySpanExporter()  # every request's spans (router.tracing)


@pytest.fixture(scope="module")
def collector() -> Iterator[tuple[str, Collector]]:
    """Where the workers export their spans (engine/spans.py), over real OTLP/HTTP: its URL, and it."""
    with otlp_collector() as endpoint_and_collector:
        yield endpoint_and_collector


@pytest.fixture(scope="module")
def cluster(collector: tuple[str, Collector]) -> Iterator[Cluster]:
    env = {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": collector[0], "OTEL_BSP_SCHEDULE_DELAY": "100"}
    c = Cluster.connect(
        ClusterConfig(
            namespace="router-itest",
            engine=serving_engine(num_blocks=256, num_threads=1),
            worker_env=env,
        )
    )
    try:
        c.wait_ready(240)
        yield c
    finally:
        c.shutdown()


@pytest.fixture(scope="module")
def url(cluster: Cluster) -> Iterator[str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # Prompts under 32 uncached tokens run colocated when a colocated worker is up (none is, by default).
    backend = ClusterBackend(cluster, RoutingPolicy(colocate_below_tokens=32))
    provider = new_provider()
    provider.add_span_processor(SimpleSpanProcessor(SPANS))
    app = create_app(backend, RouterSettings(port=port, admin_token=TOKEN), provider)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    until(lambda: server.started, 30, "uvicorn to start")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.fixture(scope="module")
def model(url: str) -> str:
    return str(httpx.get(f"{url}/v1/models").json()["data"][0]["id"])


@pytest.fixture
def sdk(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="anything", max_retries=0, timeout=120)


def max_running(url: str) -> int:
    return int(httpx.get(f"{url}/console/api/state", headers=ADMIN).json()["load"]["max_running"])


def up(url: str, role: str) -> int:
    pools = httpx.get(f"{url}/admin/pools", headers=ADMIN, timeout=30).json()
    draining = sum(1 for w in pools["workers"] if w["role"] == role and w["state"] != "up")
    return int(pools["up"][role]) if draining == 0 else -1


def test_openai_sdk_chat_and_completions(sdk: openai.OpenAI, model: str) -> None:
    assert [m.id for m in sdk.models.list()] == [model] and sdk.models.retrieve(model).id == model
    whole = sdk.chat.completions.create(model=model, messages=QUESTION, max_tokens=24, temperature=0)
    text = whole.choices[0].message.content
    assert text and whole.choices[0].finish_reason in ("stop", "length")
    assert whole.usage is not None and whole.usage.prompt_tokens > 10 and whole.usage.completion_tokens >= 1
    stream = sdk.chat.completions.create(
        model=model, messages=QUESTION, max_tokens=24, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    again = chunks[-1].usage
    assert again is not None and again.model_dump(exclude={"prompt_tokens_details"}) == whole.usage.model_dump(
        exclude={"prompt_tokens_details"}
    )
    # the SDK reads the cached count; the same prompt again finds at least its whole blocks cached
    assert whole.usage.prompt_tokens_details is not None and again.prompt_tokens_details is not None
    assert again.prompt_tokens_details.cached_tokens == (whole.usage.prompt_tokens - 1) // 16 * 16
    assert (chunks[-1].model_extra or {})["tandem"]["timing"]["prefill_worker"]

    done = sdk.completions.create(model=model, prompt="The capital of France is", max_tokens=12, temperature=0)
    assert done.usage is not None and done.usage.completion_tokens == 12 and done.choices[0].finish_reason == "length"
    streamed = sdk.completions.create(
        model=model, prompt="The capital of France is", max_tokens=12, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == done.choices[0].text

    # structured output (engine/grammar.py) through P/D: the prefill worker guides the first token
    props = {"country": {"type": "string", "maxLength": 24}, "capital": {"type": "string", "maxLength": 24}}
    schema = {"type": "object", "properties": props, "required": ["country", "capital"], "additionalProperties": False}
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "capital", "schema": schema, "strict": True}}
    for temperature, seed in ((0.0, None), (0.9, 3)):
        guided = sdk.chat.completions.create(model=model, messages=QUESTION, max_tokens=64, temperature=temperature,
                                             seed=seed, response_format=fmt)  # fmt: skip
        value = json.loads(guided.choices[0].message.content or "")
        assert set(value) == {"country", "capital"} and guided.choices[0].finish_reason == "stop", value
    obj = sdk.chat.completions.create(model=model, messages=QUESTION, max_tokens=64, temperature=0,
                                      response_format={"type": "json_object"})  # fmt: skip
    assert (obj.choices[0].message.content or "").startswith("{")
    with pytest.raises(openai.BadRequestError, match="schema"):
        nonsense = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}
        sdk.chat.completions.create(model=model, messages=QUESTION, max_tokens=8, response_format=nonsense)  # type: ignore[arg-type]

    # a list of prompts: a choice each, each the answer its prompt gets alone
    pair = ["The capital of France is", "The largest planet is"]
    both = sdk.completions.create(model=model, prompt=pair, max_tokens=8, temperature=0)
    each = [sdk.completions.create(model=model, prompt=p, max_tokens=8, temperature=0) for p in pair]
    assert [c.text for c in both.choices] == [e.choices[0].text for e in each]

    lp = sdk.chat.completions.create(model=model, messages=QUESTION, max_tokens=5, logprobs=True, top_logprobs=2)
    assert lp.choices[0].logprobs is not None and lp.usage is not None
    content = lp.choices[0].logprobs.content or []
    assert len(content) == lp.usage.completion_tokens and all(len(c.top_logprobs) == 2 for c in content)

    # n choices (router/choices.py) are the answers of their seeds, seed + i: choice 0 the n = 1 answer
    ask = {"model": model, "messages": QUESTION, "max_tokens": 16, "temperature": 0.9}
    many = sdk.chat.completions.create(**ask, seed=1234, n=3)
    alone = [sdk.chat.completions.create(**ask, seed=1234 + i) for i in range(3)]
    assert [c.message.content for c in many.choices] == [a.choices[0].message.content for a in alone]
    assert many.usage is not None and many.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    assert len({c.message.content for c in many.choices}) > 1  # three seeds, not one answer thrice


WEATHER: Any = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                 "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
                                "required": ["city"], "additionalProperties": False}}}  # fmt: skip


def test_openai_sdk_tool_calls_through_pd(sdk: openai.OpenAI, model: str) -> None:
    """Tool calling (router/tools.py) as an agent loop drives it through the SDK: the call, whole
    and streamed alike (the SDK assembles the deltas, as they are written), its result sent
    back, the next turn."""
    ask: Any = [{"role": "user", "content": "What is the weather in Paris?"}]
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        whole = sdk.chat.completions.create(model=model, messages=ask, tools=[WEATHER], tool_choice=choice,
                                            max_tokens=48, temperature=0)  # fmt: skip
        (c,) = whole.choices
        assert c.finish_reason == "tool_calls" and c.message.content is None, c
        (call,) = c.message.tool_calls or []
        assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
        assert set(json.loads(call.function.arguments)) == {"city"}
    stream = sdk.chat.completions.create(model=model, messages=ask, tools=[WEATHER], tool_choice="required",
                                         max_tokens=48, temperature=0, stream=True)  # fmt: skip
    state = ChatCompletionStreamState()  # the SDK's own assembly (of router/tool_stream.py's deltas)
    for chunk in stream:  # (how many pieces depends on how many tokens each step sends)
        state.handle_chunk(chunk)
    final = state.get_final_completion().choices[0]
    (streamed,) = final.message.tool_calls or []
    assert final.finish_reason == "tool_calls" and streamed.type == "function"
    assert (streamed.function.name, json.loads(streamed.function.arguments)) == (
        call.function.name,
        json.loads(call.function.arguments),
    )
    turn = [*ask, c.message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "cloudy", "celsius": 18}'}]  # fmt: skip
    after = sdk.chat.completions.create(model=model, messages=turn, tools=[WEATHER], tool_choice="none",
                                        max_tokens=24, temperature=0)  # fmt: skip
    assert after.choices[0].message.content and not after.choices[0].message.tool_calls


def test_bad_input_is_refused_and_the_router_stays_ready(url: str, model: str) -> None:
    chat = f"{url}/v1/chat/completions"
    cases: list[tuple[Any, int]] = [
        (b"{not json", 400),
        ({"model": model}, 400),
        ({"model": model, "messages": []}, 400),
        ({"model": model, "messages": QUESTION, "max_tokens": -3}, 400),
        ({"model": model, "messages": QUESTION, "max_tokens": 10**8}, 400),
        ({"model": model, "messages": QUESTION, "temperature": "warm"}, 400),
        ({"model": model, "messages": QUESTION, "top_p": 2}, 400),
        ({"model": model, "messages": QUESTION, "n": 17}, 400),
        ({"model": "no-such-model", "messages": QUESTION}, 404),
        ({"model": model, "messages": [{"role": "user", "content": "lorem ipsum " * 3000}]}, 413),
    ]
    for body, status in cases:
        kwargs: dict[str, Any] = {"content": body} if isinstance(body, bytes) else {"json": body}
        r = httpx.post(chat, headers={"content-type": "application/json"}, timeout=60, **kwargs)
        assert r.status_code == status, (body if isinstance(body, bytes) else str(body)[:80], r.text)
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert httpx.get(f"{url}/ready").json() == {"ready": True}
    assert httpx.get(f"{url}/health").status_code == 200


def test_disconnect_mid_stream_frees_kv_on_both_workers(url: str, model: str, cluster: Cluster) -> None:
    body = {"model": model, "messages": QUESTION, "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as client, client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        got = [line for line, _ in zip(lines, range(8), strict=False) if line.startswith("data: ")]
        assert len(got) >= 3
    t = time.monotonic()  # the client is gone: the decode worker must abort and free its blocks

    def all_free() -> bool:
        stats = ray.get([h.stats.remote() for h in cluster.handles().values()], timeout=10)
        return all(s["free_blocks"] == s["num_blocks"] and s["running"] == 0 for s in stats)

    until(all_free, 1.0, "every block back", every=0.05)
    assert time.monotonic() - t < 1.0
    cluster.check_integrity()
    until(lambda: all(w.get("free_blocks") == w.get("num_blocks") for w in cluster.workers()), 5, "heartbeats")


def test_a_stopping_router_finishes_the_answers_in_flight(model: str, cluster: Cluster) -> None:
    """SIGTERM or Ctrl-C on `tandem serve` (its server, router.server.http_server): no new
    connection is taken, the stream in flight ends whole, then the server returns."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    settings = RouterSettings(port=port)
    server = http_server(create_app(ClusterBackend(cluster), settings), settings)
    thread = threading.Thread(target=server.run, name="uvicorn-stopping", daemon=True)
    thread.start()
    until(lambda: server.started, 30, "uvicorn to start")

    def refused() -> bool:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
        except ConnectionRefusedError:
            return True
        return False

    body = {"model": model, "messages": QUESTION, "max_tokens": 48, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: {"))
        server.handle_exit(signal.SIGTERM, None)  # what the signal handler calls
        until(refused, 10, "the router to stop taking connections")
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"
    assert json.loads(rest[-2].removeprefix("data: "))["usage"]["completion_tokens"] == 48
    thread.join(30)
    assert not thread.is_alive()
    cluster.check_integrity()


def test_admin_scales_pools_and_cache_aware_routing(
    url: str, model: str, cluster: Cluster, engine_fp32: Engine
) -> None:
    assert httpx.get(f"{url}/admin/pools").status_code == 401
    assert httpx.post(f"{url}/admin/pools/decode", json={"replicas": 2}).status_code == 401
    r = httpx.post(f"{url}/admin/pools/decode", json={"replicas": 2}, headers=ADMIN)
    assert r.status_code == 200 and r.json() == {"role": "decode", "replicas": 2}
    assert httpx.post(f"{url}/admin/pools/prefill", json={"replicas": 2}, headers=ADMIN).status_code == 200
    until(lambda: up(url, "decode") == 2 and up(url, "prefill") == 2, 240, "2 prefill + 2 decode workers")
    until(lambda: max_running(url) == 128, 5, "the router's bound, 64 a decode worker")
    pools = httpx.get(f"{url}/admin/pools", headers=ADMIN).json()
    assert pools["desired"]["decode"] == 2 and all("kv_usage" in w and w["node"] for w in pools["workers"])

    story = "Here is a long story about a lighthouse keeper and the sea. " * 14
    history = [{"role": "user", "content": story}]
    chat = f"{url}/v1/chat/completions"
    first = httpx.post(chat, json={"model": model, "messages": history, "max_tokens": 8, "temperature": 0}, timeout=120)
    holder = json.loads(first.headers["x-tandem-timing"])["prefill_worker"]
    reply = first.json()["choices"][0]["message"]["content"]
    tok = engine_fp32.tokenizer
    assert tok is not None
    hashes = prefix_hashes(tok.encode(tok.apply_chat_template(history))[:-1], cluster.config.engine.block_size)
    # prefill workers publish their cached blocks to the index on their heartbeat
    until(lambda: cluster.state.longest_prefix(hashes, [holder]).get(holder, 0) == len(hashes), 10, "the index")
    follow = [*history, {"role": "assistant", "content": reply}, {"role": "user", "content": "And then?"}]
    for stream in (False, True):
        body = {"model": model, "messages": follow, "max_tokens": 8, "temperature": 0, "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        r = httpx.post(chat, json=body, timeout=120)
        if stream:
            last = json.loads([x for x in r.text.split("\n\n") if x.startswith("data: {")][-1].removeprefix("data: "))
            timing, usage = last["tandem"]["timing"], last["usage"]
        else:
            timing, usage = json.loads(r.headers["x-tandem-timing"]), r.json()["usage"]
        assert timing["prefill_worker"] == holder and timing["cached_tokens"] > 0, timing
        assert usage["prompt_tokens_details"] == {"cached_tokens": timing["cached_tokens"]}  # OpenAI's field

    assert httpx.post(f"{url}/admin/rebalance", json={"prefill": 1, "decode": 1}, headers=ADMIN).status_code == 200
    until(lambda: up(url, "decode") == 1 and up(url, "prefill") == 1, 120, "pools back to 1 + 1")
    until(lambda: max_running(url) == 64, 5, "the router's bound back")
    cluster.check_integrity()


def test_conditional_disaggregation_runs_a_short_prompt_colocated(url: str, model: str, cluster: Cluster) -> None:
    body = {"model": model, "prompt": "The capital of France is", "max_tokens": 10, "temperature": 0}
    pd = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    pd_timing = json.loads(pd.headers["x-tandem-timing"])
    assert pd_timing["prefill_worker"] != pd_timing["decode_worker"] and pd_timing["transfer_bytes"] > 0
    # the breakdown accounts for the whole TTFT: every part is there, none is negative
    parts = [pd_timing[k] for k in ("queue_s", "route_s", "prefill_s", "transfer_s", "first_decode_s")]
    assert min(parts) >= 0 and abs(sum(parts) - pd_timing["ttft_s"]) < 0.002, pd_timing
    assert httpx.post(f"{url}/admin/pools/colocated", json={"replicas": 1}, headers=ADMIN).status_code == 200
    until(lambda: up(url, "colocated") == 1, 180, "a colocated worker")
    scored = {**body, "echo": True, "logprobs": 2, "prompt": "Paris is the capital of a country that " * 8}
    pd_echo = httpx.post(f"{url}/v1/completions", json=scored, timeout=60).json()["choices"][0]
    vllm_scored = {**body, "prompt": scored["prompt"], "prompt_logprobs": 2}  # vLLM's field, on P/D
    pd_scores = httpx.post(f"{url}/v1/completions", json=vllm_scored, timeout=60).json()["choices"][0]
    colo = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    timing = json.loads(colo.headers["x-tandem-timing"])
    assert timing["prefill_worker"] == timing["decode_worker"] and timing["transfer_bytes"] == 0, timing
    assert colo.json()["choices"][0]["text"] == pd.json()["choices"][0]["text"]
    drop_details = lambda u: {k: v for k, v in u.items() if k != "prompt_tokens_details"}  # noqa: E731
    assert drop_details(colo.json()["usage"]) == drop_details(pd.json()["usage"])  # the caches differ
    # echo (router/echo.py): the prompt's logprobs come from whichever worker prefilled it, the same
    colo_echo = httpx.post(f"{url}/v1/completions", json={**scored, "prompt": [scored["prompt"]]}, timeout=60)
    colo_echo = colo_echo.json()["choices"][0]
    for echoed in (pd_echo, colo_echo):
        assert echoed["text"].startswith(scored["prompt"]) and echoed["logprobs"]["token_logprobs"][0] is None
    pd_lp, colo_lp = pd_echo["logprobs"], colo_echo["logprobs"]
    assert len(pd_lp["tokens"]) - 10 > 32 and pd_lp["tokens"] == colo_lp["tokens"]
    assert pd_lp["token_logprobs"][1:] == pytest.approx(colo_lp["token_logprobs"][1:], abs=1e-3)
    assert all(-30 < v < 0 for v in pd_lp["token_logprobs"][1:]) and all(len(t) == 2 for t in pd_lp["top_logprobs"][1:])
    # ... and as vLLM's prompt_logprobs, each with its rank: 1 where it is the likeliest
    n = len(pd_scores["prompt_logprobs"])
    assert n == len(pd_lp["tokens"]) - 10 and pd_scores["prompt_logprobs"][0] is None
    echoed = zip(pd_lp["token_logprobs"][1:n], pd_lp["top_logprobs"][1:n], strict=True)
    for s, (lp, top) in zip(pd_scores["prompt_logprobs"][1:], echoed, strict=True):
        own = next(iter(s.values()))
        assert own["logprob"] == pytest.approx(lp, abs=1e-3) and len(s) <= 3
        assert (own["rank"] == 1) == (own["logprob"] >= max(top.values()) - 1e-4), (own, top)
    long = {**body, "prompt": "The capital of France is a city that " * 8}  # over 32 tokens: P/D
    assert (
        json.loads(httpx.post(f"{url}/v1/completions", json=long, timeout=60).headers["x-tandem-timing"])[
            "transfer_bytes"
        ]
        > 0
    )
    assert httpx.post(f"{url}/admin/pools/colocated", json={"replicas": 0}, headers=ADMIN).status_code == 200
    until(lambda: up(url, "colocated") == 0, 60, "the colocated worker to go")
    cluster.check_integrity()


def test_admin_cli(url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("TANDEM_ADMIN_TOKEN", raising=False)
    assert admin_cli(["--url", url, "rebalance", "1", "1"]) == 1  # 401 without the token
    monkeypatch.setenv("TANDEM_ADMIN_TOKEN", TOKEN)
    assert admin_cli(["--url", url, "pools"]) == 0
    assert json.loads(capsys.readouterr().out)["up"]["decode"] == 1
    assert admin_cli(["--url", url, "drain", "no-such-worker"]) == 1


def test_metrics_parse_and_move(url: str, model: str) -> None:
    def scrape() -> dict[str, float]:
        text = httpx.get(f"{url}/metrics").text
        return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels}

    before = scrape()
    httpx.post(f"{url}/v1/completions", json={"model": model, "prompt": "Hello", "max_tokens": 5}, timeout=60)
    after = scrape()
    for name in ("tandem:time_to_first_token_seconds_count", "tandem:e2e_request_latency_seconds_count",
                 "tandem:kv_transfer_bytes_count", "tandem:kv_transfer_gbps_count"):  # fmt: skip
        assert after[name] == before[name] + 1, name
    assert after["tandem:generation_tokens_total"] >= before["tandem:generation_tokens_total"] + 1
    assert after["tandem:prompt_tokens_total"] > before["tandem:prompt_tokens_total"]
    assert "tandem:num_requests_running" in after
    # every series deploy/grafana/tandem.json queries, but speculation's (off in this cluster)
    httpx.post(f"{url}/v1/completions", json={"model": "no-such-model", "prompt": "Hello"}, timeout=60)  # a rejection
    live = {s.name for f in text_string_to_metric_families(httpx.get(f"{url}/metrics").text) for s in f.samples}
    assert not {m for m in dashboard_metrics() if not m.startswith(SPEC_ONLY)} - live


def test_a_pd_request_is_traced_router_prefill_transfer_decode(url: str, model: str) -> None:
    rid = uuid.uuid4().hex
    body = {"model": model, "prompt": "The capital of France is a city that " * 8, "max_tokens": 4, "temperature": 0}
    r = httpx.post(f"{url}/v1/completions", json=body, headers={"x-request-id": rid}, timeout=60)
    timing = json.loads(r.headers["x-tandem-timing"])
    spans = [s for s in SPANS.get_finished_spans() if s.context is not None and s.context.trace_id == int(rid, 16)]
    root = next(s for s in spans if s.name == "tandem.request")
    parts = sorted((s for s in spans if s is not root), key=lambda s: s.start_time or 0)
    assert [s.name for s in parts] == ["router.queue", "route", "worker.queue", "prefill", "kv_transfer",
                                       "first_decode", "decode"]  # fmt: skip
    assert root.context is not None and all(s.parent and s.parent.span_id == root.context.span_id for s in parts)
    attrs = {s.name: dict(s.attributes or {}) for s in spans}
    assert attrs["prefill"]["tandem.worker"] == timing["prefill_worker"] != timing["decode_worker"]
    assert attrs["decode"]["tandem.worker"] == timing["decode_worker"]
    assert attrs["kv_transfer"]["tandem.bytes"] == timing["transfer_bytes"] > 0
    assert attrs["tandem.request"]["gen_ai.usage.output_tokens"] == 4


def test_the_workers_record_their_spans_under_the_routers(
    url: str, model: str, collector: tuple[str, Collector]
) -> None:
    """The trace context goes down the Ray calls: the prefill and decode workers export their own
    spans (from their processes, over OTLP) as children of the router's root span."""
    rid = uuid.uuid4().hex
    parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    body = {"model": model, "prompt": "The capital of France is a city that " * 8, "max_tokens": 4, "temperature": 0}
    r = httpx.post(f"{url}/v1/completions", json=body, headers={"x-request-id": rid, "traceparent": parent}, timeout=60)
    timing = json.loads(r.headers["x-tandem-timing"])
    trace_id = 0x4BF92F3577B34DA6A3CE929D0E0E4736
    root = next(s for s in SPANS.get_finished_spans() if s.name == "tandem.request"
                and s.context is not None and s.context.trace_id == trace_id
                and (s.attributes or {}).get("tandem.request_id") == rid)  # fmt: skip
    assert root.context is not None

    def mine() -> dict[str, Received]:
        spans = collector[1].spans()
        return {s.name: s for s in spans if s.trace_id == trace_id and s.parent_span_id == root.context.span_id}

    until(lambda: {"worker.prefill", "worker.decode"} <= set(mine()), 30, "the workers' spans")
    got = mine()
    assert got["worker.prefill"].attributes["tandem.worker"] == timing["prefill_worker"]
    assert got["worker.decode"].attributes["tandem.worker"] == timing["decode_worker"]
    assert got["worker.decode"].attributes["tandem.finish_reason"] == "length"
    assert got["worker.prefill"].service == got["worker.decode"].service == "tandem-worker"
    assert str(got["worker.prefill"].attributes["tandem.request_id"]).startswith(rid)
