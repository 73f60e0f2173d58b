"""Auto mode's first choice from the library's performance model: the adapter from what a job measured
(``cgx_ps.planning.measured``) and the choice ``ModeChooser`` makes with it. Pure: no shards, no clock (the
real runs: tests/test_autotune.py)."""

from __future__ import annotations

import dataclasses

import pytest

from cgx_ps.planning.measured import (AutoFigures, AutoModel, allreduce_cluster, pipeline_rate, shards_cluster,
                                      speeds_of, workload_of)
from cgx_ps.planning.model import Workload, predict, ps_link_seconds, ring_seconds
from cgx_ps.worker.tuning.auto_mode import ModeChooser

MB = 1 << 20
# a 25 M-parameter MLP as a layout lists its tensors (by name); backward produces the last layer's first
TENSORS = [(f"{i}.{kind}", (2048, 2048) if kind == "weight" else (2048,)) for i in range(6)
           for kind in ("bias", "weight")]
BACKWARD_S = 0.060


def _arrivals(start: float = 100.0, backward_s: float = BACKWARD_S) -> dict[str, float]:
    """Layer 5's gradients first, layer 0's last, evenly over backward (a perf_counter clock)."""
    return {name: start + backward_s * (5 - int(name[0])) / 5 for name, _ in TENSORS}


def _figures(rate_Bps: float, codec_eps: float = 1e9, **kw) -> AutoFigures:
    """Two nodes of one rank; fp32 copied at 1 G elements/s."""
    return AutoFigures(rate_Bps, rate_Bps, 0.0, 0, 0, 0.0, BACKWARD_S, **{"codec_eps": codec_eps, "nodes": 2,
                                                                          "ranks": 2, "copy_eps": 1e9, **kw})


def _model(figures: AutoFigures) -> AutoModel:
    return AutoModel(workload_of(TENSORS, _arrivals(), BACKWARD_S), figures)


def test_the_workload_follows_the_measured_arrivals():
    arrivals = _arrivals()
    del arrivals["0.bias"]  # got no gradient this step
    w = workload_of(TENSORS, arrivals, BACKWARD_S)
    names = [t.name for t in w.tensors]
    assert names[:2] == ["5.bias", "5.weight"] and names[-3:] == ["1.weight", "0.weight", "0.bias"]
    assert (w.compute_s, w.overlap) == (BACKWARD_S, 1.0)  # only backward: what communication can hide behind
    # each tensor's share of backward is the time since the one before, so the model's ready times are the
    # measured ones: 12 ms per layer, layer 5 at once, the tensor without a gradient at the end
    compute = {t.name: t.compute for t in w.tensors}
    assert compute["5.bias"] == 0.0 and compute["4.bias"] == pytest.approx(0.012)
    assert compute["4.weight"] == 0.0 and compute["0.bias"] == 0.0
    assert sum(compute.values()) == pytest.approx(BACKWARD_S)
    # a step that did not say when its gradients arrived: the layout's reverse order, split by elements
    fallback = workload_of(TENSORS, {}, BACKWARD_S)
    assert [t.name for t in fallback.tensors] == [n for n, _ in reversed(TENSORS)]
    assert all(t.compute is None for t in fallback.tensors)


def test_gradients_that_arrive_early_hide_behind_backward_in_the_prediction():
    """The arrivals reach the model: the same tensors, the big ones ready at the start of backward or at its
    end, leave less or more communication exposed."""
    f = _figures(125e6)
    early = {name: 0.0 if name.endswith("weight") else BACKWARD_S for name, _ in TENSORS}
    late = {name: BACKWARD_S if name.endswith("weight") else 0.0 for name, _ in TENSORS}
    exposed = {k: AutoModel(workload_of(TENSORS, a, BACKWARD_S), f).exposed(True)
               for k, a in (("early", early), ("late", late))}
    assert exposed["early"] < exposed["late"] - 0.5 * BACKWARD_S, exposed


def test_the_clusters_and_speeds_take_the_measured_rates():
    f = _figures(50e6, codec_eps=300e6, uncompressed_bps=80e6, ranks=4)
    # the shards' path: a block's push (and its result) take its bytes at the measured rate
    assert ps_link_seconds(4 * MB, shards_cluster(f)) == pytest.approx(4 * MB / 50e6)
    # the group: one all_reduce of X bytes takes X at the probed all_reduce rate, on 4 ranks
    ring = allreduce_cluster(f)
    assert ring.nodes * ring.gpus_per_node == 4
    assert ring_seconds(4 * MB, 4, ring) == pytest.approx(4 * MB / 80e6)
    # the codec: encode + decode of an element in 1 / codec_eps seconds of wall time
    s = speeds_of(f)
    assert 1 / (s.encode_eps * s.codec_threads) + 1 / (s.decode_eps * s.codec_threads) == pytest.approx(1 / 300e6)


