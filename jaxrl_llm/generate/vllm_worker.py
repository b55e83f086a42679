"""Methods mixed into vLLM's worker (`LLM(worker_extension_cls=...)`), called by name through
`LLM.collective_rpc`; they run inside vLLM's worker processes. Imported by vLLM, not by this
package."""

from __future__ import annotations


class PolicyReload:
    """Swap a new export's weights into the running engine."""

    def reload_policy(self, weights_path: str) -> None:
        """vLLM's in-place `reload_weights`, then (CPU) the tied output projection repacked.

        vLLM-CPU multiplies by a packed copy of each linear weight made when the model loads
        (oneDNN / sgl kernels). The in-place reload re-packs every layer whose weights are in
        the checkpoint, but a tied `lm_head` has none of its own (its weight is the embedding's),
        so it kept multiplying by π_0's embedding: its packed copy is rebuilt here from the
        reloaded weight. (Measured on vLLM-CPU 0.32: without this, log-probs after a reload
        differed from a fresh engine's on the same export by ~0.01 nats per token.)
        """
        self.reload_weights(weights_path=weights_path)  # type: ignore[attr-defined]
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return
        for module in self.model_runner.get_model().modules():  # type: ignore[attr-defined]
            weight = getattr(module, "weight", None)
            if hasattr(module, "cpu_linear") and weight is not None and weight.ndim == 2 \
                    and weight.numel() > 0:
                dispatch_cpu_unquantized_gemm(module, remove_weight=False)
