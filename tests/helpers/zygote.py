"""The test suite's preloaded interpreter: one process per pytest worker that has imported
torch and torchtitan once and forks the suite's train.py, torchrun and dry-run processes.

Why: a process that imports torchtitan spends ~4.4 CPU-seconds on imports before its first
step (torch 1.2, torchtitan's dependencies ~3: inductor, DTensor, datasets), and the
integration tier starts about 200 of them: about half of its CPU time on two cores. A fork
of a process that has already imported them costs milliseconds.

How: `python()` starts the server (this file run as a script) on first use and returns the
path of a small executable, the *shim*, that tests put where `sys.executable` was (and in
`PYTHON_EXEC`, which torchrun reads for its workers' interpreter, as does tools.dryrun's
runner). The shim is a Python without `site` (~10 ms) that sends its arguments, environment,
working directory and its stdin/stdout/stderr to the server over a Unix socket; the server
forks a child that takes them over and runs the program as `python` would, and the shim
mirrors the child's end: the same exit code, or death by the same signal. Signals sent to
the shim (torchrun's SIGTERM, a test's SIGTERM or SIGHUP) are forwarded to the child; if the
shim is killed (SIGKILL, a test's timeout) the server, which sees the shim's connection
close, SIGKILLs the child at once (no thread of ours runs in the program).

What it preserves, what it does not (why the list below is short):
- Only programs in ENTRY_POINTS run in the server: train.py, torchrun, the dry run, the
  tools and test workers that import torch and torchtitan normally. Anything else, a
  program that must run before torch is imported (tests/integration/_old_torch_worker.py),
  an unknown interpreter option, or a server that is not running: the shim `exec`s the real
  interpreter with the same arguments.
- `os.getppid()` in the child returns the shim's parent (core.errors' hand-over checks it).
- Not preserved: /proc/<shim pid> is not the program's (tests that read a process's /proc,
  its children or RUSAGE_CHILDREN keep `sys.executable`); interpreter-start warnings of
  torch's imports are printed once by the server, not by each program.
- The README's commands run real processes (`child_env(preloaded=False)`), so the plain
  path stays proven; tests/integration/test_zygote.py compares this one with it.

TITANSCALE_TEST_ZYGOTE=0 turns it off: `python()` returns `sys.executable`.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# What the server imports before it forks: what every torchtitan process imports anyway
# (nothing of ours, so a program reads its own checkout and its own environment).
PRELOAD = ("torch", "torchtitan.train")

# Programs that may run in a fork of the server: scripts relative to the checkout, modules.
ENTRY_POINTS = frozenset({
    "train.py", "tests/integration/_hf_interop_worker.py",
    "tests/integration/_one_process_worker.py", "tests/helpers/placed_mesh_worker.py",
    "tests/helpers/adapters_dp_worker.py", "tests/helpers/train_placed.py",
    "tests/helpers/doc_mask_tp_worker.py", "tests/helpers/resource_worker.py",
    "tests/helpers/resource_decode_worker.py",
    "-m torch.distributed.run", "-m tools.torchrun", "-m tools.dryrun", "-m tools.serve",
    "-m tools.seed_checkpoint", "-m tools.prepare_data", "-m tools.bench", "-m tools.packstats",
    "-m tools.preflight",
})  # fmt: skip

_OFF = os.environ.get("TITANSCALE_TEST_ZYGOTE") == "0"
_state: dict[str, object] = {}

SHIM = '''#!{python} -S
"""Run this program in the preloaded test interpreter (tests/helpers/zygote.py)."""
import json, os, signal, socket, struct, sys

REAL, SOCK = {python!r}, {sock!r}
args = sys.argv[1:]
try:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(SOCK)
except OSError:
    os.execv(REAL, [REAL, *args])
child = [0]
pending = []


def forward(sig, _frame):
    if child[0]:
        try:
            os.kill(child[0], sig)
        except ProcessLookupError:
            pass
    else:
        pending.append(sig)


for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
            signal.SIGUSR2, signal.SIGALRM):
    signal.signal(sig, forward)
fds = []
for fd in (0, 1, 2):
    try:
        os.fstat(fd)
        fds.append(fd)
    except OSError:
        fds.append(os.open(os.devnull, os.O_RDWR))
request = json.dumps({{"argv": args, "env": dict(os.environ), "cwd": os.getcwd(),
                      "ppid": os.getppid()}}).encode()
socket.send_fds(conn, [struct.pack("!I", len(request))], fds)
conn.sendall(request)
reply = conn.makefile("rb")
line = reply.readline()
if line.startswith(b"fallback"):
    conn.close()
    os.execv(REAL, [REAL, *args])
if not line.startswith(b"pid "):
    sys.stderr.write("tests/helpers/zygote.py: the server closed the connection\\n")
    os._exit(1)
child[0] = int(line.split()[1])
for sig in pending:
    forward(sig, None)
line = reply.readline()
if not line:
    try:
        os.kill(child[0], signal.SIGKILL)
    except ProcessLookupError:
        pass
    sys.stderr.write("tests/helpers/zygote.py: the server exited before the program\\n")
    os._exit(1)
kind, number = line.split()
if kind == b"exit":
    os._exit(int(number))
if int(number) not in (signal.SIGKILL, signal.SIGSTOP):
    signal.signal(int(number), signal.SIG_DFL)
os.kill(os.getpid(), int(number))
os._exit(128 + int(number))
'''


def python() -> str:
    """The interpreter path for a test's command line: the shim (server started on first
    use, stopped when this process exits), or sys.executable when turned off."""
    if _OFF:
        return sys.executable
    shim = _state.get("shim")
    if shim is None:
        folder = tempfile.mkdtemp(prefix="ts-zygote-")
        sock = os.path.join(folder, "sock")
        shim_path = os.path.join(folder, "python")
        with open(shim_path, "w") as f:
            f.write(SHIM.format(python=sys.executable, sock=sock))
        os.chmod(shim_path, 0o755)
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        server = subprocess.Popen(
            [sys.executable, "-u", __file__, sock], cwd=ROOT, env=env,
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        atexit.register(_stop, server, folder)
        _state["server"] = server
        # The server listens once its imports are done (~5 s); a shim that finds no socket
        # runs the real interpreter, so waiting is only about not paying twice.
        deadline = time.monotonic() + 120
        while not os.path.exists(sock) and server.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        _state["shim"] = shim = shim_path
    return str(shim)


def _stop(server: subprocess.Popen, folder: str) -> None:
    import shutil

    server.terminate()
    try:
        server.wait(10)
    except subprocess.TimeoutExpired:
        server.kill()
    shutil.rmtree(folder, ignore_errors=True)


# ---------------------------------------------------------------------------------------
# The server (this file run as a script). Single-threaded: it only accepts, forks and reaps,
# so a fork never copies a lock another thread holds.


def _entry(argv: list[str], cwd: str) -> dict | None:
    """Parse a python command line run in `cwd` into its flags and program when that program
    is in ENTRY_POINTS, else None (the shim runs the real interpreter). -u and -s are
    accepted and need nothing: the server's streams are unbuffered, its site is the
    installation's."""
    flags: dict = {"B": False, "W": [], "X": []}
    i = 0
    while i < len(argv) and argv[i].startswith("-") and argv[i] != "-":
        a = argv[i]
        if a in ("-u", "-s", "-B"):
            flags["B"] = flags["B"] or a == "-B"
        elif a in ("-W", "-X") and i + 1 < len(argv):
            flags[a[1]].append(argv[i + 1])
            i += 1
        elif a == "-m" and i + 1 < len(argv):
            flags["module"] = argv[i + 1]
            flags["args"] = argv[i + 2 :]
            return flags if f"-m {argv[i + 1]}" in ENTRY_POINTS else None
        else:
            return None
        i += 1
    if i >= len(argv) or argv[i] == "-":
        return None
    flags["script"] = argv[i]
    flags["args"] = argv[i + 1 :]
    script = os.path.realpath(os.path.join(cwd, argv[i]))
    return flags if os.path.relpath(script, ROOT) in ENTRY_POINTS else None


