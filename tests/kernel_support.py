"""The compiled kernels for tests that call them directly: built here if a compiler exists and the
build is missing, else those tests skip; and every instruction set each test should run under."""
from __future__ import annotations

import shutil

import pytest

from splitserve import kernels

ISAS = ["avx512", "avx2", "scalar"]


@pytest.fixture(scope="module")
def module():
    if kernels.load() is None:
        if shutil.which("c++") is None:
            pytest.skip("no C++ compiler here: only the torch path can run")
        from splitserve.kernels import build
        build.build()
        kernels.load.cache_clear()
    return kernels.load()


@pytest.fixture(params=ISAS)
def isa(module, request):
    used = module.set_isa(request.param)  # a CPU without AVX-512 runs the best set it has instead
    yield used
    module.set_isa("avx512")
