"""Every SGLang name sglang-xpu-lora imports, patches, overrides or reads, spelled once.

* :data:`ALL`: modules' functions, classes and hook targets, resolved by dotted path (every
  public string constant of this module);
* :data:`REQUIRED_PARAMETERS`: the parameters the plugin passes or receives by name (also those of
  the parent methods ``IntelXpuLoRABackend`` overrides);
* :data:`REQUIRED_ATTRIBUTES`: per SGLang class, the attributes the plugin reads, sets, inherits or
  overrides on its instances (``LoRAMemoryPool.A_buffer``, ``LoRABatchInfo.permutation``...);
* :data:`MODEL_ATTRIBUTES`: attributes of SGLang model classes, checked in their modules' source
  (those modules are too heavy to import at plugin load);
* :data:`REQUIRED_KERNEL_ARGUMENTS`: the argument lists of the Triton kernels the plugin launches
  with positional arguments;
* :data:`REQUIRED_SOURCE`: text an SGLang function must still contain, where the plugin depends on
  how SGLang does something rather than on a name.

:func:`sglang_xpu_lora.upstream.compat.check_host` checks all of it against the installed SGLang
before anything is registered, so a moved or renamed name is reported by name instead of failing
inside a hook or at the first forward. ``tests/integration/test_sglang_surface.py`` reads the
plugin's source and fails when it uses an SGLang name or attribute missing here.

Plain strings only: this module imports nothing (``sglang_xpu_lora.upstream`` is a leaf).
"""

from __future__ import annotations

# Registries and CLI.
LORA_BACKEND_REGISTRY = "sglang.srt.lora.backend.lora_registry.LORA_SUPPORTED_BACKENDS"
REGISTER_LORA_BACKEND = "sglang.srt.lora.backend.lora_registry.register_lora_backend"
SERVER_ARGS = "sglang.srt.server_args.ServerArgs"
SERVER_ARGS_RESOLVE_ONCE = SERVER_ARGS + ".resolve_once"  # refused backends fail before resolution
SERVER_ARGS_FIELD_ARG = "sglang.srt.arg_groups.arg_utils.Arg"

# Hook targets (HookRegistry paths).
CHECK_LORA_SERVER_ARGS = "sglang.srt.arg_groups.lora_hook.check_lora_server_args"
RESOLVING_VIEW = "sglang.srt.arg_groups.overrides.resolving_view"
# The resolution step that fills in --device when it is not given (SGLang's get_device picks it).
HANDLE_MISSING_DEFAULT_VALUES = "sglang.srt.arg_groups.serving_hook.handle_missing_default_values"
GET_DEVICE = "sglang.srt.utils.common.get_device"
LORA_MANAGER_INIT_MEMORY_POOL = "sglang.srt.lora.lora_manager.LoRAManager.init_memory_pool"
POOL_LOAD_WEIGHTS = "sglang.srt.lora.mem_pool.LoRAMemoryPool.load_lora_weight_to_buffer"
POOL_CLEAR_SLOT = "sglang.srt.lora.mem_pool.LoRAMemoryPool._clear_buffer_slot_for_base"

# Adapter checks at load (patches/adapter_checks.py).
LORA_MANAGER_VALIDATE_NEW_ADAPTER = "sglang.srt.lora.lora_manager.LoRAManager.validate_new_adapter"
LORA_MANAGER_LOAD_ADAPTER = "sglang.srt.lora.lora_manager.LoRAManager._load_lora_adapter"
LORA_MANAGER_LOAD_ADAPTER_FROM_TENSORS = "sglang.srt.lora.lora_manager.LoRAManager._load_lora_adapter_from_tensors"
LORA_MANAGER_PREPARE_LORA_BATCH = "sglang.srt.lora.lora_manager.LoRAManager.prepare_lora_batch"
LORA_ADAPTER_INIT = "sglang.srt.lora.lora.LoRAAdapter.__init__"
LORA_ADAPTER_INITIALIZE_WEIGHTS = "sglang.srt.lora.lora.LoRAAdapter.initialize_weights"
LORA_ADAPTER_INITIALIZE_WEIGHTS_FROM_TENSORS = "sglang.srt.lora.lora.LoRAAdapter.initialize_weights_from_tensors"
LORA_ADAPTER_NORMALIZE_WEIGHTS = "sglang.srt.lora.lora.LoRAAdapter._normalize_weights"
GET_LORA = "sglang.srt.runtime_context.get_lora"
GET_NORMALIZED_TARGET_MODULES = "sglang.srt.lora.utils.get_normalized_target_modules"
AUTO_DETECT_LORA_TARGET_MODULES = "sglang.srt.lora.utils.auto_detect_lora_target_modules"
# The normalized target modules SGLang's LoRA can serve (its pool, dims and layer wrapping know them).
KNOWN_LORA_TARGET_MODULES = "sglang.srt.lora.utils._KNOWN_LORA_TARGET_MODULES"
# The training files SGLang's loader skips among *.bin / *.pt (adapters/adapter_files.py).
FILTER_FILES_NOT_NEEDED_FOR_INFERENCE = "sglang.srt.model_loader.weight_utils.filter_files_not_needed_for_inference"

