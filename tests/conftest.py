import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (gpu marker): no CUDA device here")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