@pytest.mark.parametrize("option, bits", [("cgx-fp32", None), ("cgx-4bit", 4), ("cgx-2bit", 2)])
def test_the_pipeline_rate_is_the_rate_at_which_the_model_takes_the_measured_window(option, bits):
    """Feeding the model a step's pipeline rate gives back the step's window: every block ready at once (no
    backward to hide behind), the codec free, the link at 100 MB/s."""
    rate = 100e6
    w = workload_of(TENSORS, {}, 0.0)
    f = _figures(rate, codec_eps=1e15)
    p = predict(w, shards_cluster(f), speeds_of(f), option)
    pushed = p.bytes_per_host  # one shard per node on hosts of their own: what the node pushes
    assert pipeline_rate(int(pushed), 4 * w.params, p.exposed_comm_s) == pytest.approx(rate, rel=0.02), bits
    assert pipeline_rate(0, 0, 1.0) == pipeline_rate(1000, 4000, 0.0) == 0.0  # nothing measured


@pytest.mark.parametrize("group", [False, True])
def test_each_mode_is_the_models_prediction_for_its_path(group):
    f = _figures(125e6, uncompressed_bps=200e6 if group else 0.0)
    m = _model(f)
    assert m.option(True) == "cgx-4bit" and m.option(False) == ("ddp-fp32" if group else "cgx-fp32")
    assert m.exposed(True) == predict(m.workload, shards_cluster(f), speeds_of(f), "cgx-4bit").exposed_comm_s
    uncompressed = predict(m.workload, allreduce_cluster(f) if group else shards_cluster(f), speeds_of(f),
                           "ddp-fp32" if group else "cgx-fp32")
    assert m.exposed(False) == uncompressed.exposed_comm_s
    assert m.exposed(True) != m.exposed(False)
    bits2 = _model(dataclasses.replace(f, bits=2))
    assert bits2.option(True) == "cgx-2bit" and bits2.exposed(True) < m.exposed(True)  # the configured bits


def test_a_slow_link_makes_the_first_choice_compress_and_rules_the_other_mode_out():
    m = _model(_figures(12.5e6))  # 100 Mbit/s: 100 MB of fp32 take 8 s, 4 bits 1 s
    assert m.exposed(False) > 5 * m.exposed(True) > 0
    modes = ModeChooser()
    assert modes.choose(False, m) == (True, "model")
    for _ in range(3):
        modes.record(1.1)
    compress, reason = modes.choose(True, m)  # uncompressed steps predicted at ~8 s: never tried
    assert compress is True and reason.startswith("model rules the other mode out"), reason


def test_a_fast_link_where_the_codec_costs_more_than_it_saves_stays_uncompressed():
    fast = _figures(1.25e9, codec_eps=100e6)  # 10 Gbit/s, a slow codec: 25 M elements take 250 ms
    m = _model(fast)
    assert m.exposed(True) > m.exposed(False) + 0.04
    assert ModeChooser().choose(True, m) == (False, "model")
    # a fast codec on a 40 Gbit/s link, behind 500 ms of backward: compressing saves the tail of a few ms,
    # under the 5% of the step it must save (exact gradients win near-ties); at 1 Gbit/s it saves far more
    long = workload_of(TENSORS, _arrivals(backward_s=0.5), 0.5)
    quick = AutoModel(long, dataclasses.replace(fast, codec_eps=20e9, throughput_bps=5e9))
    assert quick.step_s(True) < quick.step_s(False) < 1.05 * quick.step_s(True)
    assert ModeChooser().choose(True, quick) == (False, "model")
    slower = AutoModel(long, dataclasses.replace(quick.figures, throughput_bps=125e6))
    assert slower.step_s(True) < 0.95 * slower.step_s(False)
    assert ModeChooser().choose(False, slower) == (True, "model")


def test_a_fast_process_group_makes_uncompressed_steps_win_where_the_shards_would_not():
    """Where uncompressed steps all-reduce over a group, its rate decides for them, not the shards'."""
    shards = _figures(100e6)
    group = dataclasses.replace(shards, uncompressed_bps=2e9)
    assert ModeChooser().choose(False, _model(shards)) == (True, "model")
    assert ModeChooser().choose(True, _model(group)) == (False, "model")
    assert _model(group).exposed(True) == _model(shards).exposed(True)  # compressed steps use the shards either way


def test_figures_of_an_older_decision_still_load():
    """Decisions carry the figures as plain data; an older one has none of the newer fields."""
    old = {"throughput_bps": 1e8, "probe_bps": 1e8, "pipeline_bps": 0.0, "fp32_bytes": 4 * MB,
           "compressed_bytes": MB // 2, "codec_s": 0.01, "overlap_s": 0.05, "uncompressed_bps": 0.0}
    f = AutoFigures(**old)
    assert (f.codec_eps, f.bits, f.nodes, f.ranks) == (0.0, 4, 1, 1)
    m = AutoModel(Workload("w", workload_of(TENSORS, {}, 0.05).tensors, 0.05, 1.0), f)
    assert m.exposed(False) > m.exposed(True) > 0  # the model's default codec speed stands in