# Scheduler start-up failures raised in the launching caller (patches/startup_failure.py).
SET_ENVS_AND_CONFIG = "sglang.srt.entrypoints.engine._set_envs_and_config"
WAIT_FOR_SCHEDULER_READY = "sglang.srt.entrypoints.engine._wait_for_scheduler_ready"
SCHEDULER_INIT = "sglang.srt.managers.scheduler.Scheduler.__init__"
KILL_PROCESS_TREE = "sglang.srt.utils.common.kill_process_tree"
# (the launch's TokenizerManager, made before the wait, is recorded to close its sockets on failure)
TOKENIZER_MANAGER_INIT = "sglang.srt.managers.tokenizer_manager.TokenizerManager.__init__"

# Unloads made final (patches/unload_final.py), in the TokenizerManager's process.
TOKENIZER_MANAGER = "sglang.srt.managers.tokenizer_manager.TokenizerManager"
TOKENIZER_RESOLVE_LORA_PATH = TOKENIZER_MANAGER + "._resolve_lora_path"
TOKENIZER_CONTROL_MIXIN = "sglang.srt.managers.tokenizer_control_mixin.TokenizerControlMixin"
TOKENIZER_UNLOAD_LORA_ADAPTER = TOKENIZER_CONTROL_MIXIN + ".unload_lora_adapter"
TOKENIZER_LOAD_LORA_ADAPTER = TOKENIZER_CONTROL_MIXIN + ".load_lora_adapter"
LORA_REGISTRY = "sglang.srt.lora.lora_registry.LoRARegistry"
LORA_REGISTRY_RELEASE = LORA_REGISTRY + ".release"
LORA_REGISTRY_ACQUIRE = LORA_REGISTRY + ".acquire"
LORA_REGISTRY_UNREGISTER = LORA_REGISTRY + ".unregister"
UNLOAD_LORA_ADAPTER_REQ_INPUT = "sglang.srt.managers.io_struct.UnloadLoRAAdapterReqInput"
# A request's LoRA fields checked where it enters (patches/request_checks.py), same process.
GENERATE_REQ_INPUT = "sglang.srt.managers.io_struct.GenerateReqInput"
GENERATE_REQ_NORMALIZE = GENERATE_REQ_INPUT + ".normalize_batch_and_arguments"
GENERATE_REQ_NORMALIZE_LORA_PATHS = GENERATE_REQ_INPUT + "._normalize_lora_paths"
EMBEDDING_REQ_INPUT = "sglang.srt.managers.io_struct.EmbeddingReqInput"
EMBEDDING_REQ_NORMALIZE = EMBEDDING_REQ_INPUT + ".normalize_batch_and_arguments"
VOCAB_PARALLEL_EMBEDDING = "sglang.srt.layers.vocab_parallel_embedding.VocabParallelEmbedding"
PARALLEL_LM_HEAD = "sglang.srt.layers.vocab_parallel_embedding.ParallelLMHead"

# Models that compute their logits from the input embedding (patches/embedding_logits.py).
LOGITS_PROCESSOR_FORWARD = "sglang.srt.layers.logits_processor.LogitsProcessor.forward"
VOCAB_PARALLEL_EMBEDDING_WITH_LORA = "sglang.srt.lora.layers.VocabParallelEmbeddingWithLoRA"

