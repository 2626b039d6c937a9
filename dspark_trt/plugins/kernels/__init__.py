"""Triton kernels of the ``dspark`` ops, one module per op, plus their launchers.

Import this package only where Triton is installed (``HAVE_TRITON`` in ``..dispatch`` says so).
Every launcher takes torch tensors on one device: CUDA tensors on a GPU, or CPU tensors under
``TRITON_INTERPRET=1`` (how CI tests the kernels). The ops themselves send CPU tensors to the
PyTorch reference instead (see ``..dispatch``).
"""
