"""The codecs on CUDA tensors: CuPy kernels (codec.py) of the CUDA C in maxmin.cu, with the
checks and arguments of each launch (launch.py). Imports without CuPy or a GPU."""

from .codec import (CUDA_SOURCE, KERNEL_NAMES, NVRTC_OPTIONS, compile_kernels, decode, decode_maxmin_async, encode,
                    encode_maxmin_async, to_host)
from .launch import BLOCK, check_decode_launch, check_encode_launch, decode_args, encode_args, threads_per_bucket

__all__ = [
    "BLOCK",
    "CUDA_SOURCE",
    "KERNEL_NAMES",
    "NVRTC_OPTIONS",
    "check_decode_launch",
    "check_encode_launch",
    "compile_kernels",
    "decode",
    "decode_args",
    "decode_maxmin_async",
    "encode",
    "encode_args",
    "encode_maxmin_async",
    "threads_per_bucket",
    "to_host",
]