# The parent backend and what it reuses.
TRITON_BACKEND = "sglang.srt.lora.backend.triton_backend.TritonLoRABackend"
TRITON_PREPARE_LORA_BATCH = TRITON_BACKEND + ".prepare_lora_batch"
TRITON_SGEMM_INFO = TRITON_BACKEND + "._sgemm_info"
TRITON_INIT_PREFILL_GRAPH_INFO = TRITON_BACKEND + ".init_prefill_cuda_graph_batch_info"
TRITON_INIT_DECODE_GRAPH_INFO = TRITON_BACKEND + ".init_decode_cuda_graph_batch_info"
LORA_BATCH_INFO = "sglang.srt.lora.utils.LoRABatchInfo"
# SGLang's Triton LoRA kernels' wrappers: the embedding's is called by the triton provider
# (providers/triton_ops.py); the others' tiles are source anchors (REQUIRED_SOURCE), the launches
# they make are repeated (providers/triton_launch.py). The parent backend's module imports them
# already, so resolving them imports nothing more.
_TRITON_DENSE = "sglang.kernels.ops.lora.dense."
TRITON_EMBEDDING_LORA_A = _TRITON_DENSE + "embedding_lora_a.embedding_lora_a_fwd"
TRITON_SGEMM_LORA_A = _TRITON_DENSE + "sgemm_lora_a.sgemm_lora_a_fwd"
TRITON_SGEMM_LORA_B = _TRITON_DENSE + "sgemm_lora_b.sgemm_lora_b_fwd"
TRITON_QKV_LORA_B = _TRITON_DENSE + "qkv_lora_b.qkv_lora_b_fwd"
TRITON_GATE_UP_LORA_B = _TRITON_DENSE + "gate_up_lora_b.gate_up_lora_b_fwd"
# Their triton.jit kernels, launched from compiled handles (providers/triton_launch.py).
TRITON_SGEMM_LORA_A_KERNEL = _TRITON_DENSE + "sgemm_lora_a._sgemm_lora_a_kernel"
TRITON_SGEMM_LORA_B_KERNEL = _TRITON_DENSE + "sgemm_lora_b._sgemm_lora_b_kernel"
TRITON_QKV_LORA_B_KERNEL = _TRITON_DENSE + "qkv_lora_b._qkv_lora_b_kernel"
TRITON_GATE_UP_LORA_B_KERNEL = _TRITON_DENSE + "gate_up_lora_b._gate_up_lora_b_kernel"
FUSED_MOE = "sglang.srt.layers.moe.fused_moe_triton.layer.FusedMoE"  # LoRA on it runs outside the backend
LORA_BATCH_LAYOUT = "sglang.srt.runtime_context.LoRABatchLayout"
PREFILL_GRAPH_RUNNER_INIT = (
    "sglang.srt.model_executor.runner.prefill_cuda_graph_runner.PrefillCudaGraphRunner.__init__"
)

# The dense tier (dense/): SGLang's triton_v2 runner, plans, workspace and kernels, run on any device.
DENSE_RUNNER = "sglang.srt.lora.dense.runner.DenseLoraRunner"
DENSE_BRIDGE = "sglang.srt.lora.dense.runner.Bridge"
DENSE_PLAN = "sglang.srt.lora.dense.plan.DensePlan"
DENSE_PLAN_TABLE = "sglang.srt.lora.dense.plan.DensePlanTable"
DENSE_A_FAMILY = "sglang.srt.lora.dense.plan.AFamily"
DENSE_B_FAMILY = "sglang.srt.lora.dense.plan.BFamily"
DENSE_OVERLAP = "sglang.srt.lora.dense.plan.Overlap"
DENSE_LORA_KIND = "sglang.srt.lora.dense.plan.DenseLoraKind"
LORA_PHASE = "sglang.srt.lora.utils.Phase"
ARCHITECTURE_FOR_CAPABILITY = "sglang.srt.lora.utils.architecture_for_capability"
LORA_WORKSPACE = "sglang.srt.lora.workspace.LoraWorkspace"
COMPUTE_TOKEN_LORA_MAPPING = "sglang.srt.lora.backend.base_backend._compute_token_lora_mapping"
_COMMON_OPS = "sglang.kernels.ops.lora.common."
SLICE_GEOMETRY = _COMMON_OPS + "lora_b.SliceGeometry"
GROUPED_LORA_B = _COMMON_OPS + "lora_b.grouped_lora_b"
PER_ROW_LORA_B = _COMMON_OPS + "lora_b.per_row_lora_b"
SLICE_OF_TILE = _COMMON_OPS + "lora_b._slice_of_tile"  # a Triton helper the fused kernel calls (dense/fused.py)
BUILD_ROUTE = _COMMON_OPS + "routing.build_route"
ROUTE_VIEW = _COMMON_OPS + "route_view.RouteView"
ROUTE_VIEW_KIND = _COMMON_OPS + "route_view.RouteViewKind"

