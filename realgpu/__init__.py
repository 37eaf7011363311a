"""Run poollab policies as real GPU memory pools (CuPy), and measure the allocators people use."""
