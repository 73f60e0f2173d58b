"""The cluster benchmark's report over repeated runs (benchmarks/cluster_report.py, cluster_stats.py).

Synthetic rows in the shape ``benchmarks/cluster.py --json`` writes, so no network namespaces are
needed: the medians and min-max ranges, the targets checked on the medians and in each run (a
communication cut missed in one run is a miss however good the median), the interleaved order
of a repeated sweep, and the merge of several JSON files into one report with both charts.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import cluster, cluster_report
from benchmarks.cluster_charts import link_series, rate_label
from benchmarks.cluster_report import markdown
from benchmarks.cluster_targets import judge, target_of
from benchmarks.cluster_stats import summarize

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
LABELS = {"ddp-fp32": "DDP gloo fp32", "ddp-fp16": "DDP fp16 hook", "cgx-4bit": "cgx-ps 4-bit",
          "ddp-cgx-4bit": "DDP + cgx-ps hook 4-bit", "cgx-4bit-raw": "cgx-ps 4-bit, raw plane",
          "ddp-cgx-4bit-raw": "DDP + cgx-ps hook 4-bit, raw plane"}


def make_run(run: int, comm: dict[str, float], cpu: dict[str, float], *, rate: str = "1gbit",
             compute: float = 0.15, compute_cpu: float = 0.16, **extra) -> list[dict]:
    """One run of one group, as cluster.py records it: the two single-process rows, then a row per
    configuration with step = compute + comm."""
    base = {"run": run, "model": "mlp17m", "rate": rate, "topology": "colocated", "workers": 2, "shards": 2,
            "batch_size": 64, "threads": 1, "steps": 20, "warmup": 3, "compute_s": compute,
            "compute_cpu_s": compute_cpu, **extra}
    rows = [{**base, "config": "single", "label": f"single process ({when})", "status": "ok",
             "step_s": compute, "host_cpu_s_per_step": compute_cpu, "comm_s": None, "ideal_s": None}
            for when in ("start", "end")]
    for config, c in comm.items():
        rows.append({**base, "config": config, "label": LABELS[config], "status": "ok", "step_s": compute + c,
                     "comm_s": c, "ideal_s": 0.1, "host_cpu_s_per_step": cpu[config], "eval_loss": 2.0})
    return rows


# comm times per run: DDP fp32 0.60/0.80/0.70, the fp16 hook 0.45 always, cgx-ps 4-bit 0.14/0.21/0.16:
# the cut vs DDP fp32 is 4.29x, 3.81x, 4.38x (missed in run 2), 4.38x on the medians (0.70 / 0.16)
THREE_RUNS = (make_run(1, {"ddp-fp32": 0.60, "ddp-fp16": 0.45, "cgx-4bit": 0.14},
                       {"ddp-fp32": 0.20, "ddp-fp16": 0.20, "cgx-4bit": 0.30})
              + make_run(2, {"ddp-fp32": 0.80, "ddp-fp16": 0.45, "cgx-4bit": 0.21},
                         {"ddp-fp32": 0.20, "ddp-fp16": 0.20, "cgx-4bit": 0.20})
              + make_run(3, {"ddp-fp32": 0.70, "ddp-fp16": 0.45, "cgx-4bit": 0.16},
                         {"ddp-fp32": 0.20, "ddp-fp16": 0.20, "cgx-4bit": 0.22}))


def test_medians_ranges_and_targets_in_every_run():
    by = {r["label"]: r for r in summarize(THREE_RUNS)}
    c4 = by["cgx-ps 4-bit"]
    assert c4["n"] == 3 and c4["runs"] == 3
    assert c4["step_s"] == pytest.approx(0.31)  # the median: not the mean (0.320), first or last run
    assert c4["range"]["step_s"] == pytest.approx((0.29, 0.36))
    assert c4["host_cpu_s_per_step"] == pytest.approx(0.22) and c4["range"]["host_cpu_s_per_step"] == (0.20, 0.30)
    assert c4["comm_cut_vs_ddp_fp32"] == pytest.approx(0.70 / 0.16)  # ratio of the medians
    assert c4["comm_over_ideal"] == pytest.approx(1.6)
    assert by["single process (start)"]["step_s"] == pytest.approx(0.15)

    verdicts = {v.on_medians.key: v for v in judge(THREE_RUNS)}
    fp32 = verdicts["comm_cut_vs_ddp_fp32:cgx-4bit"]  # met on the medians, missed in run 2: not met
    assert fp32.on_medians.ok and fp32.every_run and not fp32.ok
    assert [c.value for _, c in fp32.per_run] == ["4.29x", "3.81x", "4.38x"]
    assert [label for label, _ in fp32.per_run] == ["run 1", "run 2", "run 3"]
    assert fp32.met_in == (2, 3)
    fp16 = verdicts["comm_cut_vs_ddp_fp16:cgx-4bit"]  # 3.21x, 2.14x, 2.81x: met in every run
    assert fp16.ok and fp16.met_in == (3, 3)
    cpu = verdicts["cpu_over_compute:cgx-4bit"]  # judged on the medians (0.22 / 0.16), run 1 (1.88x) listed
    assert cpu.ok and not cpu.every_run and cpu.met_in == (2, 3)
    assert not verdicts["comm_over_ideal:cgx-4bit"].ok  # 1.6x > 1.5x

    text = markdown(THREE_RUNS)
    assert "**medians over 3 runs [min-max]**" in text
    assert "| cgx-ps 4-bit | 0.310 [0.290-0.360] | 0.220 [0.200-0.300] |" in text
    assert "| configuration | run 1 | run 2 | run 3 |" in text  # what the medians were taken over
    assert "| cgx-ps 4-bit | 0.290 / 0.140 | 0.360 / 0.210 | 0.310 / 0.160 |" in text
    assert ("- FAIL: on the medians, cgx-ps 4-bit: comm time 0.160 s vs DDP gloo fp32's 0.700 s: cut 4.38x (target >= 4x); "
            "per run: 4.29x, 3.81x (FAIL), 4.38x: met in 2 of 3 runs (required in every run)") in text
    assert "- PASS: on the medians, cgx-ps 4-bit: CPU per step per host 0.220 s" in text


# The raw data plane's configurations beside gRPC's, in the same three runs: the raw plane's cut vs
# DDP fp32 is 5.00x, 3.81x (missed in run 2), 5.83x; its hook steps 0.30/0.40/0.33 against its
# own optimizer's 0.27/0.36/0.27 (1.22x on the medians: missed), not against gRPC's optimizer
RAW_COMM = ({"cgx-4bit-raw": 0.12, "ddp-cgx-4bit-raw": 0.15}, {"cgx-4bit-raw": 0.21, "ddp-cgx-4bit-raw": 0.25},
            {"cgx-4bit-raw": 0.12, "ddp-cgx-4bit-raw": 0.18})
WITH_RAW = [r for run, (comm, raw) in enumerate(zip(({"ddp-fp32": 0.60, "ddp-fp16": 0.45, "cgx-4bit": 0.14},
                                                     {"ddp-fp32": 0.80, "ddp-fp16": 0.45, "cgx-4bit": 0.21},
                                                     {"ddp-fp32": 0.70, "ddp-fp16": 0.45, "cgx-4bit": 0.16}),
                                                    RAW_COMM), 1)
            for r in make_run(run, {**comm, **raw}, {c: 0.20 if c.startswith("ddp-f") else 0.25 for c in {**comm, **raw}})]


def test_the_raw_plane_configurations_are_judged_too():
    verdicts = {v.on_medians.key: v for v in judge(WITH_RAW)}
    assert {k for k in verdicts if k.endswith(":cgx-4bit-raw")} == {
        f"{t}:cgx-4bit-raw" for t in ("comm_cut_vs_ddp_fp32", "comm_cut_vs_ddp_fp16", "comm_over_ideal",
                                      "cpu_over_compute", "hook_over_optimizer", "loss_rel")}
    fp32 = verdicts["comm_cut_vs_ddp_fp32:cgx-4bit-raw"]  # 0.70 / 0.12 on the medians, run 2 missed
    assert fp32.on_medians.ok and fp32.every_run and not fp32.ok and fp32.met_in == (2, 3)
    assert [c.value for _, c in fp32.per_run] == ["5.00x", "3.81x", "5.83x"]
    assert verdicts["comm_cut_vs_ddp_fp16:cgx-4bit-raw"].ok  # 3.75x, 2.14x, 3.75x
    hook = verdicts["hook_over_optimizer:cgx-4bit-raw"]  # the raw hook against the raw optimizer
    assert hook.on_medians.value == f"{(0.15 + 0.18) / (0.15 + 0.12):.2f}x" and not hook.ok
    assert "hook_over_optimizer:cgx-4bit" not in verdicts  # gRPC's hook was not run: nothing to judge
    assert {target_of(k) for k in verdicts if k.endswith(":cgx-4bit")} == {
        "comm_cut_vs_ddp_fp32", "comm_cut_vs_ddp_fp16", "comm_over_ideal", "cpu_over_compute", "loss_rel"}

    text = markdown(WITH_RAW)
    assert ("- FAIL: on the medians, cgx-ps 4-bit, raw plane: comm time 0.120 s vs DDP gloo fp32's 0.700 s: cut "
            "5.83x (target >= 4x); per run: 5.00x, 3.81x (FAIL), 5.83x: met in 2 of 3 runs (required in every run)"
            ) in text
    assert "- FAIL: on the medians, cgx-ps 4-bit, raw plane: DDP + cgx-ps hook 4-bit, raw plane step 0.330 s" in text


def test_the_raw_plane_figures_in_benchmarks_md_come_out_of_the_report():
    """benchmarks/results/cluster-1gbit-150steps-3runs-grpc-vs-raw-slower-host.json, the run BENCHMARKS.md's
    slower-host raw-plane figures are from: the report judges cgx-4bit-raw itself, not by hand."""
    rows, _ = cluster_report.load_results([str(Path(__file__).resolve().parents[2] / "benchmarks" / "results"
                                               / "cluster-1gbit-150steps-3runs-grpc-vs-raw-slower-host.json")])
    verdicts = {v.on_medians.key: v for v in judge(rows)}

    def figures(target: str) -> tuple[str, list[str], bool]:
        v = verdicts[f"{target}:cgx-4bit-raw"]
        return v.on_medians.value, [c.value for _, c in v.per_run], v.ok

    assert figures("comm_cut_vs_ddp_fp32") == ("6.22x", ["6.22x", "6.28x", "6.25x"], True)
    assert figures("comm_cut_vs_ddp_fp16") == ("3.72x", ["3.74x", "3.67x", "3.71x"], True)
    assert figures("comm_over_ideal") == ("1.38x", ["1.38x", "1.36x", "1.39x"], True)
    assert figures("cpu_over_compute") == ("1.61x", ["1.59x", "1.60x", "1.62x"], False)
    assert verdicts["comm_over_ideal:cgx-4bit"].on_medians.value == "1.51x"  # gRPC's beside it, as before
    assert "cgx-ps 4-bit, raw plane: comm time 0.097 s vs DDP gloo fp32's 0.600 s" in markdown(rows)


def test_one_run_reads_as_before():
    """A single run's report keeps its former shape: the figures alone, no ranges, no run table."""
    text = markdown(THREE_RUNS[:5])
    assert "| cgx-ps 4-bit | 0.290 | 0.300 | 2.59x | 0.140 |" in text
    assert "- PASS: cgx-ps 4-bit: comm time 0.140 s vs DDP gloo fp32's 0.600 s: cut 4.29x (target >= 4x)" in text
    assert "single-process compute 0.150 s/step (the smaller of 0.150, 0.150 measured" in text
    assert "[" not in text.split("Targets")[0] and "run 1 |" not in text


