"""Engine /metrics pages in each engine's own names: the load the daemon reads from them."""

from __future__ import annotations

import pytest

from collectors.enginemetrics import known_lines, parse_load

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


def test_only_the_known_series_reach_the_parser() -> None:
    kept = known_lines(VLLM_PAGE).splitlines()
    assert "# TYPE vllm:num_requests_running gauge" in kept and len(kept) == 10
    assert not any("e2e_request_latency" in line for line in kept)
