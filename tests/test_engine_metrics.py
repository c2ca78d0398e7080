"""Engine /metrics pages in each engine's own names: the load the daemon reads from them."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from collectors.enginemetrics import known_series, parse_load
from replay.engine.signals import StyleMetrics

VLLM_PAGE = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="a"} 2.0
vllm:num_requests_running{engine="1",model_name="a"} 1.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="a"} 4.0
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="a"} 1234.0
# HELP vllm:e2e_request_latency_seconds Histogram of e2e request latency in seconds.
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_bucket{le="0.3",model_name="a"} 3.0
vllm:e2e_request_latency_seconds_bucket{le="+Inf",model_name="a"} 9.0
vllm:e2e_request_latency_seconds_count{model_name="a"} 9.0
vllm:e2e_request_latency_seconds_sum{model_name="a"} 12.5
"""

LLAMACPP_PAGE = """\
# HELP llamacpp:requests_processing Number of requests processing.
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 1
# HELP llamacpp:requests_deferred Number of requests deferred.
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 2
"""

TGI_PAGE = """\
# TYPE tgi_batch_current_size gauge
tgi_batch_current_size 3
# TYPE tgi_queue_size gauge
tgi_queue_size 0
"""


@pytest.mark.parametrize(("page", "style", "running", "waiting"), [
    (VLLM_PAGE, "vllm", 3, 4),  # two engine cores' series add up
    (LLAMACPP_PAGE, "llamacpp", 1, 2),
    (TGI_PAGE, "tgi", 3, 0),
])
def test_each_engines_gauges_give_its_load(page: str, style: str, running: int, waiting: int) -> None:
    load = parse_load(page, ts_ns=7, server_port=8000)
    assert load is not None
    assert (load.style, load.running, load.waiting, load.server_port, load.ts_ns) == (style, running, waiting, 8000, 7)


def test_the_generated_token_counter_is_read_without_its_total_suffix() -> None:
    load = parse_load(VLLM_PAGE, ts_ns=0, server_port=1)
    assert load is not None and load.generated_tokens == 1234.0


@pytest.mark.parametrize("page", ["", "not a metrics page\n\x00\xff", "# TYPE other gauge\nother 1\n",
                                  "<html>vllm:num_requests_running</html>\n"])
def test_a_page_without_known_gauges_is_no_load(page: str) -> None:
    assert parse_load(page, ts_ns=0, server_port=1) is None


def test_a_broken_known_series_is_an_error_the_scraper_counts() -> None:
    with pytest.raises(ValueError):
        parse_load("vllm:num_requests_running{broken 3\n", ts_ns=0, server_port=1)


TRICKY_PAGE = VLLM_PAGE + """\
vllm:num_requests_waiting{model_name="a \\"quoted\\" }, and \\\\ back",} 1.5 1700000000000
vllm:num_requests_waiting   +Inf
vllm:generation_tokens_total{model_name="a"} NaN
"""


@pytest.mark.parametrize("page", [VLLM_PAGE, LLAMACPP_PAGE, TGI_PAGE, TRICKY_PAGE])
def test_the_known_series_read_as_prometheus_clients_own_parser_reads_them(page: str) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    def comparable(value: float) -> object:
        return "nan" if value != value else value

    ours = [(name, labels, comparable(value)) for name, labels, value in known_series(page)]
    theirs = [(sample.name, sample.labels, comparable(sample.value))
              for family in text_string_to_metric_families(page) for sample in family.samples
              if sample.name.startswith(tuple(name for name, _, _ in known_series(page)))]
    assert ours == theirs and ours
    assert not any("e2e_request_latency" in name for name, _, _ in ours)  # histograms are not read


@pytest.mark.parametrize("line", ["vllm:num_requests_running{model_name=\"a} 1", "vllm:num_requests_running 1 2 3",
                                  "vllm:num_requests_running{a=\"1\" b=\"2\"} 1", "vllm:num_requests_running one"])
def test_a_malformed_known_line_is_an_error(line: str) -> None:
    with pytest.raises(ValueError):
        list(known_series(line + "\n"))


@pytest.mark.parametrize(("style", "after_abort", "after_finish"), [
    ("vllm", 0.0, 1.0),  # its "abort" series left out, and never counted for a client's abort
    ("tgi", 0.0, 1.0),  # no series until the first success
    ("llamacpp", 0.0, 12.0),  # a finished request's tokens, counted as it finishes; an abort's never
    ("sglang", None, None)])
def test_the_reference_engines_finish_counts_read_as_each_engine_counts(
        style: str, after_abort: float | None, after_finish: float | None) -> None:
    """The reference engine under each engine's names counts finishes as that engine does; the
    daemon reads them so: an abort moves no finish count, a normal finish does."""
    registry = CollectorRegistry()
    metrics = StyleMetrics(registry, style, lambda: (1, 0))
    metrics.step(7)
    metrics.finish("abort", 7)

    def finished() -> float | None:
        load = parse_load(generate_latest(registry).decode(), ts_ns=1, server_port=8000)
        assert load is not None and load.style == style
        return load.finished

    assert finished() == after_abort
    metrics.step(5)
    metrics.finish("stop", 12)
    assert finished() == after_finish


def test_llamacpps_count_of_generation_time_is_read_in_seconds_and_moves_at_a_normal_finish_only() -> None:
    """llama.cpp adds a request's generation time, first token to last, in whole milliseconds, as
    it finishes it normally; the reference engine under its names the same."""
    page = LLAMACPP_PAGE + ("# TYPE llamacpp:tokens_predicted_seconds_total counter\n"
                            "llamacpp:tokens_predicted_seconds_total 3544.27\n")
    load = parse_load(page, ts_ns=1, server_port=8000)
    assert load is not None and load.finished_seconds == 3544.27
    registry = CollectorRegistry()
    metrics = StyleMetrics(registry, "llamacpp", lambda: (1, 0))

    def seconds() -> float | None:
        load = parse_load(generate_latest(registry).decode(), ts_ns=1, server_port=8000)
        assert load is not None
        return load.finished_seconds

    metrics.finish("abort", 7, 0.5)
    assert seconds() == 0.0
    metrics.finish("stop", 12, 0.4567)
    metrics.finish("length", 3, 0.1239)
    assert seconds() == pytest.approx(0.579)  # 0.456 + 0.123
    assert parse_load(TGI_PAGE, ts_ns=1, server_port=8000).finished_seconds is None  # type: ignore[union-attr]
