"""The cluster benchmark's configurations: what each name in ``cluster.py --configs`` runs
(system, hook or compression) and how the report labels it; ``cluster.py``'s epilog describes them."""

from __future__ import annotations

__all__ = ["CONFIGS", "SHARD_ARGS", "WORKER_ENV"]

CONFIGS: dict[str, tuple[str, str, str]] = {  # name -> (system, hook or compression, label)
    "ddp-fp32": ("ddp", "none", "DDP gloo fp32"),
    "ddp-fp16": ("ddp", "fp16", "DDP fp16 hook"),
    "ddp-powersgd": ("ddp", "powersgd", "DDP PowerSGD r4"),
    "cgx-fp32": ("cgx", "fp32", "cgx-ps fp32"),
    "cgx-4bit": ("cgx", "4bit", "cgx-ps 4-bit"),
    "cgx-2bit": ("cgx", "2bit", "cgx-ps 2-bit"),
    "cgx-auto": ("cgx-group", "auto", "cgx-ps auto"),  # "auto": every --auto-interval steps (cluster.py)
    "ddp-cgx-4bit": ("ddp-hook", "4bit", "DDP + cgx-ps hook 4-bit"),
    "ddp-cgx-auto": ("ddp-hook", "auto", "DDP + cgx-ps hook auto"),
    "cgx-4bit-raw": ("cgx", "4bit", "cgx-ps 4-bit, raw plane"),
    "ddp-cgx-4bit-raw": ("ddp-hook", "4bit", "DDP + cgx-ps hook 4-bit, raw plane"),
}

# Shard options and worker variables a configuration adds: the "-raw" ones open the shards' raw
# data plane and make the workers use it (raw, not auto: a port that cannot be reached fails the
# row instead of measuring gRPC under the raw plane's name). The others keep their streams on gRPC,
# the shards' default; `--data-port -1` says so explicitly.
_RAW = ("cgx-4bit-raw", "ddp-cgx-4bit-raw")
SHARD_ARGS: dict[str, tuple[str, ...]] = {
    name: ("--data-port", "0" if name in _RAW else "-1") for name, (system, _, _) in CONFIGS.items() if system != "ddp"
}
WORKER_ENV: dict[str, dict[str, str]] = {name: {"CGX_PS_DATAPLANE": "raw"} for name in _RAW}
