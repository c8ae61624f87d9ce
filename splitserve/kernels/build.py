"""Compile the kernels' C++ sources into splitserve/kernels/_build (git-ignored). Run by `make setup`;
a machine without a C++ compiler skips it and the engine uses the pure-torch fallback."""
from __future__ import annotations

import shutil
import sys

from splitserve import kernels


def build() -> str:
    from torch.utils.cpp_extension import load

    kernels.BUILD_DIR.mkdir(exist_ok=True)
    module = load(name=kernels.NAME, sources=[str(s) for s in kernels.SOURCES], extra_cflags=kernels.CFLAGS,
                  extra_ldflags=kernels.LDFLAGS,
                  build_directory=str(kernels.BUILD_DIR), verbose=False)
    return module.isa()


def main() -> int:
    if shutil.which("c++") is None and shutil.which("g++") is None:
        print("no C++ compiler: GGUF kernels not built; the engine uses its pure-torch fallback")
        return 0
    print(f"GGUF kernels built in {kernels.BUILD_DIR} (instruction set in use: {build()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
