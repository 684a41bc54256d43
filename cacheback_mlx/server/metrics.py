"""The server's counters, in Prometheus's text format at /metrics under llama.cpp's names (so its
dashboards read them), the speculative decoding's among them (draft tokens verified and accepted),
and under cacheback_mlx: what llama.cpp has not (tokens per pass, generations run). Every
generation adds its timings (core.Generator.finished) when it ends.
"""

from __future__ import annotations

import threading

# name, type, help; the counters sum each generation's timings (core.Generator.timings)
COUNTERS = {
    "prompt_tokens_total": ("prompt_n", "Prompt tokens computed (a cached prefix is not counted)."),
    "prompt_seconds_total": ("prompt_ms", "Seconds spent computing prompts."),
    "tokens_predicted_total": ("predicted_n", "Tokens generated."),
    "tokens_predicted_seconds_total": ("predicted_ms", "Seconds spent generating."),
    "n_decode_total": ("passes", "Passes of the model while generating (one pass verifies many drafts)."),
    "spec_decode_num_draft_tokens_total": ("draft_n", "Draft tokens verified."),
    "spec_decode_num_accepted_tokens_total": ("draft_n_accepted", "Draft tokens accepted."),
}


class Metrics:
    """Totals over every generation the server ran."""

    def __init__(self):
        self.totals = dict.fromkeys(COUNTERS, 0.0)
        self.requests = 0
        self.lock = threading.Lock()

    def add(self, timings: dict) -> None:
        """One generation's timings (called on the model's worker thread)."""
        with self.lock:
            for name, (key, _) in COUNTERS.items():
                value = timings.get(key, 0) or 0
                self.totals[name] += value / 1e3 if key.endswith("_ms") else value
            self.requests += 1

    def text(self, processing: int, deferred: int) -> str:
        """Prometheus's exposition format; `processing` and `deferred`: requests running and waiting."""
        with self.lock:
            t, requests = dict(self.totals), self.requests
        rate = lambda n, s: n / s if s > 0 else 0.0  # noqa: E731
        ours = "cacheback_mlx:"  # beside llama.cpp's names, the ones it has not
        gauges = {
            "llamacpp:prompt_tokens_seconds": (rate(t["prompt_tokens_total"], t["prompt_seconds_total"]),
                                               "Prompt tokens computed per second, on average."),
            "llamacpp:predicted_tokens_seconds": (
                rate(t["tokens_predicted_total"], t["tokens_predicted_seconds_total"]),
                "Tokens generated per second, on average."),
            "llamacpp:requests_processing": (processing, "Requests running."),
            "llamacpp:requests_deferred": (deferred, "Requests waiting for the model."),
            f"{ours}tokens_per_pass": (rate(t["tokens_predicted_total"], t["n_decode_total"]),
                                       "Tokens generated per pass of the model (mean accepted tokens), on average."),
        }
        out = [(f"llamacpp:{name}", "counter", t[name], doc) for name, (_, doc) in COUNTERS.items()]
        out.append((f"{ours}requests_total", "counter", requests, "Generations run."))
        out += [(name, "gauge", value, doc) for name, (value, doc) in gauges.items()]
        number = lambda v: str(int(v)) if float(v).is_integer() else repr(float(v))  # noqa: E731 (counts exact)
        return "".join(f"# HELP {name} {doc}\n# TYPE {name} {kind}\n{name} {number(value)}\n"
                       for name, kind, value, doc in out)
