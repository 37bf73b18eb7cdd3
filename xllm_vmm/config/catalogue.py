"""The flag catalogue: every flag xllm-vmm accepts, with its type, default, group and help.

This table is the single source of truth. The parsers (:mod:`xllm_vmm.config.sources`), the
pydantic model (:mod:`xllm_vmm.config.model`), ``xllm-vmm flags``, ``xllm-vmm schema``, the
``check-config --help`` panels and ``docs/cli-reference.md`` are all generated from it.

Contents:

- every flag of the serving engine whose flag surface xllm-vmm adopts (``shared/reference/
  xllm-flags.tsv``), with the engine's name, type and group. Where the engine's default differs by
  build or platform (``a | b`` in the reference) the first value is used and the help says so.
  C++ expressions are evaluated: ``128 * 1024 * 1024`` → 134217728,
  ``std::numeric_limits<int32_t>::max()`` → 2147483647, ``kEnableGraphVmmPoolDefault`` → true
  (the engine defines ``constexpr bool kEnableGraphVmmPoolDefault = true``).
- the five flags the specification adds (group ``vmm``).
- ``devices`` (the engine's older flag, given xllm-vmm's syntax ``npu:0,npu:1`` / ``cuda:0`` /
  ``cpu`` / ``auto``) and ``host`` (the HTTP bind address).

Flags that the xllm-vmm engine does not implement are still accepted and type-checked
(``FlagDef.implemented`` is False for them; ``serve`` reports them as "accepted, no effect").

Importing this module is cheap (one small table parsed with ``str.split``); it imports neither
pydantic nor typer nor torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: Flag types, as the engine declares them (gflags ``DEFINE_<type>``).
TYPES = ("bool", "int32", "int64", "uint32", "uint64", "double", "string")

#: Inclusive integer ranges of the integer types.
INT_RANGES: dict[str, tuple[int, int]] = {
    "int32": (-(2**31), 2**31 - 1),
    "int64": (-(2**63), 2**63 - 1),
    "uint32": (0, 2**32 - 1),
    "uint64": (0, 2**64 - 1),
}

#: Groups in display order, with a one-line title each (help panels, docs, TOML tables).
GROUPS: dict[str, str] = {
    "vmm": "Virtual memory (VMM) for the KV cache and weights",
    "kv_cache": "KV cache",
    "kv_cache_store": "KV cache store and host offload",
    "model": "Model and devices",
    "load": "Weight loading",
    "scheduler": "Scheduler",
    "speculative": "Speculative decoding",
    "parallel": "Parallelism",
    "disagg_pd": "Prefill/decode disaggregation",
    "distributed": "Distributed serving",
    "service": "HTTP service",
    "execution": "Execution and graphs",
    "kernel": "Kernels",
    "eplb": "Expert load balancing",
    "beam_search": "Beam search",
    "profile": "Profiling and latency targets",
    "rec": "Recommendation tasks",
    "dit": "Diffusion (DiT) models",
    "config_utils": "Configuration files",
    "utils": "Miscellaneous",
}


@dataclass(frozen=True)
class FlagDef:
    """One flag.

    ``default`` is a Python value of the flag's type (bool, int, float or str). ``unit`` is
    ``"bytes"`` for byte-sized flags (they also accept sizes such as ``1GiB``; values are always
    reported back as integers of bytes), else ``None``. ``minimum``/``maximum`` narrow the type's
    range where a value outside it can never make sense. ``platform_default`` records the engine's
    other default(s) where it differs by build or platform.
    """

    name: str
    type: str
    default: object
    group: str
    help: str
    unit: str | None = None
    minimum: float | None = None
    maximum: float | None = None
    implemented: bool = False
    platform_default: str | None = None
    origin: str = "engine"  # "engine" (reference flag list), "spec" (added by the spec)
    aliases: tuple[str, ...] = field(default=())
    #: The values a string flag takes, where the engine defines a fixed set (matched without
    #: regard to case; an empty value is accepted too when the default is empty). () = any.
    choices: tuple[str, ...] = field(default=())

    def choice(self, text: str) -> str | None:
        """``text`` when it is one of :attr:`choices`, spelled exactly (the engine compares
        these strings exactly: ``mtp`` is not ``MTP``), else None."""
        return text if text in self.choices else None

    def choices_text(self) -> str:
        """``MTP, Eagle3, Suffix, DFlash`` (and ``or empty`` where empty is accepted)."""
        return ", ".join(self.choices) + (" (or empty)" if self.default == "" else "")

    @property
    def is_bool(self) -> bool:
        return self.type == "bool"

    @property
    def is_int(self) -> bool:
        return self.type in INT_RANGES

    @property
    def is_bytes(self) -> bool:
        return self.unit == "bytes"

    @property
    def type_label(self) -> str:
        """The type as users read it in messages and tables (``int64 (bytes)``)."""
        return f"{self.type} (bytes)" if self.is_bytes else self.type

    @property
    def env_var(self) -> str:
        return "XLLM_VMM_" + self.name.upper()

    def default_text(self) -> str:
        """The default as it is written on a command line (``true``, ``0``, ``""``)."""
        return format_value(self, self.default)


def format_value(flag: FlagDef, value: object) -> str:
    """A value written the way the gflags command line takes it."""
    if flag.is_bool:
        return "true" if value else "false"
    if flag.type == "string":
        return '""' if value == "" else str(value)
    if flag.type == "double":
        return repr(float(value))  # type: ignore[arg-type]
    return str(value)


# name | type | default | group | attrs | help
# attrs: comma list of  bytes, impl, min=N, max=N, plat=<other default>, spec,
#        values=a/b/c (the fixed set of a string flag's values; appended to the help)
# Defaults use Python/TOML literals: true/false, integers, floats, "strings".
_TABLE = r"""
enable_vmm_kvcache|bool|false|vmm|impl,spec|Use VMM for the KV cache: a stable virtual arena whose physical pages are mapped as blocks are needed. Off: the physical (preallocated) KV cache.
enable_vmm_weights|bool|false|vmm|impl,spec|Use VMM for the model weights (implies enable_manual_loader, rule VMM-04). With enable_vmm_kvcache both share one pool (VMM-02). LLM backend only (W-01).
vmm_elastic|bool|false|vmm|impl,spec|Elastic VMM pool: physical backing grows with mapped pages and idle pages are released; max_memory_utilization is ignored (EL-02). Off: a fixed, fully resident pool sized by max_memory_utilization.
vmm_memory_reserve_bytes|int64|0|vmm|impl,spec,bytes|Extra device memory kept free beside the observed execution peak when an elastic pool grows and admits requests. 0 still keeps the observed execution headroom (EL-07).
enable_task_pipeline|bool|false|vmm|spec|Task execution pipeline. Must be false with enable_vmm_kvcache=true (SD-04).
block_size|int32|128|kv_cache|impl,min=1,plat=1|Tokens per KV cache block (platform default 128; 1 on some builds).
enable_in_batch_prefix_cache|bool|false|kv_cache||Share prefixes between requests of the same batch.
enable_prefix_cache|bool|true|kv_cache|impl,plat=false|Reuse complete KV blocks across requests (XXH3-128 hash chain). With KV VMM, cached blocks keep their pages until evicted in LRU order (PC-01). Platform default true (false on some builds).
enable_xtensor|bool|false|kv_cache||The engine's xtensor KV cache implementation.
indexer_cache_dtype|string|"auto"|kv_cache||Data type of the MLA index (indexer) cache; auto follows the model.
kv_cache_dtype|string|"auto"|kv_cache|impl,values=auto/bfloat16/bf16/float16/fp16/half/float32/fp32/float/float64/int8/uint8/fp8/fp8_e4m3/fp8_e4m3fn/float8_e4m3fn/fp8_e5m2/float8_e5m2|KV cache data type; auto follows the model dtype. Anything else is a quantized KV cache, unsupported with KV VMM (QK-01) and host offload (HK-04). The dtype names the planner sizes.
max_cache_size|int64|0|kv_cache|impl,bytes,plat=1000000|Byte quota of the KV cache; with VMM, of the shared KV/weight pool. 0: no quota (sized from max_memory_utilization, or from live free memory in elastic mode).
max_linear_state_cache_slots|int64|0|kv_cache||Sequence slots reserved for linear-attention / SSM state of hybrid models; 0: derived from max_seqs_per_batch.
max_memory_utilization|double|0.8|kv_cache|impl,plat=0.55|Fraction of device memory the physical KV cache or a fixed VMM pool may use, in (0, 1]. Ignored by an elastic pool (EL-02). Platform default 0.8 (0.55 on some builds).
phy_page_granularity_size|int64|2097152|kv_cache|impl,bytes,min=1|Physical page size of the VMM arena in bytes (2 MiB). One page per VMM tensor is the least a pool can map (EL-06).
xxh3_128bits_seed|uint32|1024|kv_cache|impl|Seed of the XXH3-128 hash used to key prefix-cache blocks.
enable_control_h2d_block_num|bool|false|kv_cache_store||Limit the number of blocks copied host-to-device per step.
enable_kvcache_store|bool|false|kv_cache_store||Use the engine's distributed KV cache store.
host_blocks_factor|double|0.0|kv_cache_store|impl|Host KV tier size as a multiple of the device KV capacity. Above 1 (with enable_prefix_cache) completed blocks are kept in host memory (HK-01); 0 < f <= 1 does nothing (HK-03); negative is an error (HK-08).
layers_wise_copy_batchs|uint32|4|kv_cache_store||Layers copied per batch when moving KV blocks between tiers.
prefetch_batch_size|uint32|2|kv_cache_store||Blocks prefetched per batch from the KV cache store.
prefetch_timeout|uint32|0|kv_cache_store||Prefetch timeout in milliseconds; 0: no timeout.
store_local_hostname|string|""|kv_cache_store||Local host name announced to the KV cache store.
store_master_server_address|string|""|kv_cache_store||Address of the KV cache store's master server.
store_metadata_server|string|""|kv_cache_store||Address of the KV cache store's metadata server.
store_protocol|string|"tcp"|kv_cache_store||Transport of the KV cache store (tcp, rdma).
backend|string|""|model|impl,plat="rec",values=llm/vlm/rec/dit|Engine backend: llm (text), vlm (multimodal), rec (recommendation), dit (diffusion). Empty: inferred from the model (vlm when it has a vision tower, else llm).
device_id|int32|-1|model||Single device index (older engines); prefer devices.
devices|string|""|model|impl|Devices of this process, one worker each: npu:0 (the usual one per process) / npu:0,npu:1 / cuda:0 / cpu / auto. Empty means auto. Kinds: npu, cuda, mlu, ilu, musa, dcu (the engine's), cpu; VMM needs npu, cuda or cpu (VMM-01).
enable_qwen3_reranker|bool|false|model||Serve a Qwen3 reranker model.
enable_return_mm_full_embeddings|bool|false|model||Return full multimodal embeddings.
flashinfer_workspace_buffer_size|int32|134217728|model|bytes,min=0|FlashInfer workspace size in bytes (128 MiB).
limit_image_per_prompt|int32|8|model||Maximum images per prompt.
max_encoder_cache_size|int64|0|model||Capacity of the multimodal encoder cache; 0: disabled.
max_processor_cache_items|int64|256|model||Entries kept in the multimodal processor cache.
mm_download_headers|string|""|model||Extra HTTP headers used when downloading multimodal inputs.
model|string|""|model|impl|Model to serve: a local directory with config.json (read by check-config and plan for model rules), or a catalogue name such as Qwen/Qwen3-8B.
model_id|string|""|model|impl|Model name reported by the API; empty: derived from model.
model_impl|string|""|model||Model implementation to use when several exist.
python_model_path|string|""|model||Path of a Python model implementation.
reasoning_parser|string|""|model||Parser for reasoning content in outputs.
task|string|"generate"|model|impl|Serving task (generate, embed, ...).
tool_call_parser|string|""|model||Parser for tool calls in outputs.
use_audio_in_video|bool|false|model||Use the audio track of video inputs.
use_cpp_chat_template|bool|true|model||Render chat templates with the engine's C++ implementation.
enable_manual_loader|bool|false|load|impl|Load weights through host memory and copy them to the device manually. Implied by enable_vmm_weights (VMM-04).
enable_prefetch_weight|bool|false|load||Prefetch weights ahead of use.
enable_rolling_load|bool|false|load||Load layers into a rolling window of device slots.
rolling_load_num_cached_layers|int32|2|load||Layers kept on the device with rolling load.
rolling_load_num_rolling_slots|int32|-1|load||Rolling slots with rolling load; -1: automatic.
aggressive_coeff|double|1.0|scheduler||Aggressiveness of the scheduler's memory estimate.
chunked_match_frequency|int32|2|scheduler||How often chunked prefill re-matches the prefix cache, in chunks.
enable_chunked_prefill|bool|true|scheduler|impl,plat=false|Split long prompts into chunks across steps (platform default true; false on some builds).
enable_mix_batch|bool|true|scheduler||Mix prefill and decode in one batch.
enable_online_preempt_offline|bool|true|scheduler||Online requests may preempt offline ones.
enable_schedule_overlap|bool|false|scheduler||Overlap scheduling with execution.
enable_starve_prevent|bool|true|scheduler||Prevent starvation of long-waiting requests.
max_decode_token_per_sequence|int32|256|scheduler||Decode token budget per sequence per scheduling round.
max_seqs_per_batch|int32|200|scheduler|impl,min=1,plat=4|Most sequences in one batch (platform default 200; 4 on some builds).
max_tokens_per_batch|int32|10240|scheduler|impl,min=1,plat=4096|Most tokens in one batch (platform default 10240; 4096 on some builds).
max_tokens_per_chunk_for_prefill|int32|-1|scheduler|impl,plat=0|Most tokens per prefill chunk; -1: max_tokens_per_batch (platform default -1; 0 on some builds).
prefill_scheduling_memory_usage_threshold|double|0.95|scheduler||Memory usage above which new prefills are held back.
priority_strategy|string|"fcfs"|scheduler||Request priority strategy (fcfs, priority, ...).
starve_threshold|double|1.0|scheduler||Waiting time factor at which a request counts as starving.
use_mix_scheduler|bool|false|scheduler||Use the mixed scheduler (older engines).
use_zero_evict|bool|false|scheduler||Zero-eviction scheduling.
adaptive_speculative_min_gain|double|0.0|speculative||Least gain at which adaptive speculative decoding keeps speculating.
draft_devices|string|""|speculative||Devices of an external draft model (older engines).
draft_model|string|""|speculative|impl|Path of the draft model; for MTP the co-located MTP weights (SD-05).
enable_adaptive_speculative_decode|bool|false|speculative||Adapt the number of speculative tokens at runtime.
enable_atb_spec_kernel|bool|false|speculative||Use the ATB speculative decoding kernel.
enable_mtp_draft_body_tp1|bool|false|speculative||Run the MTP draft body with tensor parallelism 1.
enable_opt_validate_probs|bool|false|speculative||Optimized validation of draft probabilities.
num_speculative_tokens|int32|0|speculative|impl,min=0|Draft tokens per step; above 0 enables speculative decoding.
speculative_algorithm|string|"MTP"|speculative|impl,values=MTP/Eagle3/Suffix/DFlash|Speculative decoding algorithm (the engine's options): MTP (co-located draft_model), Eagle3 (embedded draft), Suffix (suffix tree, no draft model), DFlash (external draft_model).
speculative_suffix_cache_max_depth|int32|64|speculative||Suffix decoding: deepest suffix tree.
speculative_suffix_max_cached_requests|int32|-1|speculative||Suffix decoding: requests kept in the cache; -1: unlimited.
speculative_suffix_max_spec_factor|double|1.0|speculative||Suffix decoding: speculation length as a factor of the match length.
speculative_suffix_max_spec_offset|double|0.0|speculative||Suffix decoding: speculation length offset.
speculative_suffix_min_token_prob|double|0.1|speculative||Suffix decoding: least probability of a speculated token.
speculative_suffix_use_tree_spec|bool|false|speculative||Suffix decoding: speculate a tree rather than a sequence.
cfg_size|int64|1|parallel||Classifier-free-guidance parallel size.
communication_backend|string|"hccl"|parallel|plat="lccl"|Collective communication backend (platform default hccl; lccl on some builds).
cp_size|int32|1|parallel||Context-parallel size.
dp_size|int32|1|parallel|impl,min=1|Data-parallel groups: each is tensor parallel over nnodes x devices / dp_size workers (must divide the workers).
enable_dp_balance|bool|false|parallel||Balance load between data-parallel ranks.
enable_mm_encoder_dp|bool|false|parallel||Data-parallel multimodal encoder.
enable_multi_stream_parallel|bool|false|parallel||Overlap computation and communication on several streams.
enable_prefill_sp|bool|false|parallel||Sequence parallelism in prefill (older engines).
ep_size|int32|1|parallel||Expert-parallel size: MoE experts split ep_size ways (must divide the workers, nnodes x devices).
kv_split_size|int32|1|parallel||KV split size.
layerwise_split_size|int32|1|parallel||Layer-wise split size.
micro_batch_num|int32|1|parallel||Micro-batches per step.
sp_size|int64|1|parallel||Sequence-parallel size.
text_encoder_tp_size|int64|1|parallel||Tensor-parallel size of a text encoder.
tp_size|int64|1|parallel|impl,min=1|Tensor-parallel size of the DiT backend only (backend=dit); a language model is tensor parallel over nnodes x devices / dp_size workers, as in the engine.
vae_size|int64|1|parallel||VAE parallel size.
disagg_pd_port|int32|7777|disagg_pd||Port of the prefill/decode disaggregation service.
enable_disagg_pd|bool|false|disagg_pd|impl|Prefill/decode disaggregation. With KV VMM: no speculative decoding (SD-03); Mooncake KV transfer needs a fixed pool (PD-01).
enable_pd_ooc|bool|false|disagg_pd||Online/offline co-location with PD disaggregation.
instance_role|string|"DEFAULT"|disagg_pd|values=DEFAULT/PREFILL/DECODE/MIX|Role of this instance in PD disaggregation.
kv_cache_transfer_mode|string|"PUSH"|disagg_pd|values=PUSH/PULL|KV transfer mode.
kv_cache_transfer_type|string|"LlmDataDist"|disagg_pd|impl,values=LlmDataDist/Mooncake/HCCL|KV transfer implementation. Mooncake with KV VMM needs vmm_elastic=false (PD-01).
kv_push_dst_rotate|bool|false|disagg_pd||Rotate destinations when pushing KV blocks.
transfer_listen_port|int32|26000|disagg_pd||Port for KV transfer.
enable_service_routing|bool|false|distributed|impl|Register with a router that routes by cache. KV cache events are not published for VMM blocks (PC-03).
etcd_addr|string|""|distributed||etcd address for service discovery.
etcd_namespace|string|""|distributed||etcd key namespace.
etcd_ttl|int32|3|distributed||etcd lease time-to-live in seconds.
heart_beat_interval|double|0.5|distributed||Heartbeat interval in seconds.
master_node_addr|string|"127.0.0.1:19888"|distributed|plat="127.0.0.1:18899"|Address of the master node of a multi-node deployment (platform default 127.0.0.1:19888; 127.0.0.1:18899 on some builds).
nnodes|int32|1|distributed|min=1|Processes of the whole service, one per device as the engine's scripts launch them (the engine: "the total number of devices used by the current service"); workers = nnodes x devices of one process.
node_rank|int32|0|distributed|min=0|This process's rank among the nnodes processes (0..nnodes-1).
xtensor_master_node_addr|string|"127.0.0.1:19889"|distributed||Address of the xtensor master node.
enable_json_object_output|bool|true|service||Allow JSON-object response formats.
enable_verbose_trace_log|bool|false|service||Write a verbose trace log.
health_check_interval_ms|int32|3000|service||Health check interval in milliseconds.
host|string|""|service|impl|Address the HTTP server binds to; empty: all interfaces (0.0.0.0).
max_concurrent_requests|int32|200|service|impl|Most requests served at once; more are refused.
max_reconnect_count|int32|40|service||Reconnect attempts to peers.
num_request_handling_threads|int32|4|service||Threads that handle requests.
num_response_handling_threads|int32|4|service||Threads that handle responses.
num_threads|int32|8|service||Threads of the RPC server.
port|int32|8010|service|impl,min=0,max=65535,plat=8000|Port of the HTTP server (platform default 8010; 8000 on some builds).
rpc_channel_timeout_ms|int32|-1|service||RPC channel timeout in milliseconds; -1: none.
rpc_idle_timeout_s|int32|-1|service||RPC idle timeout in seconds; -1: none.
verbose_trace_log_max_files|int32|1000|service||Verbose trace log files kept.
verbose_trace_log_max_size_mb|int32|1024|service||Size of one verbose trace log file in MB.
verbose_trace_log_path|string|"log/verbose_trace.log"|service||Path of the verbose trace log.
acl_graph_decode_batch_size_limit|int32|16|execution||Decode batch size above which ACL graph decode falls back to eager mode.
disable_graph_warmup|bool|false|execution||Skip graph warmup at start-up.
enable_graph|bool|false|execution||Capture decode steps as device graphs.
enable_graph_double_buffer|bool|true|execution||Double-buffer graph inputs.
enable_graph_mode_decode_no_padding|bool|false|execution||Capture a graph for every decode token count (no padding).
enable_graph_vmm_pool|bool|true|execution||VMM-backed memory pool for graphs of many shapes (engine default kEnableGraphVmmPoolDefault = true).
enable_prefill_piecewise_graph|bool|false|execution||Piecewise graphs for prefill (attention stays eager).
enable_shm|bool|false|execution||Pass model inputs and outputs through shared memory.
input_shm_size|uint64|1024|execution||Input shared memory size in MB.
max_tokens_for_graph_mode|int32|2048|execution||Most tokens run in graph mode; 0: no limit.
output_shm_size|uint64|128|execution||Output shared memory size in MB.
python_graph_backend|string|"off"|execution||Graph backend of Python models (off, ...).
random_seed|int32|-1|execution|impl|Seed of the sampler's random numbers; -1: random.
use_contiguous_input_buffer|bool|true|execution||Keep model inputs in one contiguous device buffer.
enable_aclnn_matmul|bool|false|kernel||Use aclnn matmul kernels.
enable_aclnn_swiglu|bool|false|kernel||Use aclnn SwiGLU kernels.
enable_customize_mla_kernel|bool|false|kernel||Use the customized MLA kernel.
enable_dspark_native_sas|bool|false|kernel||Use the native sparse attention kernel.
enable_flashcomm1|bool|false|kernel||FlashComm1 communication fusion.
enable_fused_mc2|int32|-1|kernel||Fused MC2 kernels: -1 automatic, 0 off, 1 on.
enable_interlayer_addnorm|bool|false|kernel||Fuse add and norm across layers.
enable_intralayer_addnorm|bool|false|kernel||Fuse add and norm within a layer.
enable_mega_moe|bool|false|kernel||Use the fused MoE kernel.
enable_mmrs_fusion|bool|false|kernel||Fuse matmul with reduce-scatter.
enable_split_rmsnorm_rope|bool|false|kernel||Split RMSNorm and RoPE kernels.
flashcomm1_min_prefill_tokens|int32|8192|kernel||Least prefill tokens for FlashComm1.
mmrs_comm_mode|string|"aiv"|kernel||Communication mode of matmul-reduce-scatter fusion.
npu_kernel_backend|string|"AUTO"|kernel||NPU kernel backend: AUTO or a named backend.
enable_eplb|bool|false|eplb||Expert-parallel load balancing.
eplb_min_peak_load_improvement|double|0.05|eplb||Least peak-load improvement for a rebalance.
eplb_policy_kind|string|"balanced"|eplb||Load-balancing policy.
eplb_prepare_timeout_seconds|int32|30|eplb||Timeout for preparing a rebalance, in seconds.
eplb_update_interval|int64|1000|eplb||Steps between load-balance updates.
eplb_update_threshold|double|0.8|eplb||Imbalance threshold for an update (older engines).
eplb_use_decode_only_load|bool|false|eplb||Balance by decode load only.
expert_parallel_degree|int32|0|eplb||Expert-parallel degree; 0: automatic.
rank_tablefile|string|""|eplb||Path of the rank table file.
redundant_experts_num|int32|1|eplb||Redundant experts per device.
beam_width|int32|1|beam_search|plat=128|Beam width (platform default 1; 128 on some builds).
enable_beam_search_kernel|bool|false|beam_search||Use the beam search kernel.
enable_block_copy_kernel|bool|true|beam_search|plat=false|Use the block copy kernel (platform default true; false on some builds).
enable_topk_sorted|bool|true|beam_search||Sort top-k results.
disable_ttft_profiling|bool|false|profile||Skip time-to-first-token profiling at start-up.
enable_forward_interruption|bool|false|profile||Allow interrupting a forward pass.
enable_latency_aware_schedule|bool|false|profile||Schedule with a latency model.
enable_online_profile|bool|false|profile||Profile online.
enable_profile_kv_blocks|bool|true|profile||Profile KV block usage.
enable_profile_step_time|bool|false|profile||Profile step times.
enable_profile_token_budget|bool|false|profile||Profile the token budget.
max_global_tpot_ms|int32|2147483647|profile||Target time per output token in ms (engine default std::numeric_limits<int32_t>::max() = 2147483647: none).
max_global_ttft_ms|int32|2147483647|profile||Target time to first token in ms (engine default std::numeric_limits<int32_t>::max() = 2147483647: none).
profile_backend|string|"torch"|profile||Profiler backend.
profile_dir|string|""|profile||Directory of profiler output.
profile_max_prompt_length|int32|2048|profile||Longest prompt profiled.
each_conversion_threshold|int32|50|rec||Recommendation: conversion threshold per item.
enable_constrained_decoding|bool|false|rec||Recommendation: constrained decoding.
enable_convert_tokens_to_item|bool|false|rec||Recommendation: convert tokens to items.
enable_extended_item_info|bool|false|rec||Recommendation: extended item information.
enable_output_sku_logprobs|bool|false|rec||Recommendation: output SKU log-probabilities.
enable_rec_fast_sampler|bool|true|rec||Recommendation: fast sampler.
enable_rec_prefill_only|bool|false|rec||Recommendation: prefill only.
enable_xattention_one_stage|bool|false|rec||Recommendation: one-stage cross attention.
max_decode_rounds|int32|0|rec|plat=3|Recommendation: decode rounds (platform default 0; 3 on some builds).
output_rec_logprobs|bool|false|rec||Recommendation: output log-probabilities.
rec_worker_max_concurrency|uint32|1|rec||Recommendation: worker concurrency.
request_queue_size|int32|100000|rec||Recommendation: request queue size.
total_conversion_threshold|int32|1000|rec||Recommendation: total conversion threshold.
dit_cache_end_blocks|int64|5|dit||DiT cache: end blocks.
dit_cache_end_steps|int64|5|dit||DiT cache: end steps.
dit_cache_n_derivatives|int64|3|dit||DiT cache: derivatives of the TaylorSeer policy.
dit_cache_policy|string|"TaylorSeer"|dit||DiT cache policy.
dit_cache_residual_diff_threshold|double|0.09|dit||DiT cache: residual difference threshold.
dit_cache_skip_interval_steps|int64|3|dit||DiT cache: steps between recomputations.
dit_cache_start_blocks|int64|5|dit||DiT cache: start blocks.
dit_cache_start_steps|int64|5|dit||DiT cache: start steps.
dit_cache_warmup_steps|int64|0|dit||DiT cache: warmup steps.
dit_debug_print|bool|false|dit||DiT: debug output.
dit_enable_vae_tiling|bool|false|dit||DiT: tiled VAE decoding.
dit_generation_image_area_max|int64|0|dit||DiT: largest generated image area in pixels; 0: no limit.
dit_laser_attention_enabled|bool|false|dit||DiT: laser attention.
dit_sp_communication_overlap|bool|true|dit||DiT: overlap sequence-parallel communication.
dit_sparse_attention_enabled|bool|false|dit||DiT: sparse attention.
dit_sparse_attention_mask_refresh_steps|int64|1|dit||DiT sparse attention: steps between mask refreshes.
dit_sparse_attention_pool_size|int64|128|dit||DiT sparse attention: pool size.
dit_sparse_attention_sparse_start_step|int64|0|dit||DiT sparse attention: first sparse step.
dit_sparse_attention_sparsity|double|0.5|dit||DiT sparse attention: sparsity.
dit_sparse_attention_version|string|"rain_fusion"|dit||DiT sparse attention: implementation.
dit_vae_image_size|int64|1048576|dit||DiT: VAE image size in pixels.
max_requests_per_batch|int32|1|dit||DiT: requests per batch.
max_sequence_length|int32|0|dit||DiT: longest text sequence; 0: model default.
config_json_file|string|""|config_utils|impl|The engine's JSON configuration file (flat flag keys). Its values override the command line.
dump_config_json_file|string|"xllm_config.json"|config_utils||Where to dump the effective configuration as JSON.
enable_dump_config_json|bool|false|config_utils||Dump the effective configuration as JSON at start-up.
idle_timeout_s|int32|-1|utils||Exit after this many idle seconds; -1: never.
init_task|string|"generate"|utils||Initial task.
instance_name|string|""|utils||Name of this instance.
listen_addr|string|""|utils||Address the RPC service listens on.
max_token_per_req|uint32|1000|utils||Most tokens per request (engine utility).
model_path|string|""|utils||Model path (engine utility).
server_idx|uint32|0|utils||Index of this server.
xllm_init_log_dir|string|""|utils||Directory of start-up logs.
xservice_addr|string|""|utils||Address of the xservice router.
"""


def _literal(text: str, ftype: str) -> object:
    if ftype == "bool":
        if text not in ("true", "false"):
            raise ValueError(text)
        return text == "true"
    if ftype == "string":
        if not (text.startswith('"') and text.endswith('"')):
            raise ValueError(text)
        return text[1:-1]
    if ftype == "double":
        return float(text)
    return int(text)


def _build() -> dict[str, FlagDef]:
    flags: dict[str, FlagDef] = {}
    for line in _TABLE.strip().splitlines():
        name, ftype, default, group, attrs, help_text = line.split("|", 5)
        opts: dict = {}
        for attr in filter(None, attrs.split(",")):
            key, _, val = attr.partition("=")
            if key == "bytes":
                opts["unit"] = "bytes"
            elif key == "impl":
                opts["implemented"] = True
            elif key == "spec":
                opts["origin"] = "spec"
            elif key == "min":
                opts["minimum"] = float(val) if "." in val else int(val)
            elif key == "max":
                opts["maximum"] = float(val) if "." in val else int(val)
            elif key == "plat":
                opts["platform_default"] = val.strip('"')
            elif key == "values":
                opts["choices"] = tuple(val.split("/"))
        if opts.get("choices"):
            help_text += " Values: " + ", ".join(opts["choices"]) + \
                (" (exactly as written; empty too)." if default == '""' else
                 " (exactly as written).")
        flags[name] = FlagDef(name, ftype, _literal(default, ftype), group, help_text, **opts)
    return flags


#: Every flag, by name (insertion order: by group as in ``GROUPS``-ish table order).
FLAGS: dict[str, FlagDef] = _build()


def flags_by_group() -> dict[str, list[FlagDef]]:
    """Flags grouped in ``GROUPS`` order, sorted by name within a group."""
    out: dict[str, list[FlagDef]] = {g: [] for g in GROUPS}
    for flag in FLAGS.values():
        out[flag.group].append(flag)
    for group in out.values():
        group.sort(key=lambda f: f.name)
    return out


def suggest(name: str, n: int = 3) -> list[str]:
    """Known flag names closest to ``name`` (for "did you mean" hints)."""
    import difflib

    key = name.replace("-", "_").lower()
    close = difflib.get_close_matches(key, FLAGS, n=n, cutoff=0.6)
    if not close:
        close = [f for f in FLAGS if key and (key in f or f in key)][:n]
    return close