def test_repeated_sweep_interleaves_runs(tmp_path, monkeypatch):
    """cluster.py --repeat 3 at two rates: run 1 of both rates, then run 2, ...; the JSON keeps every
    run's rows and the report takes the medians.  The emulated cluster (root, namespaces) is
    replaced by synthetic groups: what is under test is the sweep around it."""
    ran = []

    def fake_group(model, rate, topology, args, run):
        ran.append((run, rate))
        return make_run(run, {"ddp-fp32": 0.6 * run, "cgx-4bit": 0.1 * run}, {"ddp-fp32": 0.2, "cgx-4bit": 0.3},
                        rate=rate)

    monkeypatch.setattr(cluster, "run_group", fake_group)
    monkeypatch.setattr(cluster.nc, "require_root", lambda: None)
    out, links = tmp_path / "r.json", tmp_path / "links.png"
    assert cluster.main(["--repeat", "3", "--rates", "1gbit", "10gbit", "--configs", "ddp-fp32", "cgx-4bit",
                         "--json", str(out), "--links-png", str(links)]) == 0
    assert ran == [(1, "1gbit"), (1, "10gbit"), (2, "1gbit"), (2, "10gbit"), (3, "1gbit"), (3, "10gbit")]
    saved = json.loads(out.read_text())
    assert saved["args"]["repeat"] == 3 and len(saved["rows"]) == 6 * 4
    assert [r["run"] for r in saved["rows"] if r["config"] == "cgx-4bit"] == [1, 1, 2, 2, 3, 3]
    assert "| cgx-ps 4-bit | 0.350 [0.250-0.450] |" in markdown(saved["rows"])
    assert links.read_bytes()[:8] == PNG_MAGIC
    with pytest.raises(SystemExit):
        cluster.parse_args(["--repeat", "0"])


