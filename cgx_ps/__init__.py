"""cgx-ps: a gRPC parameter server with compressed push/pull for data-parallel PyTorch training.

Where things happen:
    cgx_ps/kernels  compression: the wire format and its codecs (CPU, CUDA, reference)
    cgx_ps/v1       the protocol (generated from protos/cgx_ps/v1/ps.proto)
    cgx_ps/server   summation: one shard per process aggregates compressed blocks
    cgx_ps/worker   where gradients enter: the PyTorch client library
"""

__version__ = "0.1.0"
__all__ = ["__version__"]
