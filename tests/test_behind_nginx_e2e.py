"""The daemon with a real nginx in front of the engine, against the engine's truth log.

Behind nginx the engine sees only nginx: every close is nginx's (a FIN, even where the client
reset), within milliseconds of the client's; without upstream keepalive nginx also closes each
connection as its answer ends, so a request that completed and one whose client left close the
same way, within a scrape interval of each other. On the weakest signal set (plain clients, no
engine span, vLLM's /metrics) no request that completed may be judged a zombie, and every request
whose client left gets a verdict the truth allows: the engine's, or `unconfirmed`. The figures over
all three configs and both engines: bench/behind_nginx.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e import tally_against_truth
from tests.nginx import find_nginx, run_behind_nginx

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(find_nginx() is None, reason="nginx not found: run `make setup` as root")]


@pytest.mark.parametrize("source", [pytest.param("bpf", marks=pytest.mark.privileged), "procfs"])
@pytest.mark.parametrize("variant", ["nokeep", "keepalive"])
def test_verdicts_behind_nginx_match_truth(tmp_path: Path, variant: str, source: str) -> None:
    rows, truths, actions = run_behind_nginx(tmp_path, variant, source, "detached")
    assert not [action for action in actions if action.error], [action.error for action in actions]
    tally, problems = tally_against_truth(rows, truths)
    # The plan's 15 requests that complete all reach the engine; of its 8 leavers, those that left
    # within 15 ms may be gone before nginx forwarded them (no truth record, nothing to judge).
    assert tally["completed"] == 15, tally
    assert tally["cancels"] >= 4, tally
    assert not problems, (tally, problems)
    assert tally["cancels right"] >= 1, tally  # not all `unconfirmed`: the zombies are found
