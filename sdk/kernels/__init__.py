"""Triton kernels, one file per op (reference pointer, kernels, launchers); imported lazily by shardkit.ops.

On CPU tensors they run only under TRITON_INTERPRET=1, which must be set before a module here is imported.
"""