# Plugin machinery.
HOOK_REGISTRY = "sglang.srt.plugins.hook_registry.HookRegistry"
HOOK_TYPE = "sglang.srt.plugins.hook_registry.HookType"
LOAD_PLUGINS = "sglang.srt.plugins.load_plugins"  # doctor loads the plugins as SGLang does
CONFIGURE_LOGGER = "sglang.srt.utils.common.configure_logger"  # the plugin's log line follows it

# Classes whose instances the plugin is handed (hook arguments, the parent backend's state); what
# it reads or sets on them is in REQUIRED_ATTRIBUTES.
LORA_MANAGER = "sglang.srt.lora.lora_manager.LoRAManager"
LORA_MEMORY_POOL = "sglang.srt.lora.mem_pool.LoRAMemoryPool"
LORA_ADAPTER = "sglang.srt.lora.lora.LoRAAdapter"
LORA_LAYER = "sglang.srt.lora.lora.LoRALayer"
LORA_CONFIG = "sglang.srt.lora.lora_config.LoRAConfig"
LORA_REF = "sglang.srt.lora.lora_registry.LoRARef"
LORA_UPDATE_OUTPUT = "sglang.srt.managers.io_struct.LoRAUpdateOutput"
BASE_LAYER_WITH_LORA = "sglang.srt.lora.layers.BaseLayerWithLoRA"
# The layer forward_with_base receives (every LoRA layer class defines apply_lora; this one's subclasses
# are the q/k/v and gate/up layers).
COLUMN_PARALLEL_LINEAR_WITH_LORA = "sglang.srt.lora.layers.ColumnParallelLinearWithLoRA"
LINEAR_BASE = "sglang.srt.layers.linear.LinearBase"
QKV_PARALLEL_LINEAR = "sglang.srt.layers.linear.QKVParallelLinear"
MERGED_COLUMN_PARALLEL_LINEAR = "sglang.srt.layers.linear.MergedColumnParallelLinear"

#: Every dotted name above, in the order written: derived from this module (each public string
#: constant), so a name added here is checked without being listed again.
ALL = tuple(
    value for name, value in dict(globals()).items()
    if name.isupper() and not name.startswith("_") and isinstance(value, str)
)

