"""The GPU path's decisions and orderings, on CPU (cgx_ps/worker/gpu_setup.py, pipeline/cuda_streams.py,
engine shutdown): CUDA IPC only where the GPUs can map each other, the CuPy kernels compiled when
the pipeline is set up (a fake CuPy stands in for NVRTC), each codec thread's stream waiting for
the gradient before its call, and codec threads drained before the local ranks' buffers are
unmapped. What only a GPU can confirm is listed in docs/deploy.md, "GPU path: status"."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import threading
import time
import types

import pytest
import torch

from cgx_ps.kernels import Codec
from cgx_ps.kernels import cuda as cuda_codec
from cgx_ps.worker import ConfigError, WorkerConfig
from cgx_ps.worker.intranode import reduction as intranode
from cgx_ps.worker.pipeline.block_exchange import BlockExchange
from cgx_ps.worker.pipeline.cuda_streams import CodecStreams
from cgx_ps.worker.shards.engine import CommEngine
from cgx_ps.worker.gpu_setup import (TransportChoice, compile_cuda_codecs, decide_transport, kernel_devices,
                                     peer_access_table)
from cgx_ps.worker.pipeline.blocks import Compression, TensorInfo, build_layout
from cgx_ps.worker.pipeline.block_pipeline import BlockPipeline
from cgx_ps.worker.frontends.stepstats import CommSpan

GPU0, GPU1 = torch.device("cuda", 0), torch.device("cuda", 1)
CONFIG = {"CGX_PS_SERVERS": "127.0.0.1:1"}


def test_cuda_ipc_only_where_every_pair_of_gpus_has_peer_access():
    both = {(0, 1): True, (1, 0): True}
    one_way = {(0, 1): True, (1, 0): False}
    assert decide_transport("auto", GPU0, True, {}) == TransportChoice("cuda")  # one GPU: ranks share it
    assert decide_transport("auto", GPU0, True, both) == TransportChoice("cuda")
    fallback = decide_transport("auto", GPU0, True, one_way)
    assert fallback.transport == "shm"
    assert "cannot access each other's memory (cuda:1 -> cuda:0)" in fallback.warning
    assert "CGX_PS_INTRANODE=cuda" in fallback.warning  # how to insist
    no_cupy = decide_transport("auto", GPU0, False, both)
    assert no_cupy.transport == "shm" and "needs CuPy" in no_cupy.warning
    assert decide_transport("auto", torch.device("cpu"), True, both) == TransportChoice("shm")
    # the user's word: shm always; cuda even without peer access, with a warning
    assert decide_transport("shm", GPU0, True, both) == TransportChoice("shm")
    assert decide_transport("cuda", GPU0, False, both) == TransportChoice("cuda")
    risky = decide_transport("cuda", GPU0, True, one_way)
    assert risky.transport == "cuda" and "may fail at start" in risky.warning
    with pytest.raises(ConfigError, match="CGX_PS_INTRANODE=cuda needs the model on a GPU"):
        decide_transport("cuda", torch.device("cpu"), True, {})
    with pytest.raises(ConfigError, match="'nccl' is not one of auto, shm, cuda"):
        decide_transport("nccl", GPU0, True, {})
    # every ordered pair of the visible GPUs is asked
    asked = []
    table = peer_access_table(3, lambda a, b: asked.append((a, b)) or (a, b) != (2, 0))
    assert sorted(asked) == [(0, 1), (0, 2), (1, 0), (1, 2), (2, 0), (2, 1)]
    assert [pair for pair, ok in table.items() if not ok] == [(2, 0)]


def test_a_fallback_from_cuda_ipc_is_one_log_line(monkeypatch, caplog):
    monkeypatch.setattr(intranode, "peer_access_table", lambda count: {(0, 1): False, (1, 0): False})
    monkeypatch.setattr(intranode, "_cupy_importable", lambda: True)
    with caplog.at_level(logging.WARNING, logger="cgx_ps.worker.intranode.reduction"):
        assert intranode.choose_transport("auto", GPU0) == "shm"
    assert [r.getMessage().count("cuda:0 -> cuda:1, cuda:1 -> cuda:0") for r in caplog.records] == [1]


class FakeCupy(types.ModuleType):
    """What ``kernels.cuda.compile_kernels`` uses of CuPy: RawKernel(...).compile() and Device."""

    def __init__(self, error: Exception | None = None) -> None:
        super().__init__("cupy")
        self.compiled: list[tuple[int, str, tuple]] = []
        self.device: int | None = None
        fake = self

        class RawKernel:
            def __init__(self, code: str, name: str, options: tuple = ()) -> None:
                self.code, self.name, self.options = code, name, options

            def compile(self, log_stream=None) -> None:
                if error is not None:
                    raise error
                fake.compiled.append((fake.device, self.name, self.options))

        class Device:
            def __init__(self, index: int) -> None:
                self.index = index

            def __enter__(self) -> None:
                fake.device = self.index

            def __exit__(self, *exc) -> None:
                fake.device = None

        self.RawKernel = RawKernel
        self.cuda = types.SimpleNamespace(Device=Device)


@pytest.fixture
def fresh_kernels(monkeypatch):
    monkeypatch.setattr(cuda_codec.codec, "_kernels", {})  # RawKernels of the fake, not cached for later tests


def test_kernels_compile_for_every_device_that_quantizes(monkeypatch, fresh_kernels):
    cupy = FakeCupy()
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    codecs = [Codec.MAXMIN, Codec.FP32, Codec.MAXMIN, Codec.MAXMIN]
    devices = [GPU1, GPU0, torch.device("cpu"), GPU1]
    assert kernel_devices(codecs, devices) == [GPU1]  # cuda:0 only casts to fp32; the CPU has numba
    assert compile_cuda_codecs(codecs, devices) == [GPU1]
    assert cupy.compiled == [(1, name, cuda_codec.NVRTC_OPTIONS) for name in cuda_codec.KERNEL_NAMES]
    # float codecs on the GPU are torch casts: no CuPy needed at all
    monkeypatch.setitem(sys.modules, "cupy", None)
    assert compile_cuda_codecs([Codec.FP16, Codec.BF16], [GPU0, GPU0]) == []


def _pipeline_on(device: torch.device) -> None:
    """Set a pipeline up for a model on ``device`` as the optimizer and the DDP hook do (no
    shards: the kernels are compiled before anything reaches them or the device)."""
    named = [("fc.weight", TensorInfo("fc.weight", (64, 64))), ("fc.bias", TensorInfo("fc.bias", (64,)))]
    layout = build_layout([info for _, info in named], 1, Compression(), block_bytes=1 << 20)
    assert Codec.MAXMIN in {b.codec.codec for b in layout.blocks}
    BlockPipeline(layout, None, WorkerConfig.from_env(CONFIG), {name: device for name, _ in named})


def test_nvrtc_failures_fail_the_setup_not_the_first_step(monkeypatch, fresh_kernels):
    nvrtc = RuntimeError("NVRTC_ERROR_COMPILATION (6)\nmaxmin.cu(41): error: identifier \"__fadd_rn\" is undefined")
    monkeypatch.setitem(sys.modules, "cupy", FakeCupy(nvrtc))
    with pytest.raises(ConfigError, match=r"cannot be prepared on cuda:0: RuntimeError: NVRTC_ERROR_COMPILATION "
                                          r"\(6\)\nmaxmin.cu\(41\): error: identifier \"__fadd_rn\""):
        _pipeline_on(GPU0)
    monkeypatch.setitem(sys.modules, "cupy", None)  # no CuPy at all: said at setup, with what to install
    with pytest.raises(ConfigError, match=r"cuda:0: ImportError: the CUDA codecs need CuPy: pip install "
                                          r"'cgx-ps\[cuda12\]'"):
        _pipeline_on(GPU0)


def test_close_waits_for_running_codec_calls_and_drops_queued_ones():
    """shutdown() unmaps the local ranks' buffers right after closing the engine: a codec call
    still reading one then would fault, so close() returns only once the running call is done."""
    engine = CommEngine(WorkerConfig.from_env(CONFIG), node_id="n0", num_nodes=1, codec_threads=1)
    started, finished, queued_ran = threading.Event(), threading.Event(), threading.Event()

    def running() -> None:
        started.set()
        time.sleep(0.3)
        finished.set()

    engine.submit(engine.in_thread(running))
    engine.submit(engine.in_thread(queued_ran.set))  # behind it on the one codec thread
    assert started.wait(10)
    engine.close()
    assert finished.is_set()
    time.sleep(0.05)
    assert not queued_ran.is_set()


def test_a_cuda_blocks_codec_calls_run_on_their_threads_stream_after_the_gradient():
    """Each codec thread has its own stream per device, which waits (on the GPU) for the event the
    training thread recorded after writing the block, then runs the call: no host wait for
    backward. CPU blocks' calls are passed through untouched. Fakes stand in for torch's streams."""
    events: list[tuple] = []

    class FakeStream:
        def __init__(self, device: torch.device) -> None:
            self.device, self.thread = device, threading.current_thread().name
            events.append(("new", self.thread, device))

        def wait_event(self, event) -> None:
            events.append(("wait", self, event))

    @contextlib.contextmanager
    def use(stream):
        events.append(("enter", stream))
        yield
        events.append(("exit", stream))

    streams = CodecStreams(FakeStream, use)
    encode = lambda x: events.append(("encode", x)) or 2 * x  # noqa: E731

    assert streams.wrap(encode, torch.device("cpu"), "ready") is encode
    assert streams.wrap(encode, GPU0, "ready")(21) == 42
    s0 = streams.stream(GPU0)
    assert events == [("new", threading.current_thread().name, GPU0), ("enter", s0), ("wait", s0, "ready"),
                      ("encode", 21), ("exit", s0)]
    events.clear()
    assert streams.wrap(encode, GPU0, None)(1) == 2  # the same stream again; nothing to wait for
    assert events == [("enter", s0), ("encode", 1), ("exit", s0)]
    other = []
    worker = threading.Thread(target=lambda: other.append(streams.stream(GPU0)), name="cgx-codec_1")
    worker.start()
    worker.join()
    assert other[0] is not s0 and other[0].thread == "cgx-codec_1"  # one stream per thread
    assert streams.stream(GPU1) is not s0  # and per device

    # BlockExchange hands a CUDA block's calls to the engine wrapped, a CPU block's as they are
    class Engine:
        async def in_thread(self, fn, *args):
            return fn(*args)

    engine = Engine()
    exchange = BlockExchange(engine, None, WorkerConfig.from_env(CONFIG), CommSpan(), False, streams)
    assert exchange._codec_calls(torch.device("cpu"), None) == engine.in_thread
    events.clear()
    assert asyncio.run(exchange._codec_calls(GPU0, "ready")(encode, 5)) == 10
    assert events == [("enter", s0), ("wait", s0, "ready"), ("encode", 5), ("exit", s0)]


def test_a_peer_buffer_that_is_a_copy_and_not_a_view_of_the_mapping_is_refused():
    """GPU-REVIEW item 2: ``torch.as_tensor`` on a peer's IPC mapping may copy instead of view
    (stale sums, silently). The check compares address and device (CPU tensors stand in)."""
    from cgx_ps.worker.intranode.cuda_ipc import _check_mapped
    from cgx_ps.worker.errors import IntraNodeError

    mapping = torch.zeros(16)
    _check_mapped(mapping[4:], mapping.data_ptr() + 16, torch.device("cpu"))  # a view at the offset
    with pytest.raises(IntraNodeError, match=r"came back as a copy .* CGX_PS_INTRANODE=shm"):
        _check_mapped(mapping[4:].clone(), mapping.data_ptr() + 16, torch.device("cpu"))
    with pytest.raises(IntraNodeError, match=r"instead of a view of the mapping \(cuda:0"):
        _check_mapped(mapping[4:], mapping.data_ptr() + 16, GPU0)


def test_close_at_interpreter_exit_where_no_thread_can_be_started_still_closes(monkeypatch):
    """runtime.py closes the engine from an atexit handler; Python 3.12.0-3.12.1 refuse a new
    thread there (RuntimeError: can't create new thread at interpreter shutdown), which the drain's
    helper thread needs. close() must not raise then (shutdown() would skip unmapping the local
    ranks' buffers and writing the timeline), and must still shut the codec threads down."""
    engine = CommEngine(WorkerConfig.from_env(CONFIG), node_id="n0", num_nodes=1, codec_threads=1)
    ran = engine.submit(engine.in_thread(lambda: "ran")).result(10)
    closed = threading.Event()
    engine.when_closed(closed.set)

    def refused(self) -> None:
        raise RuntimeError("can't create new thread at interpreter shutdown")

    monkeypatch.setattr(threading.Thread, "start", refused)
    engine.close()
    monkeypatch.undo()
    assert ran == "ran" and closed.is_set()
    with pytest.raises(RuntimeError, match="after shutdown"):
        engine.executor.submit(print)
