"""``bench serve`` over two workers (``serve --nnodes=2`` spawning rank 1): throughput, the
all-reduce time per step and each worker's mapped bytes are reported."""

from __future__ import annotations

from xllm_vmm.bench import serve as serve_bench


def test_bench_serve_reports_worker_figures(llama_dir):
    cfg = serve_bench.LoadConfig(num_prompts=6, request_rate=float("inf"), input_len=24,
                                 output_len=8, timeout=120)
    args = serve_bench.serve_args(str(llama_dir), ["--nnodes=2", "--device-memory=128MiB"],
                                  cfg.input_len, cfg.range_ratio, cfg.output_len)
    out = serve_bench.run(cfg, serve_args=args)
    assert out["completed"] == 6 and out["failures"] == 0 and out["server_exit_code"] == 0
    assert out["world_size"] == 2 and out["output_throughput"] > 0
    assert out["all_reduce_ms_per_step"] > 0
    kv = out["worker_kv_mapped_bytes_peak"]
    assert set(kv) == {"0", "1"} and kv["0"] == kv["1"] > 0  # the same slots on both
    assert out["worker_mapped_bytes_peak"]["1"] >= kv["1"]
