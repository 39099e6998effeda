"""Every SGLang symbol sglang-xpu-lora imports, patches or relies on, spelled once.

:func:`sglang_xpu_lora.upstream.compat.check_host` resolves each entry (and the parameters listed in
:data:`REQUIRED_PARAMETERS`) against the installed SGLang before anything is registered, so a moved
symbol is reported by name instead of failing deep inside a hook.
"""

from __future__ import annotations

# Registries and CLI.
LORA_BACKEND_REGISTRY = "sglang.srt.lora.backend.lora_registry.LORA_SUPPORTED_BACKENDS"
REGISTER_LORA_BACKEND = "sglang.srt.lora.backend.lora_registry.register_lora_backend"
SERVER_ARGS = "sglang.srt.server_args.ServerArgs"
SERVER_ARGS_FIELD_ARG = "sglang.srt.arg_groups.arg_utils.Arg"

# Hook targets (HookRegistry paths).
CHECK_LORA_SERVER_ARGS = "sglang.srt.arg_groups.lora_hook.check_lora_server_args"
RESOLVING_VIEW = "sglang.srt.arg_groups.overrides.resolving_view"
LORA_MANAGER_INIT_MEMORY_POOL = "sglang.srt.lora.lora_manager.LoRAManager.init_memory_pool"
POOL_LOAD_WEIGHTS = "sglang.srt.lora.mem_pool.LoRAMemoryPool.load_lora_weight_to_buffer"
POOL_CLEAR_SLOT = "sglang.srt.lora.mem_pool.LoRAMemoryPool._clear_buffer_slot_for_base"
POOL_IS_MOE_MODULE = "sglang.srt.lora.mem_pool.LoRAMemoryPool.is_moe_module"
GET_STACKED_MULTIPLY = "sglang.srt.lora.utils.get_stacked_multiply"

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
VOCAB_PARALLEL_EMBEDDING = "sglang.srt.layers.vocab_parallel_embedding.VocabParallelEmbedding"
PARALLEL_LM_HEAD = "sglang.srt.layers.vocab_parallel_embedding.ParallelLMHead"

# The parent backend and what it reuses.
TRITON_BACKEND = "sglang.srt.lora.backend.triton_backend.TritonLoRABackend"
TRITON_PREPARE_LORA_BATCH = TRITON_BACKEND + ".prepare_lora_batch"
TRITON_SGEMM_INFO = TRITON_BACKEND + "._sgemm_info"
TRITON_INIT_PREFILL_GRAPH_INFO = TRITON_BACKEND + ".init_prefill_cuda_graph_batch_info"
TRITON_INIT_DECODE_GRAPH_INFO = TRITON_BACKEND + ".init_decode_cuda_graph_batch_info"
LORA_BATCH_INFO = "sglang.srt.lora.utils.LoRABatchInfo"
# SGLang's Triton LoRA kernels, called by the triton provider (providers/triton_ops.py); the parent
# backend's module imports them already, so resolving them imports nothing more.
_TRITON_DENSE = "sglang.kernels.ops.lora.dense."
TRITON_EMBEDDING_LORA_A = _TRITON_DENSE + "embedding_lora_a.embedding_lora_a_fwd"
TRITON_SGEMM_LORA_A = _TRITON_DENSE + "sgemm_lora_a.sgemm_lora_a_fwd"
TRITON_SGEMM_LORA_B = _TRITON_DENSE + "sgemm_lora_b.sgemm_lora_b_fwd"
TRITON_QKV_LORA_B = _TRITON_DENSE + "qkv_lora_b.qkv_lora_b_fwd"
TRITON_GATE_UP_LORA_B = _TRITON_DENSE + "gate_up_lora_b.gate_up_lora_b_fwd"
FUSED_MOE = "sglang.srt.layers.moe.fused_moe_triton.layer.FusedMoE"  # LoRA on it runs outside the backend
LORA_BATCH_LAYOUT = "sglang.srt.runtime_context.LoRABatchLayout"
PREFILL_GRAPH_RUNNER_INIT = (
    "sglang.srt.model_executor.runner.prefill_cuda_graph_runner.PrefillCudaGraphRunner.__init__"
)

# Plugin machinery.
HOOK_REGISTRY = "sglang.srt.plugins.hook_registry.HookRegistry"
HOOK_TYPE = "sglang.srt.plugins.hook_registry.HookType"

