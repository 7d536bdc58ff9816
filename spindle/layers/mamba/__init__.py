"""State-space (Mamba2) layers: the mixer, its torch ops and its Triton kernels."""
