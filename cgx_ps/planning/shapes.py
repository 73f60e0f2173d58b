"""Real models' gradients as the network sees them: names, shapes and the order backward produces them.

    workload("resnet50")                 # torchvision's ResNet-50 v1.5, 161 tensors, 25,557,032 parameters
    workload("bert-base")                # transformers' BertModel(BertConfig()), 109,482,240
    workload("gpt2")                     # GPT2LMHeadModel(GPT2Config()), 124,439,808 (lm_head tied to wte)
    workload("vit-b16")                  # ViTForImageClassification, 1000 classes, 86,567,656
    workload("mypkg.models:build")       # a function returning an nn.Module, a Workload or (name, shape) pairs
    sized_workload(350_000_000, 0.8)     # a model given by its size alone

No weights are made: ResNet-50's shapes are written out here (torchvision is not needed), the transformer
models are built on torch's ``meta`` device from their configurations (transformers, imported only then).
Gradients arrive in reverse registration order: backward runs the layers last to first, which DDP's own
bucketing assumes as well (an approximation where a model registers modules in another order than it calls
them, or ties weights: GPT-2's tied embedding is ready at the end).

Compute per step (``COMPUTE_S``) is a published figure for one RTX 3090 training with mixed precision; it is
split over the layers by FLOPs for ResNet-50 (convolutions' FLOPs differ from their parameter counts by the
feature map's size) and by parameters for the transformers (their matmuls cost 2 FLOPs per parameter per
token; embeddings, which cost none, are the exception this accepts).
"""

from __future__ import annotations

import importlib
from typing import Iterable

from .model import Tensor, Workload

__all__ = ["COMPUTE_S", "MODELS", "PlanningError", "backward_split", "resnet50_tensors", "sized_workload", "workload"]


class PlanningError(ValueError):
    """A model that cannot be planned: unknown, missing an optional package, or without a compute time."""


# Seconds per training step on one RTX 3090, mixed precision (AMP), with the batch the source measured:
COMPUTE_S = {
    # timm's results/benchmark-train-amp-nchw-pt112-cu113-rtx3090.csv (huggingface/pytorch-image-models):
    # resnet50 826.06 samples/s, train_step_time 618.983 ms at batch 512
    "resnet50": 0.619,
    # the same file: vit_base_patch16_224 390.86 samples/s, 490.391 ms at batch 192
    "vit-b16": 0.490,
    # Lambda's PyTorch benchmarks (lambdal/deeplearning-benchmark, pytorch/pytorch-train-throughput-fp16.csv and
    # pytorch-train-bs-fp16.csv): RTX 3090 bert_base_squad 172 sequences/s at batch 96 (SQuAD, 384 tokens)
    "bert-base": 96 / 172,
    # Derived, not measured (no published RTX 3090 figure found): BERT-base's rate above as matmul FLOPs,
    # 6 x 85.1M non-embedding parameters x 172 x 384 tokens/s = 33.7 TFLOP/s, applied to GPT-2 small at
    # batch 16 x 1024 tokens: 6 x (85.1M + 38.6M lm_head) x 16384 / 33.7e12 (attention's n^2 term left out)
    "gpt2": 6 * (85.1e6 + 38.6e6) * 16 * 1024 / (6 * 85.1e6 * 172 * 384),
}
MODELS = tuple(COMPUTE_S)

_RESNET50_STAGES = ((64, 3, 56), (128, 4, 28), (256, 6, 14), (512, 3, 7))  # width, blocks, output side


def resnet50_tensors() -> list[Tensor]:
    """torchvision's resnet50() parameters in registration order (names and shapes as its
    ``named_parameters``), each weight with its forward FLOPs per 224x224 image; norms carry none."""
    out: list[Tensor] = []

    def conv(name: str, cout: int, cin: int, k: int, side: int) -> None:
        out.append(Tensor(f"{name}.weight", (cout, cin, k, k), 2.0 * k * k * cin * cout * side * side))

    def norm(name: str, c: int) -> None:
        out.extend([Tensor(f"{name}.weight", (c,), 0.0), Tensor(f"{name}.bias", (c,), 0.0)])

    conv("conv1", 64, 3, 7, 112)
    norm("bn1", 64)
    cin = 64
    for stage, (width, blocks, side) in enumerate(_RESNET50_STAGES, start=1):
        for b in range(blocks):
            p = f"layer{stage}.{b}"
            conv(f"{p}.conv1", width, cin, 1, side if b or stage == 1 else side * 2)
            norm(f"{p}.bn1", width)
            conv(f"{p}.conv2", width, width, 3, side)  # v1.5: the stride is in the 3x3 convolution
            norm(f"{p}.bn2", width)
            conv(f"{p}.conv3", width * 4, width, 1, side)
            norm(f"{p}.bn3", width * 4)
            if b == 0:
                conv(f"{p}.downsample.0", width * 4, cin, 1, side)
                norm(f"{p}.downsample.1", width * 4)
            cin = width * 4
    out += [Tensor("fc.weight", (1000, 2048), 2.0 * 2048 * 1000), Tensor("fc.bias", (1000,), 0.0)]
    return out


