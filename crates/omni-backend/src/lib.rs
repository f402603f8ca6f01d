//! Tensors and ops: the CPU backend (and later CUDA).