ALL = (
    LORA_BACKEND_REGISTRY,
    REGISTER_LORA_BACKEND,
    SERVER_ARGS,
    SERVER_ARGS_FIELD_ARG,
    CHECK_LORA_SERVER_ARGS,
    RESOLVING_VIEW,
    LORA_MANAGER_INIT_MEMORY_POOL,
    POOL_LOAD_WEIGHTS,
    POOL_CLEAR_SLOT,
    POOL_IS_MOE_MODULE,
    GET_STACKED_MULTIPLY,
    LORA_MANAGER_VALIDATE_NEW_ADAPTER,
    LORA_MANAGER_LOAD_ADAPTER,
    LORA_MANAGER_LOAD_ADAPTER_FROM_TENSORS,
    LORA_MANAGER_PREPARE_LORA_BATCH,
    LORA_ADAPTER_INIT,
    LORA_ADAPTER_INITIALIZE_WEIGHTS,
    LORA_ADAPTER_INITIALIZE_WEIGHTS_FROM_TENSORS,
    LORA_ADAPTER_NORMALIZE_WEIGHTS,
    GET_LORA,
    VOCAB_PARALLEL_EMBEDDING,
    PARALLEL_LM_HEAD,
    TRITON_BACKEND,
    TRITON_PREPARE_LORA_BATCH,
    TRITON_SGEMM_INFO,
    TRITON_INIT_PREFILL_GRAPH_INFO,
    TRITON_INIT_DECODE_GRAPH_INFO,
    LORA_BATCH_INFO,
    TRITON_EMBEDDING_LORA_A,
    TRITON_SGEMM_LORA_A,
    TRITON_SGEMM_LORA_B,
    TRITON_QKV_LORA_B,
    TRITON_GATE_UP_LORA_B,
    FUSED_MOE,
    LORA_BATCH_LAYOUT,
    PREFILL_GRAPH_RUNNER_INIT,
    HOOK_REGISTRY,
    HOOK_TYPE,
)

#: Callables whose parameters the plugin passes or receives by name.
REQUIRED_PARAMETERS = {
    POOL_LOAD_WEIGHTS: ("uid", "buffer_id", "lora_adapter"),
    TRITON_INIT_PREFILL_GRAPH_INFO: ("max_num_tokens", "max_num_requests"),
    TRITON_INIT_DECODE_GRAPH_INFO: ("max_bs_in_cuda_graph", "num_tokens_per_req"),
    TRITON_PREPARE_LORA_BATCH: ("forward_batch", "weight_indices", "lora_ranks", "scalings", "use_prefill_cuda_graph"),
    TRITON_SGEMM_INFO: ("pruned_batch_info",),
    # The triton provider passes these in this order (positional up to base_output) or by name.
    TRITON_EMBEDDING_LORA_A: ("input_ids", "weights", "batch_info", "vocab_size", "extra_embeddings"),
    TRITON_SGEMM_LORA_A: ("x", "weights", "batch_info", "stack_num"),
    TRITON_SGEMM_LORA_B: ("x", "weights", "batch_info", "base_output"),
    TRITON_QKV_LORA_B: ("x", "qkv_lora_b", "batch_info", "output_offset", "max_qkv_out_dim", "base_output", "n_slices"),
    TRITON_GATE_UP_LORA_B: ("x", "gate_up_lora_b", "batch_info", "output_dim", "base_output"),
    LORA_MANAGER_VALIDATE_NEW_ADAPTER: ("lora_config", "lora_ref"),
    LORA_MANAGER_LOAD_ADAPTER: ("lora_ref",),
    LORA_MANAGER_LOAD_ADAPTER_FROM_TENSORS: ("lora_ref", "tensors", "config_dict"),
}

#: Source anchors: (callable, text its source must contain, why the plugin depends on it).
REQUIRED_SOURCE = (
    (
        PREFILL_GRAPH_RUNNER_INIT,
        "max_num_requests=",
        "prefill graph batch info must be sized by max_num_requests (no sizing patch is applied)",
    ),
    (
        POOL_LOAD_WEIGHTS,
        "target_buffer[buffer_id, : lora_rank * c, :]",
        "the pool patch re-spaces stacked LoRA-A that SGLang writes packed at stride r",
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
        LORA_MANAGER_LOAD_ADAPTER,
        "self.validate_new_adapter(new_adapter, lora_ref)",
        "adapter configs are checked in validate_new_adapter before any tensor is read",
    ),
)
