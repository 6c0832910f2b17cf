"""The two modes every graphed-callable behaviour test runs in: emulated on the CPU, and a real GPU."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from gradsafe.testing import emulate_cuda_graphs


@pytest.fixture(params=["emulated", pytest.param("cuda", marks=pytest.mark.cuda)])
def graph_device(request: pytest.FixtureRequest) -> Iterator[torch.device]:
    """The device graphs run on: ``cuda`` (real graphs), or the CPU under ``emulate_cuda_graphs()``."""
    torch.manual_seed(0)
    if request.param == "cuda":
        yield torch.device("cuda")
        torch.cuda.synchronize()
    else:
        with emulate_cuda_graphs():
            yield torch.device("cpu")