def _serve(sock_path: str) -> None:
    import json
    import selectors
    import signal
    import socket
    import struct

    for name in PRELOAD:
        __import__(name)
    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(sock_path + ".tmp")
    listener.listen(64)
    os.rename(sock_path + ".tmp", sock_path)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ)
    children: dict[int, socket.socket] = {}
    while os.getppid() == parent:
        for key, _ in sel.select(timeout=0.05):
            if key.fileobj is not listener:
                # A shim's connection became readable: the shim ended before its program
                # (SIGKILL, a test's timeout; it never writes again). The program follows.
                sel.unregister(key.fileobj)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(key.data, signal.SIGKILL)
                continue
            conn, _ = listener.accept()
            conn.settimeout(30)
            try:
                head, fds, _flags, _addr = socket.recv_fds(conn, 4, 3)
                size = struct.unpack("!I", head)[0]
                data = b""
                while len(data) < size:
                    chunk = conn.recv(size - len(data))
                    if not chunk:
                        raise OSError("short request")
                    data += chunk
                request = json.loads(data)
            except (OSError, ValueError, struct.error):
                conn.close()
                continue
            conn.settimeout(None)
            flags = _entry(request["argv"], request["cwd"])
            if flags is None:
                for fd in fds:
                    os.close(fd)
                conn.sendall(b"fallback\n")
                conn.close()
                continue
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                sel.close()
                listener.close()
                for other in children.values():
                    other.close()
                _child(conn, fds, request, flags)  # never returns
            for fd in fds:
                os.close(fd)
            children[pid] = conn
            conn.sendall(b"pid %d\n" % pid)
            sel.register(conn, selectors.EVENT_READ, pid)
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is None:
                continue
            with contextlib.suppress(KeyError, ValueError):
                sel.unregister(conn)
            if os.WIFSIGNALED(status):
                msg = b"signal %d\n" % os.WTERMSIG(status)
            else:
                msg = b"exit %d\n" % os.waitstatus_to_exitcode(status)
            with contextlib.suppress(OSError):
                conn.sendall(msg)
            conn.close()
    for pid in children:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _child(conn, fds: list[int], request: dict, flags: dict) -> None:
    """In the fork: become the program `request` describes, then exit as python would."""
    import runpy
    import signal
    import threading
    import traceback

    code = 1
    try:
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
                    signal.SIGUSR2, signal.SIGALRM, signal.SIGCHLD):  # fmt: skip
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)

        conn.close()  # the server answers the shim; a shim that dies is the server's to see
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            if fd > 2:
                os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        shim_parent = int(request["ppid"])
        os.getppid = lambda: shim_parent  # type: ignore[assignment]
        sys.dont_write_bytecode = flags["B"] or bool(os.environ.get("PYTHONDONTWRITEBYTECODE"))
        import warnings

        for w in [*filter(None, os.environ.get("PYTHONWARNINGS", "").split(",")), *flags["W"]]:
            warnings._setoption(w)  # type: ignore[attr-defined]
        if "faulthandler" in flags["X"] or os.environ.get("PYTHONFAULTHANDLER"):
            import faulthandler

            faulthandler.enable()
        # sys.path as the program's own interpreter would build it: its folder (a script) or
        # the working directory (-m), then $PYTHONPATH, then the installation's paths.
        own = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        base = [p for p in sys.path[1:] if p not in _SERVER_PYTHONPATH]
        if "module" in flags:
            first = os.getcwd()
        else:
            first = os.path.dirname(os.path.realpath(flags["script"]))
        sys.path[:] = [first, *own, *base]
        import importlib

        importlib.invalidate_caches()
        try:
            if "module" in flags:
                sys.argv = [flags["module"], *flags["args"]]
                runpy.run_module(flags["module"], run_name="__main__", alter_sys=True)
            else:
                sys.argv = [flags["script"], *flags["args"]]
                runpy.run_path(flags["script"], run_name="__main__")
            code = 0
        except SystemExit as e:
            if e.code is None:
                code = 0
            elif isinstance(e.code, int):
                code = e.code
            else:
                print(e.code, file=sys.stderr)
                code = 1
        except KeyboardInterrupt:
            traceback.print_exc()
            code = -signal.SIGINT
        except BaseException:
            sys.excepthook(*sys.exc_info())
            code = 1
        threading._shutdown()  # type: ignore[attr-defined]  # join non-daemon threads
        atexit._run_exitfuncs()
    except BaseException:
        traceback.print_exc()
        code = 1
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except Exception:
        pass
    if code < 0:  # interrupted: die by the signal, as python does
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code & 0xFF)


_SERVER_PYTHONPATH = frozenset(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p)

if __name__ == "__main__":
    _serve(sys.argv[1])
