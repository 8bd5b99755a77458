"""Triton kernels for AdaptSpec (imported as ``adaptspec_kernels``)."""
