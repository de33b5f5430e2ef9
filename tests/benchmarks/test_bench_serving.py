"""benchmarks/bench_serving.py end to end against the embedded default server (small settings):
both endpoints, two concurrency tiers, exact token counts with --ignore-eos, JSON and PNGs."""

from __future__ import annotations

import json

import pytest

from tests.server.conftest import start_server
from tests.scripts import load_script


@pytest.fixture(scope="module")
def server():
    s = start_server([])
    yield s
    s.stop()


def load_bench():
    return load_script("benchmarks/bench_serving.py")


@pytest.mark.parametrize("backend", ["native", "openai"])
def test_bench_serving_writes_json_and_plots(server, tmp_path, backend, capsys):
    bench = load_bench()
    N, inp, out = 6, 24, 5
    res = bench.main(["--base-url", server.url, "--backend", backend, "--num-prompts", str(N),
                      "--random-input-len", str(inp), "--random-output-len", str(out),
                      "--random-range-ratio", "1.0", "--ignore-eos", "--max-concurrency", "1,4",
                      "--num-chips", "2", "--output-dir", str(tmp_path), "--disable-tqdm"])
    printed = capsys.readouterr().out
    assert "concurrency 1" in printed and "concurrency 4" in printed and "TTFT" in printed
    saved = json.loads((tmp_path / "bench_serving.json").read_text())
    assert [t["max_concurrency"] for t in saved["tiers"]] == [1, 4]
    for t in saved["tiers"]:
        assert t["completed"] == N and t["failed"] == 0, t["errors"]
        assert t["total_input_tokens"] == N * inp and t["total_output_tokens"] == N * out
        assert t["total_token_throughput_per_chip"] == pytest.approx(t["total_token_throughput"] / 2)
        for key in ("ttft_s", "itl_s", "e2e_s"):
            v = t[key]
            assert 0 < v["p50"] <= v["p90"] <= v["p99"], (key, v)
        assert t["ttft_s"]["p99"] <= t["e2e_s"]["p99"]
    for name in ("throughput_vs_concurrency.png", "latency_cdf.png"):
        data = (tmp_path / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, name
    assert res["tiers"] == saved["tiers"]
