"""Torch building blocks the models share: linear layers and their GEMM kernels
(`linear`), fused elementwise ops over the C kernels (`fused`), RoPE (`rope`)."""
