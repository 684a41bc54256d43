"""Schema fuzzing: schemathesis generates requests from the server's OpenAPI document; no input
may produce a 5xx. Runs against the ASGI app in process with a tiny FIM model."""

import pytest

from conftest import write_tiny_gguf

pytestmark = pytest.mark.serial  # tools/test.sh runs it alone: it times something, or starts processes or servers

schemathesis = pytest.importorskip("schemathesis")
from cacheback_mlx.api import Session  # noqa: E402
from cacheback_mlx.server import create_app  # noqa: E402

from hypothesis import HealthCheck, given, settings  # noqa: E402


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    path = tmp_path_factory.mktemp("fuzz") / "fim.gguf"
    write_tiny_gguf(path, context=64, fim=True)  # a missing token limit runs to its end
    return create_app(Session(str(path), "ngram"))


LIMITS = {"n_predict": 4, "max_tokens": 4, "max_completion_tokens": 4, "num_predict": 4,
          "n": 2, "n_cmpl": 2}  # tokens a completion, completions a request


def shorten(body: dict) -> None:
    """Numbers above LIMITS brought down to them, in the body and in Ollama's options."""
    for where in (body, body.get("options")):
        if isinstance(where, dict):
            for key, most in LIMITS.items():
                value = where.get(key)
                if isinstance(value, (int, float)) and not isinstance(value, bool) and value > most:
                    where[key] = most


@pytest.mark.parametrize("examples", [12, pytest.param(60, marks=pytest.mark.long)])
def test_no_input_makes_the_server_fail(app, examples):
    """Each route's generated requests (derandomized: the same ones every run), a few always and
    more with -m long."""
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    failures = []
    for operation in schema.get_all_operations():
        op = operation.ok()

        strategy = op.as_strategy()

        @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), database=None,
                  derandomize=True)
        @given(case=strategy)
        def check(case):
            if isinstance(case.body, dict):  # keep generations short (a missing limit runs to the context's end)
                shorten(case.body)
            response = case.call()
            if response.status_code >= 500:
                failures.append((op.method, op.path, case.body, response.status_code, response.text[:200]))

        check()
    assert not failures, failures[:3]
