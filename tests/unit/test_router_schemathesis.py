"""Schemathesis against the router's own OpenAPI document, in process over ASGI, with a fake
Backend: no operation answers 5xx to generated input (valid or not), every error is in OpenAI's
shape, and the router still serves normally afterwards. Derandomized and bounded: the same cases
run every time, in well under a minute."""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import Case, GenerationMode
from schemathesis.checks import not_a_server_error

from engine.roles import ROLES
from engine.tokenizer import Tokenizer
from router.app import create_app
from router.settings import RouterSettings
from tests.unit.fake_backend import CHAT, HELLO, FakeBackend

TOKEN = "fuzz-admin-token"
EXAMPLES = int(os.environ.get("TANDEM_FUZZ_EXAMPLES", "50"))  # per operation and generation mode


def steer(case: Case, real: bool, role: str) -> Case:
    """Most generated requests name a model or pool that does not exist (a 404 before anything else
    runs): about half are pointed at real ones, so that the paths behind those checks run too."""
    if real and isinstance(case.body, dict) and "model" in case.body:
        case.body["model"] = "fake-model"
    if real and "role" in (case.path_parameters or {}):
        case.path_parameters = {**(case.path_parameters or {}), "role": role}
    return case


def test_no_5xx_for_generated_requests_and_healthy_afterwards(smollm_tokenizer: Tokenizer) -> None:
    backend = FakeBackend(smollm_tokenizer)
    app = create_app(backend, RouterSettings(admin_token=TOKEN, default_max_tokens=4))
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    answered: Counter[tuple[str, int]] = Counter()

    for result in schema.get_all_operations():
        operation = result.ok()
        # Only a body can be made invalid: the path parameters are free strings, and most operations take none.
        modes = (GenerationMode.POSITIVE, GenerationMode.NEGATIVE) if operation.body else (GenerationMode.POSITIVE,)
        for mode in modes:
            cases = st.builds(steer, operation.as_strategy(generation_mode=mode), st.booleans(), st.sampled_from(ROLES))

            @given(case=cases)
            @settings(
                max_examples=EXAMPLES, derandomize=True, database=None, deadline=None,
                suppress_health_check=list(HealthCheck),
            )  # fmt: skip
            def call(case: Case) -> None:
                r = case.call_and_validate(headers=auth, checks=[not_a_server_error])
                answered[(case.operation.label, r.status_code)] += 1
                assert r.headers.get("x-request-id"), case.as_curl_command()
                if r.status_code >= 400:
                    err: dict[str, Any] = r.json()["error"]
                    assert set(err) == {"message", "type", "param", "code"} and err["message"], r.text

            call()

    labels = {label for label, _ in answered}
    assert {"POST /v1/chat/completions", "POST /v1/completions", "POST /admin/rebalance"} <= labels
    assert any(status == 200 for label, status in answered if label.startswith("POST /v1/"))  # some were served
    c = TestClient(app)
    assert c.get("/health").status_code == 200 and c.get("/ready").status_code == 200
    r = c.post(CHAT, json={"model": "fake-model", "messages": HELLO, "max_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    assert sorted(backend.closed) == sorted(backend.started)  # every stream the fuzzing opened was closed
