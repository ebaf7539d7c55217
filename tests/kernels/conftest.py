"""Without CUDA, the Triton kernels run on CPU tensors under Triton's interpreter. Triton reads
the variable when a kernel is decorated, so it is set here, before any test module of this
folder imports one. (`test_triton_sm90.py` compiles in a subprocess without it.)"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