#: Callables whose parameters the plugin passes or receives by name.
REQUIRED_PARAMETERS = {
    POOL_LOAD_WEIGHTS: ("uid", "buffer_id", "lora_adapter"),
    TRITON_INIT_PREFILL_GRAPH_INFO: ("max_num_tokens", "max_num_requests"),
    TRITON_INIT_DECODE_GRAPH_INFO: ("max_bs_in_cuda_graph", "num_tokens_per_req"),
    TRITON_PREPARE_LORA_BATCH: (
        "forward_batch", "weight_indices", "lora_ranks", "scalings", "use_cuda_graph", "use_prefill_cuda_graph"
    ),
    TRITON_SGEMM_INFO: ("pruned_batch_info",),
    # The triton provider passes these by name.
    TRITON_EMBEDDING_LORA_A: ("input_ids", "weights", "batch_info", "vocab_size", "extra_embeddings"),
    LORA_MANAGER_VALIDATE_NEW_ADAPTER: ("lora_config", "lora_ref"),
    LORA_MANAGER_LOAD_ADAPTER: ("lora_ref",),
    LORA_MANAGER_LOAD_ADAPTER_FROM_TENSORS: ("lora_ref", "tensors", "config_dict"),
    # The hook reads lm_head by name or at this position (after self).
    LOGITS_PROCESSOR_FORWARD: ("input_ids", "hidden_states", "lm_head"),
    TOKENIZER_UNLOAD_LORA_ADAPTER: ("obj",),
    LORA_REGISTRY_RELEASE: ("lora_id",),
    LORA_UPDATE_OUTPUT: ("success", "error_message", "loaded_adapters"),
    # Parent methods IntelXpuLoRABackend overrides, with the parameters its overrides name.
    TRITON_BACKEND + ".__init__": ("max_loras_per_batch", "device"),
    TRITON_BACKEND + ".validate_lora_targets": ("base_model", "target_modules"),
    TRITON_BACKEND + ".run_lora_a_embedding": ("input_ids", "weights", "vocab_size", "extra_embeddings"),
    TRITON_BACKEND + ".run_lora_a_sgemm": ("x", "weights", "pruned_batch_info", "stack_num"),
    TRITON_BACKEND + ".run_lora_b_sgemm": ("x", "weights", "base_output", "pruned_batch_info"),
    TRITON_BACKEND + ".run_qkv_lora": (
        "x", "qkv_lora_a", "qkv_lora_b", "output_offset", "max_qkv_out_dim", "base_output", "n_slices"
    ),
    TRITON_BACKEND + ".run_gate_up_lora": ("x", "gate_up_lora_a", "gate_up_lora_b", "base_output"),
    TRITON_BACKEND + ".get_batch_info": ("layout",),
    TRITON_BACKEND + ".forward_with_base": (
        "layer", "x", "base_fn", "lora_a", "lora_b", "output_offset", "offsets", "all_reduce", "kind", "pruned_batch_info"
    ),
    # The dense tier: what it calls by name and the runner and workspace methods it overrides.
    COMPUTE_TOKEN_LORA_MAPPING: ("num_tokens", "seg_indptr", "lora_ranks", "weight_indices", "token_lora_mapping",
                                 "max_len", "bucket_len"),
    DENSE_RUNNER + ".__init__": ("workspace", "max_loras", "device", "architecture"),
    DENSE_RUNNER + ".begin_batch": ("token_slots", "lora_ranks", "scalings", "num_tokens", "phase", "graph_mode",
                                    "is_prefill_graph"),
    DENSE_RUNNER + ".plan_for": ("kind", "max_rank", "in_features", "out_features", "num_tokens"),
    DENSE_RUNNER + "._build_route": ("key",),
    DENSE_RUNNER + ".run_b": ("bridge", "b", "out", "offsets", "plan", "add_inplace", "lora_ranks", "scalings",
                              "bridge_slices"),
    DENSE_RUNNER + ".apply": ("x", "base_fn", "plan", "a", "b", "offsets", "all_reduce"),
    DENSE_PLAN_TABLE: ("architecture", "max_rank"),
    DENSE_PLAN_TABLE + ".plan_for": ("kind", "phase", "num_tokens", "in_features", "out_features"),
    DENSE_PLAN: ("a_family", "b_family", "overlap", "block_size", "a_tiles", "b_tiles"),
    LORA_WORKSPACE + "._capturing": ("device",),
    LORA_WORKSPACE + "._caller": ("device",),
    LORA_WORKSPACE + ".run_parallel": ("name", "device", "compute", "side"),
    BUILD_ROUTE: ("token_slots", "max_loras", "block_size", "view", "workspace", "tensor_prefix", "capacity"),
    GROUPED_LORA_B: ("geometry", "config", "add_inplace", "zero_sentinel", "lora_ranks", "scalings", "planes",
                     "bridge_slices"),
    PER_ROW_LORA_B: ("geometry", "config", "add_inplace", "zero_sentinel", "lora_ranks", "scalings", "planes",
                     "slot_planes", "bridge_slices"),
    SLICE_GEOMETRY: ("slice_offsets", "out_offsets", "num_slices", "num_column_tiles", "uniform_width", "out_stride",
                     "full_tiles", "block_size_n"),
}

