"""Generation engines the agent samples with: transformers with the engine's own KV cache (`hf`), vLLM
(`vllm`), and the colocated vLLM engine's weight sync during training."""
