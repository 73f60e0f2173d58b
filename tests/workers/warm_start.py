"""Worker processes forked from a process that has imported torch already.

A worker script started as ``python tests/workers/NAME.py`` spends about 3 of its 3.5 CPU-seconds
importing torch and, at its optimizer's first use, ``torch._dynamo`` (sympy included). The suite
starts some 300 of them on 2 cores. ``start_worker`` hands the start to a zygote: one process per
test process (this file run as a script) that imports torch and torch._dynamo once, starts no
thread and opens no connection, and forks a child per worker. The child takes the test's argv,
environment, working directory and stdin/stdout/stderr, and runs the script as ``__main__``; the
rest (cgx_ps, grpc, numba) it imports itself, as a fresh process does. What a test gets back is a
``subprocess.Popen``: pid, pipes, ``communicate``, ``wait``, signals, and the exit code, which
the zygote (the child's parent) reports.

What differs from a fresh interpreter: the parent pid (the zygote's), the str hash seed (shared
by the children; ``random`` and numpy are reseeded), and torch's module-level state, set at import
before the child's environment applied (OMP_NUM_THREADS is applied to torch after). Tests that
check how a process is started (the CLI, the examples, torchrun) start real processes instead.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

__all__ = ["run_worker", "start_worker"]

WORKERS = Path(__file__).resolve().parent
MAX_MESSAGE = 1 << 20


class _Zygote:
    """This test process's zygote: spawn requests out, pids and exit codes back (a reader thread)."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.process = subprocess.Popen([sys.executable, __file__], pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL,
                                        env={**os.environ, "CGX_PS_ZYGOTE_FD": str(theirs.fileno())})
        theirs.close()
        self.sock = ours
        self.lock = threading.Lock()  # one spawn request at a time: its reply is the next "pid" message
        self.changed = threading.Condition()
        self.replies: list[dict] = []
        self.exits: dict[int, int] = {}  # spawn id -> exit code (negative: the signal)
        self.gone = False
        threading.Thread(target=self._read, name="warm-start-zygote", daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                data = self.sock.recv(MAX_MESSAGE)
            except OSError:
                data = b""
            with self.changed:
                if not data:
                    self.gone = True
                else:
                    message = json.loads(data)
                    if "exit" in message:
                        self.exits[message["exit"]] = message["code"]
                    else:
                        self.replies.append(message)
                self.changed.notify_all()
            if not data:
                return

    def spawn(self, argv: list[str], env: dict[str, str], cwd: str, new_session: bool,
              fds: list[int]) -> tuple[int, int]:
        """Fork a child running ``argv`` (python, script, args...) with ``fds`` as its stdin,
        stdout and stderr; its pid and its spawn id."""
        request = json.dumps({"argv": argv, "env": env, "cwd": cwd, "new_session": new_session}).encode()
        with self.lock:
            socket.send_fds(self.sock, [request], fds)
            with self.changed:
                if not self.changed.wait_for(lambda: self.replies or self.gone, timeout=60) or not self.replies:
                    raise OSError("the warm-start zygote did not answer a spawn request")
                reply = self.replies.pop(0)
        if "error" in reply:
            raise OSError(f"the warm-start zygote could not fork: {reply['error']}")
        return reply["pid"], reply["id"]

    def exit_code(self, spawn_id: int, timeout: float | None) -> int | None:
        """The child's exit code, waiting up to ``timeout`` s (None: for good; 0: not at all)."""
        with self.changed:
            self.changed.wait_for(lambda: spawn_id in self.exits or self.gone, timeout=timeout)
            if spawn_id not in self.exits and self.gone:
                raise ChildProcessError("the warm-start zygote exited: a child's exit code is lost")
            return self.exits.get(spawn_id)


_zygote: _Zygote | None = None
_zygote_lock = threading.Lock()


def _the_zygote() -> _Zygote:
    global _zygote
    with _zygote_lock:
        if _zygote is None or _zygote.gone:
            _zygote = _Zygote()
        return _zygote


class _WarmPopen(subprocess.Popen):
    """``subprocess.Popen`` whose child the zygote forks instead of ``fork_exec``."""

    def _execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo,
                       creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite,
                       restore_signals, gid, gids, uid, umask, start_new_session, process_group) -> None:
        if preexec_fn is not None or pass_fds or shell or executable or gid is not None or gids or uid is not None \
                or umask != -1 or process_group not in (None, -1):
            raise ValueError("start_worker takes argv, env, cwd, the standard streams and start_new_session only")
        zygote = _the_zygote()
        fds = [p2cread if p2cread != -1 else 0, c2pwrite if c2pwrite != -1 else 1, errwrite if errwrite != -1 else 2]
        self.pid, self._spawn_id = zygote.spawn([os.fspath(a) for a in args], dict(os.environ if env is None else env),
                                               os.fspath(cwd) if cwd is not None else os.getcwd(),
                                               bool(start_new_session), fds)
        self._zygote = zygote
        self._child_created = True
        self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)

    def _internal_poll(self, _deadstate=None, **_):  # noqa: ANN001 (Popen's signature)
        if self.returncode is None:
            try:
                self.returncode = self._zygote.exit_code(self._spawn_id, timeout=0)
            except ChildProcessError:
                if _deadstate is not None:
                    self.returncode = _deadstate
        return self.returncode

    def _wait(self, timeout: float | None) -> int:
        if self.returncode is None:
            code = self._zygote.exit_code(self._spawn_id, timeout=timeout)
            if code is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self.returncode = code
        return self.returncode


