#!/usr/bin/env python3
"""One torch.distributed DDP (gloo) training worker; prints one JSON line.

Launched once per host (see ``netcluster.run_ddp``) with the usual env
``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` (and
``GLOO_SOCKET_IFNAME``).  With ``WORLD_SIZE=1`` (or no env at all) it trains
the bare model without a process group and reports the median step time as
``single_process_compute_s``: the compute cost of one step with no
communication at all.

The data are synthetic but learnable: inputs are Gaussian, labels are the
argmax of a fixed random "teacher" network.  Everything is seeded from
``--seed``, so the same seed gives the same initial model, batches (per rank
and step) and evaluation set in every run, and losses are comparable across
hooks.  Batches are generated before the timed loop.

Output (one line of JSON on stdout), among others: ``step_times_s`` (every
step, warm-up included), ``median_step_s`` (after warm-up), ``eval_loss``
(held-out loss after training), ``train_loss`` (last local batch),
``tx_bytes_per_step``/``rx_bytes_per_step`` (from /proc/net/dev of
``--iface``, over the timed steps; null if the interface is absent),
``cpu_s_per_step`` (user + system CPU seconds of this process, all threads,
over the timed steps) and ``host_cpu_s_per_step`` (the same plus the
processes named in ``CGX_PS_BENCH_HOST_PIDS``, the colocated cgx-ps shards:
what one host spends per step; equal to ``cpu_s_per_step`` for DDP).

``--hook cgx`` registers the cgx-ps DDP communication hook (``cgx.DDPHookState(ddp,
compression=--compression, block_bytes=--block-mb)`` with ``cgx.ddp_comm_hook``): DDP's own
bucketing and overlap, with every bucket averaged through the cgx-ps shards in CGX_PS_SERVERS
(``netcluster.run_cgx(..., front_end="ddp-hook")`` starts them and sets the env). It needs the
cgx-ps env as well as the torch.distributed one (``cgx.init()`` runs first), and adds cgx_step.py's
``exposed_comm_s`` (median over the timed steps of ``DDPHookState.stats.exposed_comm_s``: from the
last bucket handed over to the last block decoded) and ``bytes_pushed_per_step`` /
``fp32_bytes_per_step``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from netcluster import HOST_PIDS_ENV  # noqa: E402 - stdlib only: the variable run_cgx sets

MODELS = ("tiny", "mlp17m", "mlp25m", "convnet")
HOOKS = ("none", "fp16", "powersgd", "cgx")
# The built-in powerSGD_hook chains futures with ``.then`` and calls ``.wait()`` on a
# new all_reduce *inside* the callbacks.  Gloo runs future callbacks on its worker
# threads (2 per process group), so two buckets in flight can block both workers
# while the all_reduces they wait for sit in the queue behind them: a deadlock
# (seen with mlp17m and DDP's default 25 MiB buckets).  One bucket (an explicit
# bucket_cap_mb >= model size also disables DDP's small first bucket) avoids it.
POWERSGD_BUCKET_CAP_MB = 1024
IN_FEATURES = 64
IMAGE = (3, 32, 32)
CLASSES = 10


# --------------------------------------------------------------------------
# models and data
# --------------------------------------------------------------------------


def _mlp(*widths: int) -> nn.Sequential:
    layers: list[nn.Module] = []
    for a, b in zip(widths[:-1], widths[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])  # no ReLU after the logits


def build_model(name: str) -> nn.Module:
    if name == "tiny":      # smoke tests
        return _mlp(IN_FEATURES, 128, CLASSES)
    if name == "mlp17m":    # 17.1M params, ~34 MFLOP/sample forward
        return _mlp(IN_FEATURES, 4096, 4096, CLASSES)
    if name == "mlp25m":    # 25.5M params, compute proportional to params
        return _mlp(IN_FEATURES, 4096, 4096, 2048, CLASSES)
    if name == "convnet":   # 4.6M params, ~3x the step time of mlp17m: compute-bound
        def conv(a, b):
            return [nn.Conv2d(a, b, 3, padding=1), nn.ReLU()]
        return nn.Sequential(
            *conv(3, 64), *conv(64, 64), nn.MaxPool2d(2),      # 32x32
            *conv(64, 128), nn.MaxPool2d(2),                   # 16x16
            *conv(128, 256), nn.MaxPool2d(2),                  # 8x8 -> 4x4
            nn.Flatten(), nn.Linear(256 * 4 * 4, 1024), nn.ReLU(), nn.Linear(1024, CLASSES),
        )
    raise ValueError(f"unknown model {name!r}; choose from {MODELS}")


def input_shape(model: str) -> tuple[int, ...]:
    return IMAGE if model == "convnet" else (IN_FEATURES,)


class Teacher:
    """A fixed random network that labels inputs (argmax of its logits)."""

    def __init__(self, model: str, seed: int):
        g = torch.Generator().manual_seed(10_007 + seed)
        self.image = model == "convnet"
        d = 3 * 8 * 8 if self.image else IN_FEATURES  # images are 4x4-average-pooled first
        self.w1 = torch.randn(d, 256, generator=g) / math.sqrt(d)
        self.w2 = torch.randn(256, CLASSES, generator=g) / math.sqrt(256)

    @torch.no_grad()
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.image:
            x = F.avg_pool2d(x, 4).flatten(1)
        return (torch.tanh(x @ self.w1) @ self.w2).argmax(dim=1)


def make_batch(model: str, teacher: Teacher, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, *input_shape(model), generator=g)
    return x, teacher(x)


def batch_seed(seed: int, step: int, rank: int) -> int:
    return (seed * 1_000_003 + step) * 1_009 + rank


# --------------------------------------------------------------------------
# measurement helpers
# --------------------------------------------------------------------------


def iface_bytes(iface: str | None) -> tuple[int, int] | None:
    """(rx_bytes, tx_bytes) of ``iface`` in this process's network namespace."""
    if not iface:
        return None
    try:
        with open("/proc/net/dev") as f:
            for line in f.readlines()[2:]:
                name, _, rest = line.partition(":")
                if name.strip() == iface:
                    v = rest.split()
                    return int(v[0]), int(v[8])
    except OSError:
        pass
    return None