def test_merged_files_report_and_charts(tmp_path, capsys):
    """Two invocations at different times (one with --repeat 2, one written before --repeat
    existed, without run numbers) at three link rates: one report, both charts."""
    rates = {"100mbit": 8.0, "1gbit": 1.0, "10gbit": 0.1}  # comm time scales with the link
    a = [r for run in (1, 2) for rate, k in rates.items()
         for r in make_run(run, {"ddp-fp32": 0.6 * k * run, "cgx-4bit": 0.1 * k * run},
                           {"ddp-fp32": 0.2, "cgx-4bit": 0.3}, rate=rate)]
    b = [{k: v for k, v in r.items() if k != "run"} for rate, k in rates.items()
         for r in make_run(1, {"ddp-fp32": 0.6 * k * 3, "cgx-4bit": 0.1 * k * 3},
                           {"ddp-fp32": 0.2, "cgx-4bit": 0.3}, rate=rate)]
    paths = [tmp_path / "a.json", tmp_path / "b.json"]
    for path, rows in zip(paths, (a, b)):
        path.write_text(json.dumps({"args": {}, "started": "2026-11-23T21:00:00", "rows": rows}))
    md, bars, links = tmp_path / "r.md", tmp_path / "bars.png", tmp_path / "links.png"
    assert cluster_report.main(["--json", *map(str, paths), "--markdown", str(md), "--png", str(bars),
                                "--links-png", str(links)]) == 0
    text = md.read_text()
    assert capsys.readouterr().out == text + "\n"  # the report also goes to stdout
    assert "3 runs merged from 2 files" in text and "- a.json: started 2026-11-23T21:00:00, 2 runs, 24 rows" in text
    assert "| configuration | a.json run 1 | a.json run 2 | b.json run 1 |" in text
    assert text.count("**medians over 3 runs [min-max]**") == 3  # a table per link rate
    assert bars.read_bytes()[:8] == PNG_MAGIC and links.read_bytes()[:8] == PNG_MAGIC

    rows, _ = cluster_report.load_results([str(p) for p in paths])
    (panel,) = link_series(rows).values()  # one model/topology/hosts: one panel, a line per configuration
    assert set(panel) == {"single", "ddp-fp32", "cgx-4bit"}
    cgx = panel["cgx-4bit"]  # sorted by rate; runs 1..3 have comm k x 0.1 x run: the median is run 2's
    assert [p.rate_bps for p in cgx] == [100_000_000, 1_000_000_000, 10_000_000_000]
    assert [x for p in cgx for x in (p.step_s, p.lo, p.hi, p.n)] == pytest.approx(
        [0.15 + 1.6, 0.15 + 0.8, 0.15 + 2.4, 3, 0.35, 0.25, 0.45, 3, 0.17, 0.16, 0.18, 3])
    assert [p.step_s for p in panel["single"]] == [0.15, 0.15, 0.15]  # the compute line
    assert [rate_label(p.rate_bps) for p in cgx] == ["100 Mbit/s", "1 Gbit/s", "10 Gbit/s"]
    assert rate_label(2.5e9) == "2.5 Gbit/s"

    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"rows": [{"config": "cgx-4bit"}]}))
    assert cluster_report.main(["--json", str(bad)]) == 2
    assert "bad.json: row 0 lacks label" in capsys.readouterr().err
