"""Benchmarks: each script measures cgx-ps against its peer in the same run (results in BENCHMARKS.md).

Every script runs as ``python benchmarks/NAME.py`` (as BENCHMARKS.md shows) or as
``python -m benchmarks.NAME`` from the repository root; tests import the modules as
``from benchmarks import netcluster``. The emulated cluster's parts (netns, emulator, linkprobe,
jobs, shards, procstat) are listed in ``benchmarks/netcluster.py``; the training workload the
step scripts share is ``benchmarks/workload.py``.
"""