#: Per class: the attributes the plugin reads, sets, inherits or overrides on it (a class attribute,
#: a method, a dataclass or struct field, or an attribute some class of its MRO assigns to ``self``).
REQUIRED_ATTRIBUTES = {
    # cfg = resolving_view(server_args) in the validation and adapter-check hooks; get_lora()
    # publishes the LoRA group of these fields (max_lora_rank).
    SERVER_ARGS: (
        "enable_lora", "lora_backend", "lora_paths", "lora_target_modules", "max_lora_rank", "model_path",
        "trust_remote_code", "device", "custom_sigquit_handler", "tokenizer_worker_num",
    ),
    SERVER_ARGS_FIELD_ARG: ("choices",),
    HOOK_REGISTRY: ("register",),
    HOOK_TYPE: ("AROUND", "AFTER", "BEFORE"),
    LORA_MANAGER: (
        "base_model", "base_hf_config", "lora_backend", "memory_pool", "configs", "loras", "target_modules",
        "create_lora_update_result",
    ),
    # The trial captures take their rank and value dtype (providers/capture_probe.py).
    LORA_MEMORY_POOL: ("max_lora_rank", "dtype", "_clear_buffer_slot_for_base"),
    LORA_ADAPTER: ("config", "base_model", "base_hf_config", "layers", "embedding_layers", "scaling"),
    LORA_LAYER: ("weights",),
    LORA_CONFIG: ("r", "hf_config", "target_modules", "added_tokens_config"),
    LORA_REF: ("lora_id", "lora_name", "lora_path"),
    LORA_UPDATE_OUTPUT: ("success", "error_message"),
    # patches/unload_final.py: the manager's adapter names.
    TOKENIZER_MANAGER: ("lora_ref_cache", "lora_registry", "pending_lora_unloads"),
    # The registry's own mapping: one lookup per requested name (unload_final.is_registered), not a copy.
    LORA_REGISTRY: ("get_all_adapters", "num_registered_loras", "_registry"),
    UNLOAD_LORA_ADAPTER_REQ_INPUT: ("lora_name",),
    # patches/request_checks.py: the fields it checks and the batch SGLang's normalisation found.
    GENERATE_REQ_INPUT: ("lora_path", "lora_id", "is_single", "batch_size", "parallel_sample_num"),
    EMBEDDING_REQ_INPUT: ("lora_path", "lora_id", "is_single", "batch_size"),
    LORA_BATCH_INFO: (
        "use_cuda_graph", "bs", "num_segments", "seg_indptr", "seg_lens", "weight_indices", "lora_ranks", "scalings",
        "max_len", "permutation", "expected_tokens",
    ),
    LORA_BATCH_LAYOUT: ("DP_LOCAL",),
    # Inherited state and methods IntelXpuLoRABackend reads, and what it overrides (the
    # ``name`` every concrete SGLang backend declares is read from any manager's backend;
    # ``skip_inactive_dense_lora`` is read by SGLang's layers and decode graph runner).
    TRITON_BACKEND: (
        "name", "supports_dp_attention", "device", "max_loras_per_batch", "batch_info", "sgemm_batch_info",
        "lm_head_batch_info", "lm_head_pass_batch_infos", "prefill_cuda_graph_batch_info",
        "prefill_cuda_graph_max_tokens", "get_batch_info", "_sgemm_info", "validate_lora_targets",
        "prepare_lora_batch", "prepare_lora_token_segments", "init_decode_cuda_graph_batch_info",
        "init_prefill_cuda_graph_batch_info", "run_lora_a_embedding", "run_lora_a_sgemm", "run_lora_b_sgemm",
        "run_qkv_lora", "run_gate_up_lora", "skip_inactive_dense_lora", "forward_with_base", "reset_routing_cache",
        "reset_batch_state",
    ),
    # The dense tier's reads of SGLang's runner, plans and workspace (dense/).
    DENSE_RUNNER: (
        "workspace", "max_loras", "architecture", "phase", "token_slots", "lora_ranks", "scalings", "begin_batch",
        "set_num_tokens", "plan_for", "route", "raw_route", "_build_route", "run_b", "apply", "reset_routes",
    ),
    DENSE_BRIDGE: ("tensor", "planes", "slot_planes"),
    DENSE_PLAN: ("a_family", "b_family", "b_tiles", "block_size"),
    DENSE_B_FAMILY: ("GROUPED",),
    # The fused per-row kernel (dense/fused.py): its overlaps, and the slice geometry it launches on.
    DENSE_OVERLAP: ("NONE", "AB_DELTA"),
    SLICE_GEOMETRY: (
        "slice_offsets", "out_offsets", "num_slices", "num_column_tiles", "uniform_width", "out_stride", "full_tiles",
        "block_size_n",
    ),
    DENSE_LORA_KIND: ("LINEAR",),
    LORA_PHASE: ("PREFILL", "DECODE"),
    ROUTE_VIEW_KIND: ("ALIGNED",),
    LORA_WORKSPACE: ("_capturing", "_caller", "run_parallel"),
    # Layers whose sizes the adapter checks read (adapters/tensor_checks.py).
    BASE_LAYER_WITH_LORA: ("base_layer",),
    COLUMN_PARALLEL_LINEAR_WITH_LORA: ("apply_lora",),
    VOCAB_PARALLEL_EMBEDDING_WITH_LORA: ("base_layer", "lora_backend"),
    VOCAB_PARALLEL_EMBEDDING: ("org_vocab_size", "embedding_dim"),
    QKV_PARALLEL_LINEAR: ("total_num_heads", "total_num_kv_heads", "head_size", "v_head_size", "hidden_size"),
    MERGED_COLUMN_PARALLEL_LINEAR: ("output_sizes", "input_size"),
    LINEAR_BASE: ("input_size", "output_size"),
}

