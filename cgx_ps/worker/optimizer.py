"""Where gradients enter cgx-ps: a drop-in DistributedOptimizer (in the spirit of Horovod).

    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                               named_parameters=model.named_parameters(), compression="4bit")
    loss.backward(); opt.step()

A post-accumulate-grad hook on every parameter marks it ready as backward produces it; once all
parameters of a block are ready the block is copied into a flat float32 buffer and handed to the
communication thread (encode, push, pull, decode), while backward goes on. ``step()`` waits only
for blocks still in flight, writes the averaged gradients back into ``.grad`` and steps the
wrapped optimizer. Every worker decodes the same aggregate bytes, so replicas stay bit-identical.

For gradient clipping after synchronization (Horovod style)::

    opt.synchronize()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    with opt.skip_synchronize():
        opt.step()
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import zlib
from dataclasses import dataclass, field
from typing import Iterable, Iterator

import torch

from ..kernels import Codec, CodecError, ErrorFeedback, dequantize, encode_block
from ..layout import codec_of
from ..v1 import ps_pb2
from .errors import CgxPsError, ConfigError
from .autotune import Tuner
from .intranode import NodeReducer
from .layout import DEFAULT_BLOCK_BYTES, Compression, TensorInfo, build_layout
from .runtime import engine_for_layout

__all__ = ["DistributedOptimizer", "StepStats"]


@dataclass
class StepStats:
    """What the last synchronized step sent, and how long it waited for communication."""

    step: int = 0
    bytes_pushed: int = 0  # compressed bytes this process pushed (its share of the node's blocks)
    fp32_bytes: int = 0  # what the same blocks weigh uncompressed
    exposed_comm_s: float = 0.0  # time synchronize() blocked waiting for blocks in flight
    compressed: bool = True  # False during warm-up steps

    @property
    def ratio(self) -> float:
        return self.fp32_bytes / self.bytes_pushed if self.bytes_pushed else 0.0


@dataclass(eq=False)
class _Block:
    spec: ps_pb2.BlockSpec
    segments: list[tuple[torch.nn.Parameter, int, int, int]]  # (param, param offset, buffer offset, n)
    buffer: torch.Tensor
    pending: int = 0  # parameters of this block not yet ready in this step
    round: int = 0
    future: object | None = None
    feedback: ErrorFeedback = field(default_factory=ErrorFeedback)  # worker-side error feedback
    settings: ps_pb2.CodecSettings | None = None  # current codec settings (adaptive may change them)

    def __post_init__(self) -> None:
        if self.settings is None:
            self.settings = self.spec.codec


class _DistributedMixin:
    """Mixed into a dynamic subclass of the wrapped optimizer's class (so LR schedulers and
    ``isinstance(opt, torch.optim.SGD)`` keep working)."""

    def _cgx_setup(self, named_parameters: list[tuple[str, torch.nn.Parameter]], compression: Compression,
                   backward_passes_per_step: int, error_feedback: bool, warmup_steps: int, block_bytes: int) -> None:
        for name, value, least in [("backward_passes_per_step", backward_passes_per_step, 1),
                                   ("warmup_steps", warmup_steps, 0), ("block_bytes", block_bytes, 4)]:
            if not isinstance(value, int) or value < least:
                raise ConfigError(f"{name} must be an integer >= {least}, got {value!r}")
        names = [n for n, _ in named_parameters]
        if len(set(names)) != len(names):
            raise ConfigError("named_parameters has duplicate names")
        if len({id(p) for _, p in named_parameters}) != len(names):  # its gradient would count twice
            raise ConfigError("named_parameters names one tensor twice (tied weights: name it once)")
        opt_params = {id(p) for g in self.param_groups for p in g["params"]}
        missing = [n for n, p in named_parameters if id(p) not in opt_params]
        if missing:
            raise ConfigError(f"named_parameters holds tensors the optimizer does not: {missing[:3]}")
        named_ids = {id(p) for _, p in named_parameters}
        all_params = [p for g in self.param_groups for p in g["params"]]
        unnamed = sum(1 for p in all_params if p.requires_grad and id(p) not in named_ids)
        if unnamed:  # they would train on each rank's own gradient: replicas would drift apart
            raise ConfigError(f"the optimizer holds {unnamed} trainable tensor(s) not in named_parameters: "
                              f"pass every parameter the optimizer updates (e.g. model.named_parameters())")
        # frozen when wrapped: not synchronized, so they must stay without gradients (checked per step)
        self._cgx_frozen = [p for p in all_params if id(p) not in named_ids]
        params = dict(named_parameters)
        self._cgx_params = params
        self._cgx_name_of = {id(p): n for n, p in named_parameters}
        self._cgx_layout = build_layout([TensorInfo.of(n, p) for n, p in named_parameters],
                                        _num_shards(), compression, block_bytes)
        self._cgx_engine, self._cgx_config = engine_for_layout(self._cgx_layout)
        config = self._cgx_config
        self._cgx_reducer = None
        if config.local_world_size > 1:  # ranks of this node reduce among themselves first
            devices = {p.device for p in params.values()}
            # one GPU: CUDA IPC (unless CGX_PS_INTRANODE=shm); several devices: host shared memory
            device, transport = next(iter(devices)), config.intranode
            if len(devices) > 1:
                if transport == "cuda":
                    raise ConfigError(f"CGX_PS_INTRANODE=cuda needs the model on one GPU, it spans {sorted(map(str, devices))}")
                device, transport = torch.device("cpu"), "shm"
            self._cgx_reducer = NodeReducer(self._cgx_layout, config.local_rank, config.local_world_size,
                                            config.node_rank, config.job_id or os.environ.get("TORCHELASTIC_RUN_ID", ""),
                                            timeout_s=self._cgx_engine.round_timeout_s, device=device,
                                            transport=transport, run_tag=self._cgx_engine.session_id)
        self._cgx_backward_passes = backward_passes_per_step
        self._cgx_error_feedback = error_feedback
        self._cgx_warmup = warmup_steps
        self._cgx_lock = threading.Lock()
        self._cgx_synchronized = False
        self._cgx_skip = False
        self._cgx_step = 0
        self._cgx_stats = StepStats()
        self._cgx_blocks: list[_Block] = []
        self._cgx_blocks_of: dict[int, list[_Block]] = {}
        self._cgx_passes: dict[int, int] = {}
        tensors = self._cgx_layout.tensors
        for spec in self._cgx_layout.blocks:
            device = params[tensors[spec.segments[0].tensor_index].name].device
            if self._cgx_reducer is not None:  # in the node's shared memory or our IPC-exported GPU buffer
                buffer = self._cgx_reducer.buffer(spec.block_id)
            else:
                buffer = torch.zeros(spec.numel, dtype=torch.float32, device=device)
            block = _Block(spec, [], buffer)
            at = 0
            for seg in spec.segments:
                param = params[tensors[seg.tensor_index].name]
                block.segments.append((param, seg.offset, at, seg.numel))
                self._cgx_blocks_of.setdefault(id(param), []).append(block)
                at += seg.numel
            self._cgx_blocks.append(block)
        self._cgx_reset_pending()
        self._cgx_compress = True  # auto mode may turn compression off (all ranks at once)
        self._cgx_backward_s = 0.0  # first to last gradient hook of the last step
        self._cgx_window = [float("inf"), 0.0]  # first push to last result of this step
        self._cgx_comm_window_s = 0.0  # the same, for the last synchronized step
        self._cgx_first_hook: float | None = None  # this step's first gradient hook
        self._cgx_last_hook = 0.0
        self._cgx_hooks = [p.register_post_accumulate_grad_hook(self._cgx_on_grad) for p in params.values()
                           if p.requires_grad]
        self._cgx_tuner = Tuner(self, compression) if compression.adaptive or compression.auto else None

    # ---- hooks: gradients enter here --------------------------------------------------------------

    def _cgx_reset_pending(self) -> None:
        for block in self._cgx_blocks:
            block.pending = len({id(p) for p, *_ in block.segments})
            block.future = None
        self._cgx_passes = {}

    def _cgx_on_grad(self, param: torch.nn.Parameter) -> None:
        with self._cgx_lock:
            self._cgx_last_hook = time.perf_counter()
            if self._cgx_first_hook is None:
                self._cgx_first_hook = self._cgx_last_hook
            passes = self._cgx_passes.get(id(param), 0) + 1
            self._cgx_passes[id(param)] = passes
            if passes > self._cgx_backward_passes:  # its block is already on its way: this pass would be lost
                raise CgxPsError(f"{self._cgx_name_of.get(id(param), 'a parameter')}: gradient computed "
                                 f"{passes} times before step(), but backward_passes_per_step="
                                 f"{self._cgx_backward_passes}; raise it to the number of backward passes per step")
            if passes != self._cgx_backward_passes:
                return  # accumulating: communicate after the last backward pass of the step
            ready = []
            for block in self._cgx_blocks_of.get(id(param), ()):
                block.pending -= 1
                if block.pending == 0 and block.future is None:
                    ready.append(block)
        for block in ready:
            self._cgx_submit(block)

    def _cgx_submit(self, block: _Block) -> None:
        """Copy the block's gradients into its buffer and hand it to the communication thread."""
        reducer, seq = self._cgx_reducer, block.round + 1
        if reducer is not None:
            reducer.before_write(block.spec.block_id, seq)
        for param, p_off, b_off, n in block.segments:
            if param.grad is None:
                block.buffer[b_off:b_off + n].zero_()  # unused in this step: contributes zeros
            else:
                block.buffer[b_off:b_off + n].copy_(param.grad.detach().reshape(-1)[p_off:p_off + n])
        ready = None
        if block.buffer.is_cuda:  # the comm thread must not read the buffer before the copies ran
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(block.buffer.device))
        if reducer is not None:
            reducer.mark_ready(block.spec.block_id, seq)
            if reducer.owner(block.spec.block_id) != self._cgx_config.local_rank:
                block.future = self._cgx_engine.submit(self._cgx_fetch(block, seq))
                block.round += 1
                return
        compressed = self._cgx_step >= self._cgx_warmup and self._cgx_compress
        block.future = self._cgx_engine.submit(self._cgx_exchange(block, seq, ready, compressed))
        block.round += 1

    async def _cgx_fetch(self, block: _Block, seq: int) -> int:
        # our own stream to the block's shard hears a failed round too: stop waiting then
        client = self._cgx_engine.clients[block.spec.shard]
        await self._cgx_reducer.fetch(block.spec.block_id, seq, failed=lambda: client.error,
                                      run_in_thread=self._cgx_engine.in_thread)
        return 0

    async def _cgx_exchange(self, block: _Block, seq: int, ready, compressed: bool) -> int:
        """Owner of the block for this node: (local sum,) encode, push, pull, decode, publish."""
        engine, config, reducer = self._cgx_engine, self._cgx_config, self._cgx_reducer
        spec = block.spec
        seed = zlib.crc32(f"{config.node_rank}/{spec.block_id}/{seq - 1}".encode())
        error_feedback = self._cgx_error_feedback and compressed
        if ready is not None:
            await engine.in_thread(ready.synchronize)
        if reducer is not None:
            await reducer.reduce(spec.block_id, seq, engine.in_thread)

        def decode(result: bytes) -> None:
            dequantize(result, out=block.buffer)
            block.buffer.mul_(1.0 / config.world_size)
            if block.buffer.is_cuda:
                torch.cuda.current_stream(block.buffer.device).synchronize()

        def encode() -> bytes:
            payload = _encode(block, compressed, seed, error_feedback)
            self._cgx_window[0] = min(self._cgx_window[0], time.perf_counter())  # first byte out
            return payload

        pushed = await engine.exchange(spec.shard, spec.block_id, seq - 1, encode, decode)
        self._cgx_window[1] = max(self._cgx_window[1], time.perf_counter())  # last result in
        if reducer is not None:
            reducer.publish(spec.block_id, seq)
        return pushed

    # ---- synchronize / step ---------------------------------------------------------------------

    def synchronize(self) -> None:
        """Finish communication for this step: submit blocks whose parameters got no gradient,
        wait for every block, and write the averaged gradients into ``.grad``."""
        if self._cgx_synchronized:
            return
        thawed = [p for p in self._cgx_frozen if p.requires_grad and p.grad is not None]
        if thawed:
            self._cgx_reset_pending()
            raise CgxPsError(f"{len(thawed)} tensor(s) were frozen (requires_grad=False) when the "
                             f"DistributedOptimizer was created but have gradients now; ranks would update them "
                             f"apart: create the DistributedOptimizer after unfreezing")
        with self._cgx_lock:
            leftover = [b for b in self._cgx_blocks if b.future is None]
            for block in leftover:
                block.pending = 0
        for block in leftover:
            self._cgx_submit(block)
        t0 = time.perf_counter()
        stats = StepStats(step=self._cgx_step, compressed=self._cgx_step >= self._cgx_warmup and self._cgx_compress)
        try:
            for block in self._cgx_blocks:
                try:
                    pushed = block.future.result()  # 0: another local rank pushed it for the node
                except CodecError as exc:  # e.g. NaN/Inf in a gradient: say whose
                    names = sorted({self._cgx_name_of.get(id(p), "?") for p, *_ in block.segments})
                    raise CgxPsError(f"rank {self._cgx_config.rank}: cannot encode the gradient of "
                                     f"{', '.join(names)}: {exc}") from exc
                stats.bytes_pushed += pushed
                stats.fp32_bytes += 4 * block.spec.numel if pushed else 0
        except BaseException:
            # Ready for the next step: a caller that skips this one (a loss-scaler after NaNs) or
            # an interrupted notebook cell must not find this step's stale futures again.
            self._cgx_reset_pending()
            raise
        stats.exposed_comm_s = time.perf_counter() - t0
        first = self._cgx_first_hook
        self._cgx_backward_s = self._cgx_last_hook - first if first is not None else 0.0
        self._cgx_first_hook = None
        start, end = self._cgx_window
        self._cgx_comm_window_s = max(0.0, end - start)
        self._cgx_window = [float("inf"), 0.0]
        for block in self._cgx_blocks:
            for param, p_off, b_off, n in block.segments:
                if not param.requires_grad:
                    continue  # frozen since wrapping: torch's optimizers must skip it (weight decay too)
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
                param.grad.view(-1)[p_off:p_off + n].copy_(block.buffer[b_off:b_off + n])
        self._cgx_reset_pending()
        self._cgx_stats = stats
        self._cgx_synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Inside, ``step()`` does not synchronize (call ``synchronize()`` yourself first)."""
        self._cgx_skip = True
        try:
            yield
        finally:
            self._cgx_skip = False

    def step(self, closure=None):  # noqa: D102 - same contract as torch.optim.Optimizer.step
        if not self._cgx_skip:
            self.synchronize()
        elif not self._cgx_synchronized:
            raise CgxPsError("step() inside skip_synchronize() needs synchronize() first")
        result = super().step(closure)
        self._cgx_synchronized = False
        if self._cgx_tuner is not None:
            self._cgx_tuner.after_step(self._cgx_step)
        self._cgx_step += 1
        return result

    @property
    def stats(self) -> StepStats:
        return self._cgx_stats

    @property
    def layout(self) -> ps_pb2.Layout:
        return self._cgx_layout


def _encode(block: _Block, compressed: bool, seed: int, error_feedback: bool) -> bytes:
    s = block.settings
    codec = codec_of(s) if compressed else Codec.FP32
    return encode_block(block.buffer, codec, bits=s.bits or 4, bucket_size=s.bucket_size or 1024,
                        stochastic=s.stochastic, seed=seed,
                        feedback=block.feedback if error_feedback else None).to_bytes()


def _num_shards() -> int:
    from .runtime import current_config

    return len(current_config().servers)


def DistributedOptimizer(  # noqa: N802 - a factory named like the class it returns (Horovod's API)
    optimizer: torch.optim.Optimizer,
    named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None = None,
    compression: str | Compression | None = "4bit",
    backward_passes_per_step: int = 1,
    error_feedback: bool = False,
    warmup_steps: int = 0,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so that ``step()`` averages gradients across all workers through the
    shards, compressed.

    compression: "4bit" (default), "Nbit" for N in 1..8, "fp16", "bf16", "fp32", "adaptive"
        (bits per tensor re-chosen every 100 steps: fewer bytes at the error of uniform 4 bits),
        "auto" (compress only when it measurably pays: a link-and-codec model makes the first
        choice, then measured step times of both modes decide), or a
        ``Compression`` with name-pattern exclusions and per-tensor overrides. 1-D tensors and
        tensors under 1024 elements always travel uncompressed.
    backward_passes_per_step: gradients accumulate over this many backward passes per step.
    error_feedback: carry each block's compression error into the next step (worker side).
    warmup_steps: the first steps travel uncompressed.
    block_bytes: fp32 bytes per block (1-4 MB balances pipelining against per-RPC cost).
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(f"DistributedOptimizer wraps a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if named_parameters is None:
        named_parameters = [(f"param.{i}", p) for i, p in
                            enumerate(p for g in optimizer.param_groups for p in g["params"])]
    named_parameters = list(named_parameters)
    if not all(isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)
               and isinstance(item[1], torch.Tensor) for item in named_parameters):
        raise ConfigError("named_parameters must give (name, tensor) pairs, e.g. model.named_parameters()")
    named = [(n, p) for n, p in named_parameters if p.requires_grad]
    cls = type(f"Distributed{type(optimizer).__name__}", (_DistributedMixin, type(optimizer)), {})
    dist = cls.__new__(cls)
    dist.__dict__.update(optimizer.__dict__)  # share param_groups, state and hooks
    dist._cgx_setup(named, Compression.parse(compression), backward_passes_per_step, error_feedback,
                    warmup_steps, block_bytes)
    return dist
