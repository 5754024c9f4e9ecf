"""Skip the emulated-cluster tests where they cannot run (not root, no `ip netns`); process checks."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from benchmarks.netns import EmulatedCluster, requirements_problem


@pytest.fixture
def emulation() -> None:
    problem = requirements_problem()
    if problem:
        pytest.skip(f"emulated cluster unavailable here: {problem}")


def processes_mentioning(text: str) -> list[int]:
    """Pids of live processes whose command line contains ``text`` (e.g. a test's tmp folder)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if text in (proc / "cmdline").read_bytes().decode(errors="replace"):
                    pids.append(int(proc.name))
            except OSError:
                pass  # exited meanwhile
    return pids


def send_between(cluster: EmulatedCluster, src: int, dst: int, nbytes: int, port: int = 5999) -> None:
    """``nbytes`` over TCP from rank ``src``'s namespace to rank ``dst``'s address; asserts all arrived."""
    server = textwrap.dedent(f"""
        import socket
        s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("{cluster.address(dst)}", {port})); s.listen(1); print("ready", flush=True)
        c, _ = s.accept(); got = 0
        while got < {nbytes}:
            b = c.recv(1 << 16)
            if not b: break
            got += len(b)
        print(got)
    """)
    client = f"import socket; socket.create_connection(('{cluster.address(dst)}', {port})).sendall(b'x' * {nbytes})"
    with subprocess.Popen(
        [*cluster.exec_prefix(dst), sys.executable, "-c", server], stdout=subprocess.PIPE, text=True
    ) as srv:
        assert srv.stdout is not None and srv.stdout.readline().strip() == "ready"
        subprocess.run([*cluster.exec_prefix(src), sys.executable, "-c", client], check=True, timeout=60)
        assert int(srv.stdout.readline()) == nbytes