def _meta_module(model: str):
    """The transformers model on the meta device (shapes only, no memory, no download)."""
    try:
        import torch
        import transformers
    except ImportError as exc:
        raise PlanningError(f"--model {model} needs transformers (pip install 'cgx-ps[plan]'): {exc}") from None
    build = {
        "bert-base": lambda: transformers.BertModel(transformers.BertConfig()),
        "gpt2": lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config()),
        "vit-b16": lambda: transformers.ViTForImageClassification(transformers.ViTConfig(num_labels=1000)),
    }[model]
    with torch.device("meta"):
        return build()


def _module_tensors(module) -> list[Tensor]:
    """A module's trainable parameters in registration order (a tied weight once, as named_parameters)."""
    return [Tensor(name, tuple(p.shape)) for name, p in module.named_parameters() if p.requires_grad]


def _from_function(spec: str, compute_s: float | None) -> Workload:
    """MODULE:FUNCTION, a function of no arguments returning an nn.Module, a Workload or (name, shape) pairs."""
    module_name, _, function = spec.partition(":")
    try:
        made = getattr(importlib.import_module(module_name), function)()
    except (ImportError, AttributeError) as exc:
        raise PlanningError(f"cannot load model {spec!r}: {exc}") from None
    if isinstance(made, Workload):
        return made if compute_s is None else Workload(made.name, made.tensors, compute_s, made.overlap)
    if compute_s is None:
        raise PlanningError(f"model {spec!r}: give its compute time per step with --compute-ms")
    if hasattr(made, "named_parameters"):
        tensors = _module_tensors(made)
    else:
        tensors = [Tensor(str(name), tuple(int(d) for d in shape)) for name, shape in made]
    return Workload(spec, tuple(reversed(tensors)), compute_s)


def workload(model: str, compute_s: float | None = None) -> Workload:
    """A known model (``MODELS``) or MODULE:FUNCTION, gradients in backward order; ``compute_s`` overrides
    the published step time (required for MODULE:FUNCTION unless it returns a Workload)."""
    if ":" in model:
        return _from_function(model, compute_s)
    if model not in COMPUTE_S:
        raise PlanningError(f"unknown model {model!r}: use one of {', '.join(MODELS)} or MODULE:FUNCTION")
    tensors = resnet50_tensors() if model == "resnet50" else _module_tensors(_meta_module(model))
    return Workload(model, tuple(reversed(tensors)), COMPUTE_S[model] if compute_s is None else compute_s)


def sized_workload(params: int, compute_s: float, name: str | None = None) -> Workload:
    """A model known by its size alone: 4096 x 4096 matrices (compressed, as most of a real model's bytes are)
    and one of the rest, compute split by parameters."""
    if params < 1:
        raise PlanningError(f"--params must be at least 1, got {params}")
    side = 4096 * 4096
    shapes: Iterable[tuple[int, ...]] = [(4096, 4096)] * (params // side)
    rest = params % side
    if rest:
        shapes = [*shapes, (rest // 4096, 4096)] if rest >= 4096 else [*shapes]
        shapes = [*shapes, (rest % 4096,)] if rest % 4096 else shapes
    tensors = tuple(Tensor(f"layer{i}.weight", s) for i, s in enumerate(shapes))
    return Workload(name or f"{params:,} parameters", tuple(reversed(tensors)), compute_s)


def backward_split(job: Workload) -> list[tuple[str, float]]:
    """Seconds of backward spent on each gradient, in the order backward produces them (each tensor's
    ``compute`` share of ``compute_s * overlap``): what a benchmark that emulates compute layer by layer
    sleeps before each gradient is ready."""
    weights = [t.numel if t.compute is None else t.compute for t in job.tensors]
    total = sum(weights) or 1.0
    return [(t.name, job.compute_s * job.overlap * w / total) for t, w in zip(job.tensors, weights)]
