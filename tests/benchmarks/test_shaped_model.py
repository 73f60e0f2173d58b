"""benchmarks/shaped_model.py: a real model's parameter tensors with emulated compute.

The names, shapes and order must be the planning workload's (cgx_ps.planning.shapes), the gradients
must arrive in the workload's order, each after its share of the emulated compute, and be the true
gradients of the forward (gradcheck), so that the model learns."""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F

from benchmarks.shaped_model import ShapedModel, _Layer, _tile, fold, scaled_shape, scaled_workload
from benchmarks.workload import SHAPED_MODELS, Teacher, build_model, make_batch, training_parser
from cgx_ps.planning.shapes import backward_split, workload


def _job(name: str, compute_s: float | None = None):
    if name != "resnet50":
        pytest.importorskip("transformers")
    return workload(name, compute_s)


@pytest.mark.parametrize("name", SHAPED_MODELS)
def test_parameters_are_the_workloads_names_shapes_and_order(name):
    job = _job(name)
    model = ShapedModel(job, scale=0.01)
    named = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    registration = list(reversed(job.tensors))  # the workload lists them in backward order
    assert [n for n, _ in named] == [t.name for t in registration]
    assert [s for _, s in named] == [scaled_shape(t.shape, 0.01) for t in registration]


def test_full_size_resnet50_has_torchvisions_parameter_count():
    model = ShapedModel(workload("resnet50", 0.0))
    assert sum(p.numel() for p in model.parameters()) == 25_557_032
    assert model.get_parameter("layer4.2.conv3.weight").shape == (2048, 512, 1, 1)


def _arrivals(model: ShapedModel, batch: int = 16) -> tuple[list[str], list[float], float, float]:
    """Names in the order backward accumulated their gradients, each one's time from the start of
    backward, and the forward's and the backward's wall time."""
    names = {p: n for n, p in model.named_parameters()}
    order, stamps = [], []

    def arrived(p: torch.Tensor) -> None:
        order.append(names[p])
        stamps.append(time.perf_counter())

    handles = [p.register_post_accumulate_grad_hook(arrived) for p in model.parameters()]
    teacher = Teacher("mlp17m", 0)
    x, y = make_batch("mlp17m", teacher, batch, 1)
    t0 = time.perf_counter()
    loss = F.cross_entropy(model(x), y)
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    for h in handles:
        h.remove()
    return order, [s - t1 for s in stamps], t1 - t0, t2 - t1


def test_gradients_arrive_in_the_workloads_order_each_after_its_compute(monkeypatch):
    job = workload("resnet50", 0.45)
    model = ShapedModel(job, scale=0.01)
    slept = []  # what the passes asked to sleep: a load on the machine cannot lengthen it
    real_sleep = time.sleep
    monkeypatch.setattr(time, "sleep", lambda s: (slept.append(s), real_sleep(s))[1])
    order, stamps, forward_s, backward_s = _arrivals(model)
    assert order == [t.name for t in job.tensors]
    # each gradient is ready once backward has spent its share (and the shares before it)
    due = 0.0
    for (name, share), stamp in zip(backward_split(job), stamps):
        due += share
        assert stamp >= due - 1e-3, f"{name} arrived at {stamp:.4f} s, before its compute ended at {due:.4f} s"
    # the passes last the compute, forward 1/3 and backward 2/3, and sleep no more than it: each
    # sleeps to deadlines from its start, so the overshoot of many short sleeps does not add up
    # (wall times only from below: on a loaded 2-core machine the layers' own arithmetic can outlast
    # the deadlines, and then nothing sleeps)
    assert forward_s >= 0.15 and backward_s >= 0.30 and stamps[-1] >= 0.30 - 1e-3
    assert sum(slept) <= 0.45 + 1e-6, sum(slept)


def test_evaluation_does_not_sleep():
    model = ShapedModel(workload("resnet50", 2.0), scale=0.01)
    x = torch.randn(8, 64)
    t0 = time.perf_counter()
    model.eval()
    model(x)
    model.train()
    with torch.no_grad():
        model(x)
    assert time.perf_counter() - t0 < 0.5  # two forwards that would sleep 2 x 0.67 s when training