_CLK_TCK = os.sysconf("SC_CLK_TCK")


def _proc_cpu_s(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK  # utime + stime, fields 14 and 15 of proc(5)


class HostCpu:
    """CPU seconds of this process and of the other processes on its host (``HOST_PIDS_ENV``)
    between ``start()`` and ``stop()``: the CPU cost of the timed steps, per host."""

    def __init__(self, env: dict | None = None) -> None:
        raw = (os.environ if env is None else env).get(HOST_PIDS_ENV, "")
        self.pids = [int(p) for p in raw.split(",") if p.strip()]
        self._start: tuple[float, list[float | None]] | None = None
        self.own_s: float | None = None
        self.others_s: float | None = None

    def _sample(self) -> tuple[float, list[float | None]]:
        return time.process_time(), [_proc_cpu_s(p) for p in self.pids]

    def start(self) -> None:
        self._start = self._sample()

    def stop(self) -> None:
        if self._start is None:
            return
        own, others = self._sample()
        self.own_s = own - self._start[0]
        pairs = list(zip(self._start[1], others))
        # a colocated process that is gone cannot be accounted for: no host figure then
        self.others_s = None if any(a is None or b is None for a, b in pairs) else sum(b - a for a, b in pairs)

    def per_step(self, steps: int) -> dict[str, float | None]:
        if self.own_s is None or steps <= 0:
            return {"cpu_s_per_step": None, "colocated_cpu_s_per_step": None, "host_cpu_s_per_step": None}
        own = self.own_s / steps
        others = None if self.others_s is None else self.others_s / steps
        return {"cpu_s_per_step": own, "colocated_cpu_s_per_step": others,
                "host_cpu_s_per_step": None if others is None else own + others}


def register_hook(ddp: nn.parallel.DistributedDataParallel, hook: str, seed: int, rank_pq: int,
                  compression: str = "4bit", block_mb: float = 4.0) -> object:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if hook == "cgx":
        import cgx_ps.worker as cgx

        state = cgx.DDPHookState(ddp, compression=compression, block_bytes=int(block_mb * (1 << 20)))
        ddp.register_comm_hook(state, cgx.ddp_comm_hook)
        return state
    if hook == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        return None
    if hook == "powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=rank_pq,
            start_powerSGD_iter=2,  # the minimum with error feedback / warm start; warm-up covers it
            use_error_feedback=True, warm_start=True, random_seed=seed,
        )
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        return state
    return None


