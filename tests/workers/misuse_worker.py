"""One rank misusing the worker API in a named way (tests/test_worker_misuse.py); prints one JSON
line: the error raised (type and message) and what the parameters did."""

from __future__ import annotations

import argparse
import json
import logging
import os
import urllib.request

import torch

import cgx_ps.worker as cgx


def _nan_by_default(model: torch.nn.Module, x: torch.Tensor) -> dict:
    """Four steps, the middle two with a NaN loss, with the default options and no GradScaler."""
    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("cgx_ps.worker.frontends.step_driver").addHandler(handler)
    opt = cgx.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                   compression="4bit")
    tensors, errors = [], []
    for step in range(4):
        opt.zero_grad()
        loss = model(x).pow(2).sum()
        (loss * float("nan") if step in (1, 2) else loss).backward()
        try:
            opt.step()
            errors.append("")
        except cgx.CgxPsError as exc:  # not applied, on every rank alike: skip it and go on
            errors.append(str(exc))
        tensors.append(list(opt.stats.non_finite_tensors))
    # this process's /metrics, fetched over HTTP as Prometheus would
    port = int(os.environ["CGX_PS_WORKER_METRICS_PORT"])
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {"non_finite_tensors": tensors, "errors": errors, "said": said, "steps": opt.stats.step,
            "weight_finite": bool(torch.isfinite(model[0].weight).all()), "metrics": metrics}


def scenario(name: str) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    x = torch.randn(4, 8)
    out: dict = {}
    if name == "unnamed":  # the optimizer also trains a tensor outside named_parameters
        extra = torch.nn.Parameter(torch.ones(3))
        cgx.DistributedOptimizer(torch.optim.SGD([*model.parameters(), extra], lr=0.1), model.named_parameters())
        return out
    if name == "added_later":  # the last layer joins the optimizer after wrapping (add_param_group)
        named = list(model[0].named_parameters())
        opt = cgx.DistributedOptimizer(torch.optim.SGD(model[0].parameters(), lr=0.1), named, compression="fp32")
        opt.add_param_group({"params": model[2].parameters()})  # a generator, as users pass it
        return out
    if name == "added_frozen_then_thawed":  # added frozen after wrapping (allowed), trained later
        opt = cgx.DistributedOptimizer(torch.optim.SGD(model[0].parameters(), lr=0.1), model[0].named_parameters(),
                                       compression="fp32")
        model[2].requires_grad_(False)
        opt.add_param_group({"params": model[2].parameters()})
        model[2].requires_grad_(True)
        opt.zero_grad()
        model(x).pow(2).sum().backward()
        opt.step()
        return out
    if name in ("catch_up_twice", "catch_up_with_hook_state"):
        inner = torch.optim.SGD(model.parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.LambdaLR(inner, lambda step: 1.0)  # built before wrapping: accepted
        opt = cgx.DistributedOptimizer(inner, model.named_parameters())
        if name == "catch_up_with_hook_state":
            cgx.catch_up_with(opt, hook_state=cgx.DDPHookState(model))
        cgx.catch_up_with(opt, schedulers=[sched])
        cgx.catch_up_with(opt)  # the second call: refused
        return out
    if name == "thawed":  # frozen when wrapped, trained later
        model[0].bias.requires_grad_(False)
    if name == "nan_by_default":  # no allow_non_finite: NaN travels, is counted and said once a minute
        return _nan_by_default(model, x)
    opt = cgx.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, weight_decay=0.5),
                                   model.named_parameters(), compression="fp32",
                                   allow_non_finite=name != "nan")  # "nan": the refusal asked for
    if name == "thawed":
        model[0].bias.requires_grad_(True)
    if name == "frozen_after":
        model[0].bias.requires_grad_(False)
        out["before"] = model[0].bias.sum().item()
    for step in range(2):
        opt.zero_grad()
        loss = model(x).pow(2).sum()
        if name == "nan" and step == 1:
            loss = loss * float("nan")
        loss.backward()
        if name == "extra_pass":
            model(x).pow(2).sum().backward()
        opt.step()
    if name == "frozen_after":
        out["after"] = model[0].bias.sum().item()
    if name == "skip_unsynchronized":  # step() without synchronize() inside skip_synchronize()
        loss = model(x).pow(2).sum()
        loss.backward()
        with opt.skip_synchronize():
            opt.step()
    if name == "second_optimizer":  # one session per process
        cgx.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters())
    if name == "after_shutdown":
        cgx.shutdown()
        opt.zero_grad()
        model(x).pow(2).sum().backward()
        opt.step()
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("scenario")
    args = p.parse_args()
    cgx.init()
    out: dict = {}
    try:
        out = scenario(args.scenario)
    except Exception as exc:  # noqa: BLE001 - the test checks what was raised
        out["error"] = f"{type(exc).__name__}: {exc}"
        out["cgx_ps_error"] = isinstance(exc, cgx.CgxPsError)
    print(json.dumps(out), flush=True)
    cgx.shutdown()


if __name__ == "__main__":
    main()
