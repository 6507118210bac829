"""GPU kernels for dcp-ref, installed as ``dcp_ref.kernels`` (this folder is mapped by setuptools).

Modules here import Triton / CuTeDSL / FlashMLA / FlashInfer lazily or at their own import time; importing
:mod:`dcp_ref` never imports this package's heavy dependencies. The plain-PyTorch reference in
:mod:`dcp_ref` is the oracle every kernel is tested against.

On a machine without a GPU, Triton kernels run under the interpreter: set
``TRITON_INTERPRET=1`` *before* importing a kernel module (``@triton.jit`` reads it then), and
pass CPU tensors. CuTeDSL kernels compile to sm_90a PTX with ``CUTE_DSL_ARCH=sm_90a`` but can
only be launched on a GPU.
"""
