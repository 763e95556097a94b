"""A GPU's memory arithmetic: the caching allocator's blocks and segments, cuBLAS's workspace
per stream, and the CUDA context, which no stage is charged for."""

from __future__ import annotations


# A GPU's caching allocator (PyTorch's CUDACachingAllocator): every block rounds up to 512
# bytes (what `torch.cuda.memory_allocated` counts); blocks are cut from segments the allocator
# reserves from the driver: 2 MiB ones for requests up to 1 MiB, 20 MiB ones up to 10 MiB, and
# larger requests rounded up to 2 MiB (what `torch.cuda.memory_reserved` counts).
GPU_BLOCK_BYTES = 512
GPU_SMALL_BYTES = 1 << 20
GPU_SMALL_SEGMENT_BYTES = 2 << 20
GPU_MID_BYTES = 10 << 20
GPU_MID_SEGMENT_BYTES = 20 << 20
GPU_LARGE_ROUND_BYTES = 2 << 20
# cuBLAS's workspace, one per (handle, stream), so one per GPU stage: PyTorch's default
# CUBLAS_WORKSPACE_CONFIG is ":4096:8" on Hopper (8 x 4 MiB), ":4096:2:16:8" before it.
CUBLAS_WORKSPACE_BYTES = {"hopper": 32 << 20, "older": (2 << 22) + (8 << 14)}
# What a process's CUDA context takes on each GPU it uses, outside PyTorch's allocator (its
# kernels and cuBLAS/cuDNN handles; about 0.5 GB with CUDA 12): not in a stage's memory, not
# charged against `DeviceSpec.memory_bytes` (a GPU's budget is what is free once it exists).
CUDA_CONTEXT_BYTES = 512 << 20


def gpu_block_bytes(nbytes: int) -> int:
    """The bytes the caching allocator hands out for a tensor of `nbytes`: 512-byte blocks."""
    if nbytes <= 0:
        return 0
    return -(-nbytes // GPU_BLOCK_BYTES) * GPU_BLOCK_BYTES


def gpu_segment_bytes(nbytes: int) -> int:
    """The segment the caching allocator reserves from the driver when no cached one has room
    for a tensor of `nbytes`: 2 MiB up to 1 MiB, 20 MiB up to 10 MiB, else the block rounded up
    to 2 MiB."""
    block = gpu_block_bytes(nbytes)
    if block == 0:
        return 0
    if block <= GPU_SMALL_BYTES:
        return GPU_SMALL_SEGMENT_BYTES
    if block < GPU_MID_BYTES:
        return GPU_MID_SEGMENT_BYTES
    return -(-block // GPU_LARGE_ROUND_BYTES) * GPU_LARGE_ROUND_BYTES


def cublas_workspace_bytes(capability: tuple[int, int] | None) -> int:
    """cuBLAS's workspace per stream on a GPU of compute capability `capability` (None:
    unknown, priced as Hopper's, the larger)."""
    return CUBLAS_WORKSPACE_BYTES["hopper" if capability is None or capability[0] >= 9
                                  else "older"]
