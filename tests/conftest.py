import pytest
import torch


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the groups (plugins registered later run first)
def pytest_collection_modifyitems(config, items):
    """Groups for `pytest -n 2 --dist loadgroup` (the README's test command; pytest-xdist): a file's tests on one
    worker (its module fixtures are built once), every `gpu` test on one worker (one GPU), every `slurm` test on
    one (one test cluster). `gpu` tests need CUDA: skip them (with the reason) on CPU machines."""
    for item in items:
        group = "gpu" if "gpu" in item.keywords else "slurm" if "slurm" in item.keywords else item.path.name
        item.add_marker(pytest.mark.xdist_group(group))
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