# --------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=MODELS, default="mlp17m")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--steps", type=int, default=20, help="timed steps (after warm-up)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (>= 2 for powersgd)")
    p.add_argument("--hook", choices=HOOKS, default="none")
    p.add_argument("--powersgd-rank", type=int, default=4)
    p.add_argument("--compression", default="4bit", help="--hook cgx: fp32, fp16, Nbit (as cgx_step.py)")
    p.add_argument("--block-mb", type=float, default=4.0, help="--hook cgx: fp32 MB per block (as cgx_step.py)")
    p.add_argument("--bucket-cap-mb", type=float, default=None,
                   help="DDP bucket size in MiB (default: DDP's 25; for powersgd %d, see POWERSGD_BUCKET_CAP_MB)"
                   % POWERSGD_BUCKET_CAP_MB)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-size", type=int, default=512)
    p.add_argument("--iface", default=os.environ.get("GLOO_SOCKET_IFNAME"),
                   help="interface whose /proc/net/dev counters give bytes per step")
    p.add_argument("--timeout", type=float, default=300, help="process-group timeout, seconds")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.hook == "powersgd" and args.warmup < 2:
        args.warmup = 2  # PowerSGD runs plain allreduce before its start_powerSGD_iter
    torch.set_num_threads(args.threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    distributed = world > 1

    if args.hook == "cgx" and not distributed:
        raise SystemExit("--hook cgx needs WORLD_SIZE > 1 (and the cgx-ps env: CGX_PS_SERVERS, ...)")
    cgx = None
    if args.hook == "cgx":
        import cgx_ps.worker as cgx

        cgx.init()  # before the process group: the hook's state registers with the shards it names
    t_init = time.perf_counter()
    if distributed:
        dist.init_process_group("gloo", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=args.timeout))
    init_s = time.perf_counter() - t_init

    torch.manual_seed(args.seed)  # identical initial model on every rank (DDP broadcasts it anyway)
    model = build_model(args.model)
    n_params = sum(p.numel() for p in model.parameters())
    if args.hook == "powersgd" and args.bucket_cap_mb is None:
        args.bucket_cap_mb = POWERSGD_BUCKET_CAP_MB
    ddp_kw = {} if args.bucket_cap_mb is None else {"bucket_cap_mb": args.bucket_cap_mb}
    net = nn.parallel.DistributedDataParallel(model, **ddp_kw) if distributed else model
    hook_state = (register_hook(net, args.hook, args.seed, args.powersgd_rank, args.compression, args.block_mb)
                  if distributed else None)
    opt = torch.optim.SGD(net.parameters(), lr=args.lr)

    teacher = Teacher(args.model, args.seed)
    total = args.warmup + args.steps
    batches = [make_batch(args.model, teacher, args.batch_size, batch_seed(args.seed, s, rank)) for s in range(total)]
    eval_x, eval_y = make_batch(args.model, teacher, args.eval_size, 7_777_777 + args.seed)

    @torch.no_grad()
    def eval_loss() -> float:
        model.eval()
        loss = sum(F.cross_entropy(model(x), y, reduction="sum").item()
                   for x, y in zip(eval_x.split(256), eval_y.split(256)))
        model.train()
        return loss / args.eval_size

    eval_initial = eval_loss()
    if distributed:
        dist.barrier()

    times, loss = [], float("nan")
    exposed, pushed, fp32 = [], 0, 0  # --hook cgx only
    counters0 = None
    cpu = HostCpu()
    for step, (x, y) in enumerate(batches):
        if step == args.warmup:
            counters0 = iface_bytes(args.iface)
            cpu.start()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        out = net(x)
        loss_t = F.cross_entropy(out, y)
        loss_t.backward()  # DDP: returns once every gradient bucket is all-reduced
        opt.step()
        times.append(time.perf_counter() - t0)
        loss = loss_t.item()
        if args.hook == "cgx" and step >= args.warmup:
            # the step ended in the last bucket's future, which backward() waited for
            exposed.append(hook_state.stats.exposed_comm_s)
            pushed += hook_state.stats.bytes_pushed
            fp32 += hook_state.stats.fp32_bytes
    cpu.stop()
    counters1 = iface_bytes(args.iface)

    timed = times[args.warmup:]
    median = statistics.median(timed) if timed else None
    rx = tx = None
    if counters0 and counters1 and args.steps:
        rx = (counters1[0] - counters0[0]) / args.steps
        tx = (counters1[1] - counters0[1]) / args.steps

    result = {
        "rank": rank,
        "world_size": world,
        "model": args.model,
        "params": n_params,
        "hook": args.hook if distributed else None,
        "batch_size": args.batch_size,
        "bucket_cap_mb": args.bucket_cap_mb if distributed else None,
        "threads": args.threads,
        "steps": args.steps,
        "warmup": args.warmup,
        "init_s": init_s,
        "step_times_s": times,
        "median_step_s": median,
        "mean_step_s": statistics.mean(timed) if timed else None,
        "single_process_compute_s": median if not distributed else None,
        "train_loss": loss,
        "eval_loss_initial": eval_initial,
        "eval_loss": eval_loss(),
        "iface": args.iface,
        "tx_bytes_per_step": tx,
        "rx_bytes_per_step": rx,
        **cpu.per_step(args.steps),
        "torch": torch.__version__,
    }
    if args.hook == "cgx":
        result.update({"compression": args.compression, "block_mb": args.block_mb,
                       "exposed_comm_s": statistics.median(exposed) if exposed else None,
                       "bytes_pushed_per_step": pushed / max(args.steps, 1),
                       "fp32_bytes_per_step": fp32 / max(args.steps, 1),
                       "tuning": [d.as_dict() for d in hook_state.tuning_history]})
    if distributed:
        dist.barrier()
        dist.destroy_process_group()
    if cgx is not None:
        cgx.shutdown()
    ok = math.isfinite(result["eval_loss"]) and math.isfinite(loss)
    print(json.dumps(result), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # The result is out; skip interpreter teardown. c10d/gloo's static destructors occasionally
    # abort (SIGABRT) after a clean destroy_process_group, which turned a finished run into rc -6.
    os._exit(code)
