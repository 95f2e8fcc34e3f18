"""roll's methods inside vLLM's worker processes (vLLM's `worker_extension_cls`, as OpenRLHF and verl extend it).

vLLM mixes this class into its worker class in every worker process (one per device under tensor parallel; on a
GPU those processes are not the adapter's), so `LLM.collective_rpc("roll_...")` runs these methods where the
model lives. Arguments and results cross as msgpack: plain strings and numbers only.
"""

from __future__ import annotations

from typing import Any

from roll_engines.infer._bucket_channel import receive_buckets


class RollWorkerExtension:
    """Methods vLLM adds to its worker (names prefixed `roll_`: vLLM refuses an extension that shadows its own)."""

    def roll_load_weights(self, address: str, authkey_hex: str) -> int:
        """Reload the model's weights from the buckets one sync streams through `address`; tensors received.

        One `reload_weights` call spans every bucket of the sync (vLLM's layer-wise reload processes a layer, e.g.
        repacks its fused q/k/v weight on CPU, once all its parts have arrived, whichever bucket carried them)."""
        count = 0
        stream = receive_buckets(address, bytes.fromhex(authkey_hex))

        def counted() -> Any:
            nonlocal count
            for item in stream:
                count += 1
                yield item

        try:
            self.reload_weights(weights_iterator=counted())  # type: ignore[attr-defined]
            for _ in stream:  # what the loader left unread: acknowledge it so the sender finishes the sync
                count += 1
        finally:
            stream.close()
        self._roll_refresh_tied_heads()
        self._roll_repack_cpu_experts()
        return count

    def _roll_repack_cpu_experts(self) -> None:
        """Repack MoE experts' weights for vLLM-CPU's grouped GEMM after a reload.

        vLLM 0.32 prepacks `w13_weight`/`w2_weight` at load (`fused_experts.process_weights_after_loading`) but skips
        that step on a weight update (`UnquantizedFusedMoEMethod`: on a GPU, CUDA graphs hold the parameters'
        addresses), so on CPU the reloaded experts held the trainer's plain layout while the kernel read them as
        packed: after any sync, even of unchanged weights, a Qwen3-MoE generated other tokens. CPU only: the GPU
        kernels read the layout the update writes."""
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return
        for module in self.model_runner.model.modules():  # type: ignore[attr-defined]
            kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
            experts = getattr(kernel, "fused_experts", None)
            if experts is not None and hasattr(module, "w13_weight"):
                experts.process_weights_after_loading(module)

    def _roll_refresh_tied_heads(self) -> None:
        """Rebuild the kernels of an LM head tied to the input embeddings from the weights just loaded.

        A tied head receives nothing in a sync (the trainer sends the shared tensor once, under the embedding's
        name, and vLLM's loaders skip `lm_head` when tied): the reload puts the head's shared weight back, now
        holding the new values, but never re-runs its post-load processing, and on CPU that processing packed a
        separate copy of the weight for the head's product (vLLM 0.32 `dispatch_cpu_unquantized_gemm`). Without
        this the head samples from the weights the engine was loaded with (measured: log-prob gap 1.9)."""
        from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

        model = self.model_runner.model  # type: ignore[attr-defined]
        modules = list(model.modules())
        embeddings = {
            m.weight.data_ptr()
            for m in modules
            if type(m) is VocabParallelEmbedding and getattr(m, "weight", None) is not None
        }
        for head in modules:
            if isinstance(head, ParallelLMHead) and head.weight.numel() and head.weight.data_ptr() in embeddings:
                head.quant_method.process_weights_after_loading(head)

    def roll_weight_dtypes(self) -> dict[str, str]:
        """Parameters kept wider than the model's dtype, by name (vLLM keeps a DeepSeek-V3 or GLM-4.5 router and its
        expert bias in fp32 under bf16): the trainer sends those in that dtype (roll_core.cluster.weight_sync)."""
        runner = self.model_runner  # type: ignore[attr-defined]
        size = runner.model_config.dtype.itemsize
        return {
            name: str(p.dtype).removeprefix("torch.")
            for name, p in runner.model.named_parameters()
            if p.is_floating_point() and p.element_size() > size
        }

    def roll_model_bytes(self) -> int:
        """Bytes of this worker's model as vLLM measured it at load (repacked CPU weights included)."""
        runner = self.model_runner  # type: ignore[attr-defined]
        measured = int(getattr(runner, "model_memory_usage", 0) or 0)
        if measured:
            return measured
        return sum(p.numel() * p.element_size() for p in runner.model.parameters())

    def roll_moe_layers(self) -> list[int]:
        """Decoder-layer numbers of the model's MoE layers, ascending: the columns of vLLM's routed-experts rows
        that hold routing (a dense layer's column is never written; roll_engines.infer._vllm_routing)."""
        from vllm.model_executor.layers.fused_moe.layer import MoERunner
        from vllm.model_executor.layers.fused_moe.routed_experts_capturer import RoutedExpertsCaptureSource

        model = self.model_runner.model  # type: ignore[attr-defined]
        # The modules vLLM binds its capturer to (bind_routed_experts_capturer), by the same tests.
        sources = (MoERunner, RoutedExpertsCaptureSource)
        return sorted({int(m.layer_id) for m in model.modules() if isinstance(m, sources)})
