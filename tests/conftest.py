import os

# Tiny models decode faster on one thread, and the suite's subprocesses (CLI, server) inherit
# this: with two cores shared by pytest and a server, OpenMP spin-waiting costs 10-20x.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

# Without CUDA the Triton kernels are tested in Triton's interpreter; it must be chosen before
# Triton is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (gpu marker): no CUDA device here")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
