import pytest
import torch


def pytest_collection_modifyitems(config, items):
    """`gpu` tests need CUDA: skip them (with the reason) on CPU machines."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (runs when a GPU machine is available)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_lm():
    """A random-init tiny Qwen2 (the Qwen2.5 architecture) in fp32: exactness needs no training."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                      tie_word_embeddings=False, use_sliding_window=False)
    return Qwen2ForCausalLM(cfg).eval()