#: Attributes read on SGLang models by name (no class to resolve: any model may have them), with a
#: module whose source must still assign each to ``self``.
MODEL_ATTRIBUTES = {
    "lm_head": "sglang.srt.models.llama",  # an untied lm_head; a tied one is the embedding
    "kv_b_proj": "sglang.srt.models.deepseek_v2",  # absorbed-MLA attention: LoRA on kv_b_proj ...
    "w_kc": "sglang.srt.models.deepseek_v2",  # ... is computed by SGLang, outside the backend
}

#: SGLang 0.5.23 models (their class name is the architecture SGLang serves them as) whose forward
#: hands the input embedding (``embed_tokens``) to the logits processor as the lm_head, directly or
#: through a language model they hold -> whether only with tied word embeddings
#: (``tie_word_embeddings``; MiniCPM picks the head by it, Gemma 4 when its text config ties them).
#: ``tests/integration/test_embedding_logits.py`` rescans SGLang's models and fails when this differs.
EMBEDDING_AS_LM_HEAD = {
    "CohereForCausalLM": False,
    "Cohere2ForCausalLM": False,
    "Cohere2MoeForCausalLM": False,
    "Cohere2VisionForConditionalGeneration": False,
    "GemmaForCausalLM": False,
    "Gemma2ForCausalLM": False,
    "Gemma3ForCausalLM": False,
    "Gemma3ForConditionalGeneration": False,
    "Gemma3nForCausalLM": False,
    "Gemma3nForConditionalGeneration": False,
    "Gemma4ForConditionalGeneration": True,
    "Gemma4UnifiedForConditionalGeneration": True,
    "MiniCPMForCausalLM": True,
    "MiniCPMSALAForCausalLM": True,
    "MiniCPM3ForCausalLM": True,
}

#: SGLang's Triton kernels launched with positional arguments (providers/triton_launch.py): their
#: argument lists, in order (``JITFunction.arg_names``).
_LORA_INDICES = ("seg_lens", "seg_indptr", "weight_indices", "lora_ranks")
_STRIDES = ("x_stride_0", "x_stride_1", "w_stride_0", "w_stride_1", "w_stride_2", "output_stride_0", "output_stride_1")
_ROWS_AND_TILES = ("sorted_token_ids", "SORTED_BY_ADAPTER", "BLOCK_S", "BLOCK_N", "BLOCK_K")
REQUIRED_KERNEL_ARGUMENTS = {
    TRITON_SGEMM_LORA_A_KERNEL: ("x", "weights", "output", "N", "K", "stack_num", *_STRIDES, *_LORA_INDICES,
                                 *_ROWS_AND_TILES),
    TRITON_SGEMM_LORA_B_KERNEL: ("x", "weights", "output", "N", "K", *_STRIDES, *_LORA_INDICES, *_ROWS_AND_TILES,
                                 "scalings"),
    TRITON_QKV_LORA_B_KERNEL: ("x", "weights", "output", "K", "max_qkv_out_dim", *_STRIDES, *_LORA_INDICES, "n_offs",
                               *_ROWS_AND_TILES, "scalings"),
    TRITON_GATE_UP_LORA_B_KERNEL: ("x", "weights", "output", "K", "output_dim", *_STRIDES, *_LORA_INDICES,
                                   *_ROWS_AND_TILES, "scalings"),
}

