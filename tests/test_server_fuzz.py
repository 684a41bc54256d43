"""Schema fuzzing: schemathesis generates requests from the server's OpenAPI document; no input
may produce a 5xx. Runs against the ASGI app in process with a tiny FIM model."""

import pytest

from conftest import write_tiny_gguf

schemathesis = pytest.importorskip("schemathesis")
from cacheback_mlx.api import Session  # noqa: E402
from cacheback_mlx.server import create_app  # noqa: E402

from hypothesis import HealthCheck, given, settings  # noqa: E402


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    path = tmp_path_factory.mktemp("fuzz") / "fim.gguf"
    write_tiny_gguf(path, context=128, fim=True)
    return create_app(Session(str(path), "ngram"))


def test_no_input_makes_the_server_fail(app):
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    failures = []
    for operation in schema.get_all_operations():
        op = operation.ok()

        strategy = op.as_strategy()

        @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), database=None,
                  derandomize=True)
        @given(case=strategy)
        def check(case):
            if case.body is not None and isinstance(case.body, dict):
                for key in ("n_predict", "max_tokens"):  # keep generations short
                    if isinstance(case.body.get(key), int) and case.body[key] > 4:
                        case.body[key] = 4
            response = case.call()
            if response.status_code >= 500:
                failures.append((op.method, op.path, case.body, response.status_code, response.text[:200]))

        check()
    assert not failures, failures[:3]
