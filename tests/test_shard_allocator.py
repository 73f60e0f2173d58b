"""The shard process keeps the buffers it frees for the next round (server/process/allocator.py): a round's
worth of messages allocated and freed again must not be faulted in afresh every time."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

from cgx_ps.server.process.allocator import MMAP_THRESHOLD, TRIM_THRESHOLD, allocator_settings

# A round in miniature: 4 MiB buffers held together (a shard's messages in flight), 3/4 of the
# trim threshold in all, written (as a message is), then all freed; the minor page faults of
# rounds 2-10 are printed.
_BUFFERS = TRIM_THRESHOLD * 3 // 4 // (4 << 20)
_ROUNDS = f"""
import resource, sys
from cgx_ps.server.process.allocator import keep_freed_memory
if sys.argv[1] == "tuned":
    assert keep_freed_memory()
def round_():
    held = [bytearray(4 << 20) for _ in range({_BUFFERS})]
    del held
round_()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(9):
    round_()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def test_the_settings_are_glibcs_thresholds_unless_the_operator_tuned_malloc() -> None:
    assert allocator_settings("glibc", {"PATH": "/bin"}) == {-3: MMAP_THRESHOLD, -1: TRIM_THRESHOLD}
    assert MMAP_THRESHOLD > 8 << 20  # gRPC's largest message (transport.GRPC_OPTIONS) comes from the heaps
    assert allocator_settings("", {}) == {} and allocator_settings("musl", {}) == {}
    for env in ({"MALLOC_TRIM_THRESHOLD_": "0"}, {"MALLOC_ARENA_MAX": "2", "MALLOC_MMAP_THRESHOLD_": "1"},
                {"GLIBC_TUNABLES": "glibc.rtld.optional_static_tls=512:glibc.malloc.trim_threshold=0"}):
        assert allocator_settings("glibc", env) == {}, env
    assert allocator_settings("glibc", {"GLIBC_TUNABLES": "glibc.rtld.optional_static_tls=512"}) != {}


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc thresholds")
def test_freed_buffers_are_kept_for_the_next_round_not_faulted_in_again() -> None:
    faults = {}
    for mode in ("default", "tuned"):
        done = subprocess.run([sys.executable, "-c", _ROUNDS, mode], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        faults[mode] = int(done.stdout)
    pages = 9 * _BUFFERS * (4 << 20) // 4096  # what 9 rounds write
    assert faults["default"] > pages // 2, faults  # glibc's defaults hand the buffers back every round
    assert faults["tuned"] < pages // 20, faults