#: Source anchors: (callable, text its source must contain, why the plugin depends on it).
_TILES_WHY = "the plugin launches SGLang's Triton kernels with its wrappers' tiles (providers/triton_launch.py)"
REQUIRED_SOURCE = (
    (TRITON_SGEMM_LORA_A, "BLOCK_S = 16\n    BLOCK_K = 256\n    BLOCK_R = 16", _TILES_WHY),
    (TRITON_SGEMM_LORA_B, "BLOCK_S = 16\n    BLOCK_R = 16\n    BLOCK_N = 256", _TILES_WHY),
    (TRITON_QKV_LORA_B, "BLOCK_S = 16\n    BLOCK_R = 16\n    BLOCK_OUT = 64", _TILES_WHY),
    (TRITON_GATE_UP_LORA_B, "BLOCK_S = 16\n    BLOCK_R = 16\n    BLOCK_OUT = 64", _TILES_WHY),
    (
        PREFILL_GRAPH_RUNNER_INIT,
        "max_num_requests=",
        "prefill graph batch info must be sized by max_num_requests (no sizing patch is applied)",
    ),
    (
        POOL_LOAD_WEIGHTS,
        "target_buffer[buffer_id, : lora_rank * c, :]",
        "every provider reads stacked LoRA-A packed at stride r (the backend re-spaces shrink outputs for the native expands)",
    ),
    (
        LORA_ADAPTER_INITIALIZE_WEIGHTS,
        "self._normalize_weights()",
        "adapter checks run on the loaded tensors before SGLang normalizes them",
    ),
    (
        LORA_ADAPTER_INITIALIZE_WEIGHTS_FROM_TENSORS,
        "self._normalize_weights()",
        "adapter checks run on the loaded tensors before SGLang normalizes them",
    ),
    (
        LORA_ADAPTER_INIT,
        "self.scaling: float = self.config.lora_alpha / self.config.r",
        "adapter checks set the served scale on LoRAAdapter.scaling after construction",
    ),
    (
        LORA_MANAGER_PREPARE_LORA_BATCH,
        "scalings[weight_index] = lora.scaling",
        "each batch reads the adapter's scale from LoRAAdapter.scaling (set by the adapter checks)",
    ),
    (
        TOKENIZER_RESOLVE_LORA_PATH,
        "new_lora_ref = self.lora_ref_cache[lora_path]\n            load_result = await self.load_lora_adapter(",
        "a request loads an unregistered adapter from lora_ref_cache right where it reads it (unloads remove the name first)",
    ),
    (
        TOKENIZER_RESOLVE_LORA_PATH,
        'f"Got LoRA adapter that has never been loaded: {lora_path}\\n"',
        "SGLang's refusal of an adapter never loaded (it lists every loaded adapter) is replaced by the plugin's short one",
    ),
    (
        LORA_REGISTRY_ACQUIRE,
        'f"The following requested LoRA adapters are not loaded: {name}\\n"',
        "SGLang's refusal of an adapter not loaded (it lists every loaded adapter) is replaced by the plugin's short one",
    ),
    (
        LORA_REGISTRY_UNREGISTER,
        'f"LoRA with name {lora_name} does not exist. Loaded LoRAs: ',
        "SGLang's refusal to unload an adapter not loaded (it lists every loaded adapter) is replaced by the plugin's short one",
    ),
    (
        TOKENIZER_LOAD_LORA_ADAPTER,
        "self.lora_ref_cache[obj.lora_name] = new_adapter",
        "a load records the adapter in lora_ref_cache, where an unload removes it",
    ),
    (
        GENERATE_REQ_NORMALIZE_LORA_PATHS,
        "self.lora_path = self.lora_path * self.parallel_sample_num",
        "a batch's lora_path has one entry per prompt, repeated for the n samples (request checks)",
    ),
    (
        LORA_MANAGER_LOAD_ADAPTER,
        "self.validate_new_adapter(new_adapter, lora_ref)",
        "adapter configs are checked in validate_new_adapter before any tensor is read",
    ),
)
