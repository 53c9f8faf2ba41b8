"""Python faces of the C++/CUDA kernels in ``csrc/``.

One module per op family (``attention``, ``comm``); each loads its extension through
``_build.load_extension`` and falls back to plain PyTorch when it cannot be built.
"""
