"""``bench soak`` in short: ``serve`` on the demo model under good and bad requests, clients
leaving mid-stream and sleep/wake cycles ends healthy (no 5xx but the documented 503, every
bad request a 4xx, the pool idle, RSS near its warm-up level, exit 0)."""

from __future__ import annotations

from xllm_vmm.bench import soak


def test_the_tally_tells_documented_503_from_other_5xx_and_wrong_answers():
    t = soak._Tally()
    t.answer("completion", True, 503, '{"error":{"message":"model \'m\' is sleeping ..."}}')
    t.answer("completion", True, 500, '{"error":{"message":"the engine failed: boom"}}')
    t.answer("completion", True, 400, "{}")  # a good request refused
    t.answer("bad_seed", False, 200, "{}")  # a bad one served
    t.answer("bad_seed", False, 400, "{}")
    t.answer("chat", True, 429, "{}")
    assert t.documented_503 == 1 and [e["status"] for e in t.errors_5xx] == [500]
    assert [(w["kind"], w["status"]) for w in t.wrong_class] == [("completion", 400),
                                                                 ("bad_seed", 200)]
    assert t.by_status == {503: 1, 500: 1, 400: 2, 200: 1, 429: 1}


def test_a_short_soak_ends_healthy():
    out = soak.run(soak.SoakConfig(duration_s=20, concurrency=4, sleep_every_s=6, seed=1))
    assert out["undocumented_5xx"] == 0, out["errors_5xx"]
    assert out["wrong_class"] == 0, out["wrong_class_examples"]
    assert out["stream_errors"] == 0, out["stream_error_examples"]
    assert out["sleep_cycles"] >= 1 and not out["admin_failures"], out["admin_failures"]
    assert out["pool_idle"], out
    assert out["idle_at_warmup"] and out["idle_at_end"]
    assert out["exit_code"] == 0 and out["last_line"].startswith("xllm-vmm serve: stopped after")
    assert out["rss_end_vs_warm_ratio"] <= 1.10, out
    assert out["requests"] > 0 and out["healthy"]
    bad = sum(n for k, n in out["by_kind"].items() if k.startswith("bad_"))
    assert bad + out["disconnects"] >= 1, out["by_kind"]