def test_scale_keeps_the_tensors_and_the_compute_split():
    job = workload("resnet50")
    small = scaled_workload(job, 0.05)
    assert [t.name for t in small.tensors] == [t.name for t in job.tensors]
    assert small.compute_s == job.compute_s
    assert [s for _, s in backward_split(small)] == pytest.approx([s for _, s in backward_split(job)])
    for big, t in zip(job.tensors, small.tensors):
        if big.numel >= 20_000:  # rounding aside, each element count shrinks by the scale
            assert t.numel / big.numel == pytest.approx(0.05, rel=0.1), (big, t)
    total = sum(t.numel for t in small.tensors) / sum(t.numel for t in job.tensors)
    assert total == pytest.approx(0.05, rel=0.02)


def test_scaled_shape_shrinks_the_largest_dimension():
    assert scaled_shape((1, 197, 768), 0.1) == (1, 197, 77)
    assert scaled_shape((1000, 2048), 0.5) == (1000, 1024)
    assert scaled_shape((64,), 0.001) == (1,)
    assert scaled_shape((3, 3), 1.0) == (3, 3)
    for bad in (0.0, -0.5, 1.5):
        with pytest.raises(ValueError):
            scaled_shape((4, 4), bad)


@pytest.mark.parametrize("n", [7, 40, 123])
def test_tile_is_folds_adjoint(n):
    # <fold(v), m> == <v, tile(m)>: what makes the hand-written backward the forward's gradient
    g = torch.Generator().manual_seed(n)
    v, m = torch.randn(n, dtype=torch.float64, generator=g), torch.randn(4, 5, dtype=torch.float64, generator=g)
    assert (fold(v, 4, 5) * m).sum().item() == pytest.approx((v * _tile(m, v.shape)).sum().item())


@pytest.mark.parametrize("shape", [(3,), (5, 9), (2, 3, 7)])  # shorter than, and not a multiple of, 4 x 5
def test_layer_backward_is_the_true_gradient(shape):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(6, 5, dtype=torch.float64, generator=g, requires_grad=True)
    x = torch.randn(6, 4, dtype=torch.float64, generator=g)
    p = torch.randn(shape, dtype=torch.float64, generator=g, requires_grad=True)
    assert torch.autograd.gradcheck(lambda h, p: _Layer.apply(h, x, p, 0.7, None), (h, p))


def test_gradients_are_deterministic_and_the_model_learns():
    def trained() -> tuple[float, float, list[torch.Tensor]]:
        torch.manual_seed(3)
        model = ShapedModel(workload("resnet50", 0.0), scale=0.01)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        teacher = Teacher("mlp17m", 0)
        ex, ey = make_batch("mlp17m", teacher, 512, 99)
        with torch.no_grad():
            before = F.cross_entropy(model(ex), ey).item()
        for step in range(25):
            x, y = make_batch("mlp17m", teacher, 64, step)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            assert all(torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0 for p in model.parameters())
            opt.step()
        with torch.no_grad():
            after = F.cross_entropy(model(ex), ey).item()
        return before, after, [p.grad.clone() for p in model.parameters()]

    before, after, grads = trained()
    assert after < 0.8 * before, (before, after)
    _, again, grads2 = trained()
    assert again == after and all(torch.equal(a, b) for a, b in zip(grads, grads2))


def test_step_scripts_build_shaped_models_and_check_their_options():
    args = training_parser("t").parse_args(["--model", "resnet50", "--scale", "0.02", "--compute-ms", "50"])
    model = build_model(args.model, args.scale, args.compute_ms / 1e3)
    assert isinstance(model, ShapedModel) and model.compute_s == 0.05 and model.scale == 0.02
    for bad in (["--scale", "0"], ["--scale", "1.5"], ["--compute-ms", "-1"], ["--model", "resnet18"]):
        with pytest.raises(SystemExit):
            training_parser("t").parse_args(bad)
