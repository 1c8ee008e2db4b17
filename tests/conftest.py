"""Test-wide settings.

Tiny models run fastest on one intra-op thread: with two OpenMP threads on a
busy 2-core machine, every small matmul pays a thread barrier (measured: about
1000x slower for a [8x32]x[32x64] product under load).
"""

import torch

torch.set_num_threads(1)