def start_worker(args: list[str], **popen_kwargs) -> subprocess.Popen:
    """``subprocess.Popen(args, **popen_kwargs)`` for ``args`` = [sys.executable, a script in
    tests/workers, its arguments...], forked from the zygote; any other command is started as
    usual. CGX_PS_TEST_WARM_START=0 starts every worker as a fresh process."""
    script = Path(args[1]).resolve() if len(args) > 1 and args[0] == sys.executable else None
    if script is None or script.parent != WORKERS or os.environ.get("CGX_PS_TEST_WARM_START", "1") == "0":
        return subprocess.Popen(args, **popen_kwargs)
    return _WarmPopen(args, **popen_kwargs)


def run_worker(args: list[str], *, timeout: float | None = None, capture_output: bool = False,
               **popen_kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run(args, ...)`` through ``start_worker`` (the child killed at the timeout)."""
    if capture_output:
        popen_kwargs.update(stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    with start_worker(args, **popen_kwargs) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


# --- the zygote ---------------------------------------------------------------------------------

def _run_child(request: dict, fds: list[int], sock: socket.socket, wakeup: tuple[int, int]) -> None:
    """In the forked child: become the worker ``request`` describes and run it. Its exception or
    SystemExit ends this process as it would a fresh one; when the script runs to its end, the
    caller exits with 0."""
    import random
    import runpy
    import signal

    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    sock.close()
    for fd in wakeup:
        os.close(fd)
    if request["new_session"]:
        os.setsid()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in fds:
        if fd > 2 and fd not in fds[fds.index(fd) + 1:]:
            os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    random.seed()
    import numpy
    import torch

    numpy.random.seed()
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    script = request["argv"][1]
    sys.argv = request["argv"][1:]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    for entry in reversed([e for e in os.environ.get("PYTHONPATH", "").split(os.pathsep) if e]):
        if entry not in sys.path:
            sys.path.insert(1, entry)
    # sys.stdin/stdout/stderr wrap fds 0-2, now the test's: block-buffered on a pipe, as a fresh
    # interpreter's stdout is, stderr line-buffered
    runpy.run_path(script, run_name="__main__")


def _serve(sock: socket.socket) -> None:
    import selectors
    import signal

    import numpy  # noqa: F401
    import torch
    import torch._dynamo  # noqa: F401  the first optimizer's import, the larger half of the cost

    assert threading.active_count() == 1, "the zygote must start no thread: its children are forks"
    wakeup = os.pipe()
    os.set_blocking(wakeup[0], False)
    os.set_blocking(wakeup[1], False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wakeup[1])
    children: dict[int, int] = {}  # pid -> spawn id
    spawned = 0
    selector = selectors.DefaultSelector()
    selector.register(sock, selectors.EVENT_READ)
    selector.register(wakeup[0], selectors.EVENT_READ)
    while True:
        for key, _ in selector.select(timeout=1.0):
            if key.fileobj is sock:
                message, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, 3)
                if not message:
                    return  # the test process is gone; children go on as orphans, as Popen's do
                request = json.loads(message)
                spawned += 1
                try:
                    pid = os.fork()
                except OSError as e:
                    sock.send(json.dumps({"error": str(e)}).encode())
                    continue
                if pid == 0:
                    selector.close()
                    _run_child(request, fds, sock, wakeup)
                    raise SystemExit(0)  # the script ran to its end: the child exits as a fresh one would
                for fd in fds:
                    os.close(fd)
                children[pid] = spawned
                sock.send(json.dumps({"pid": pid, "id": spawned}).encode())
            else:  # SIGCHLD: drain the wakeup pipe, then reap below
                try:
                    while os.read(wakeup[0], 512):
                        pass
                except BlockingIOError:
                    pass
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            if pid in children:
                sock.send(json.dumps({"exit": children.pop(pid), "code": os.waitstatus_to_exitcode(status)}).encode())


if __name__ == "__main__":
    _serve(socket.socket(fileno=int(os.environ.pop("CGX_PS_ZYGOTE_FD"))))
