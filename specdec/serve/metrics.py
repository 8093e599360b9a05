"""``GET /metrics``: Prometheus text, named as vLLM names its metrics, so its dashboards read ours.

Names follow vLLM's V1 engine (``vllm/v1/metrics/loggers.py``, ``vllm/v1/spec_decode/metrics.py``),
with the same ``model_name`` and ``engine`` labels; counters gain ``_total`` in the exposition:

- ``vllm:spec_decode_num_drafts_total``: row-rounds that drafted at least one token;
- ``vllm:spec_decode_num_draft_tokens_total``, ``vllm:spec_decode_num_accepted_tokens_total``:
  tokens drafted and accepted (acceptance rate α = accepted / drafted; mean accepted length
  τ = 1 + accepted / drafts, vLLM's PromQL convention, counting the recovered or bonus token);
- ``vllm:spec_decode_num_accepted_tokens_per_pos_total{position}``: rounds whose draft i was accepted;
- ``vllm:spec_decode_draft_acceptance_rate``: α since the start, as a gauge (vLLM V0's name; V1
  leaves it to PromQL);
- ``vllm:num_requests_running`` / ``vllm:num_requests_waiting``: rows in the batch / queued;
- ``vllm:prompt_tokens_total``, ``vllm:generation_tokens_total``,
  ``vllm:request_success_total{finished_reason}`` (stop, length, abort);
- histograms ``vllm:time_to_first_token_seconds``, ``vllm:inter_token_latency_seconds`` (one
  observation per committed round of a request, as vLLM observes one per engine step, so a round
  that commits several tokens counts once) and ``vllm:e2e_request_latency_seconds``, with vLLM's buckets.

Each server has its own registry (never prometheus_client's global one), so servers started in one
process (tests, the bench) do not share counters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from specdec.stats import CONTEXT_LIMIT, MAX_NEW_TOKENS, STOP_STRING, STOP_TOKEN

if TYPE_CHECKING:
    from specdec.serve.engine import Totals

CONTENT_TYPE = CONTENT_TYPE_LATEST
LABELS = ("model_name", "engine")
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # vLLM's time_to_first_token_seconds buckets
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)  # vLLM's inter_token_latency_seconds buckets
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)  # vLLM's e2e_request_latency_seconds buckets
FINISH_REASONS = {STOP_TOKEN: "stop", STOP_STRING: "stop", MAX_NEW_TOKENS: "length", CONTEXT_LIMIT: "length",
                  "abort": "abort"}  # our stop reasons -> vLLM's finished_reason label (OpenAI's finish_reason)


class ServerMetrics:
    """The metric families of one server; ``for_model`` binds them to a served model's labels."""

    def __init__(self) -> None:
        disable_created_metrics()  # no *_created series, as vLLM (process-wide in prometheus_client)
        r = self.registry = CollectorRegistry()
        self.drafts = Counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", LABELS, registry=r)
        self.draft_tokens = Counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", LABELS,
                                    registry=r)
        self.accepted_tokens = Counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.",
                                       LABELS, registry=r)
        self.accepted_per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                        "Accepted tokens per draft position.", (*LABELS, "position"), registry=r)
        self.acceptance_rate = Gauge("vllm:spec_decode_draft_acceptance_rate",
                                     "Speculative token acceptance rate (accepted / drafted) since the start.",
                                     LABELS, registry=r)
        self.running = Gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
                             LABELS, registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", LABELS,
                             registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", LABELS, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Number of generation tokens processed.", LABELS,
                                         registry=r)
        self.success = Counter("vllm:request_success", "Count of successfully processed requests.",
                               (*LABELS, "finished_reason"), registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              LABELS, buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             LABELS, buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             LABELS, buckets=E2E_BUCKETS, registry=r)

    def for_model(self, model_name: str, engine: str = "0") -> ModelMetrics:
        """The metrics of one served model (its children of every family)."""
        v = (model_name, engine)
        return ModelMetrics(self, v, self.drafts.labels(*v), self.draft_tokens.labels(*v),
                            self.accepted_tokens.labels(*v), self.acceptance_rate.labels(*v),
                            self.running.labels(*v), self.waiting.labels(*v), self.prompt_tokens.labels(*v),
                            self.generation_tokens.labels(*v), self.ttft.labels(*v), self.itl.labels(*v),
                            self.e2e.labels(*v))

    def exposition(self) -> bytes:
        """The registry in Prometheus text format."""
        return generate_latest(self.registry)


@dataclass
class ModelMetrics:
    """One served model's metrics (bound to its labels); the engine's worker updates them."""

    families: ServerMetrics
    labels: tuple[str, str]  # (model_name, engine)
    drafts: Counter
    draft_tokens: Counter
    accepted_tokens: Counter
    acceptance_rate: Gauge
    running: Gauge
    waiting: Gauge
    prompt_tokens: Counter
    generation_tokens: Counter
    ttft: Histogram
    itl: Histogram
    e2e: Histogram

    def round(self, drafted: int, accepted: int, tokens: int, totals: Totals) -> None:
        """One request's committed round: ``drafted`` drafts, ``accepted`` kept, ``tokens`` committed."""
        self.generation_tokens.inc(tokens)
        if drafted:
            self.drafts.inc()
            self.draft_tokens.inc(drafted)
            self.accepted_tokens.inc(accepted)
            for position in range(accepted):
                self.families.accepted_per_pos.labels(*self.labels, str(position)).inc()
        if totals.drafted:
            self.acceptance_rate.set(totals.accepted / totals.drafted)

    def finished(self, stop_reason: str, seconds: float) -> None:
        """A request left: why (our stop reason, or "abort") and its end-to-end latency."""
        self.families.success.labels(*self.labels, FINISH_REASONS.get(stop_reason, "abort")).inc()
        self.e2e.observe(seconds)
