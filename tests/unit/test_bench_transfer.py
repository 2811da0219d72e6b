"""`tandem bench transfer`'s report: each transport as a ratio to the memcpy of the same run."""

from __future__ import annotations

import pytest

from bench.transfer_bench import TTFT_KEYS, over_memcpy, print_table


def test_each_transport_is_reported_against_memcpy_and_quick_runs_print_no_ttft(
    capsys: pytest.CaptureFixture[str],
) -> None:
    res: dict[str, float | None] = {"tcp_gbps": 4.0, "memcpy_gbps": 10.0, "shm_gbps_1k": 2.0, "shm_gbps_4k": 5.0}
    res |= {"grpc_gbps_1k": 1.0, "grpc_gbps_4k": 1.5} | dict.fromkeys(TTFT_KEYS)
    res |= over_memcpy(res)
    assert res["shm_gbps"] == 5.0 and res["shm_over_memcpy"] == 0.5
    assert res["shm_over_memcpy_1k"] == 0.2 and res["shm_over_memcpy_4k"] == 0.5
    assert res["grpc_over_memcpy"] == 0.15
    assert res["collective_gbps"] is None and res["collective_over_memcpy_1k"] is None
    meta = {"kv_dtype": "float32", "threads": 2, "receiver": "process", "stat": "best of 3", "ttft_transport": "grpc"}
    print_table(res, meta | {"collective_skipped": None})
    out = capsys.readouterr().out
    assert "shm, 4K-token prompt KV                       5.00    1.25x      0.50x" in out
    assert "TTFT" not in out
