import pytest
import torch


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Every test compiles from scratch: no cache entry or counter leaks between tests."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    yield
    torch._dynamo.reset()
