"""A persistent group of processes (MPI ranks, say), serving one example at a time.

Launching N processes costs about a second; hypothesis runs hundreds of
examples and replays dozens while it shrinks. So a multi-process
implementation is launched once per world size and served one request at a
time: the test process listens on a Unix socket, rank 0 of the group connects
to it, reads a request, shares it with the other ranks, and sends back the
list of every rank's reply. Messages are pickled and framed by the standard
library (`multiprocessing.connection`). Any MPI program can serve with
`serve_requests`, given its own broadcast and gather:

    group = ProcessGroup(["mpiexec", "-n", "4", sys.executable, "worker.py", "--serve", "{socket}"])
    replies = group.request({"case": ...})       # one reply per rank
    group.close()

(PyTorch and JAX rings have harnesses of their own, `reference.testing.harness`.)
"""

import os
import signal
import subprocess
import tempfile
import threading
import time
import traceback
from multiprocessing.connection import Client, Listener


class ProcessGroup:
    """N processes launched once by `command` (a list; "{socket}" in it is
    replaced by the socket's path), answering `request(message)` one at a time.
    Every wait has a timeout: the group is killed and TimeoutError raised with
    the tail of its output, never a hang."""

    def __init__(self, command, *, timeout=120, start_timeout=120, env=None, cwd=None):
        self.timeout = timeout
        self._dir = tempfile.TemporaryDirectory(prefix="ring-group-")
        self._listener = Listener(os.path.join(self._dir.name, "socket"), family="AF_UNIX")
        self._log = open(os.path.join(self._dir.name, "output.txt"), "w+")
        self._conn = None
        self.command = [str(a).replace("{socket}", self._listener.address) for a in command]
        self._proc = subprocess.Popen(self.command, env=env, cwd=cwd, stdin=subprocess.DEVNULL,
                                      stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        self._conn = self._accept(start_timeout)

    def _accept(self, start_timeout):
        """Rank 0's connection, or a TimeoutError when it has not come within
        `start_timeout` s (or the group has exited). `Listener.accept` has no
        timeout: it waits on a thread, woken by a connection of our own."""
        accepted = []
        thread = threading.Thread(target=lambda: accepted.append(self._listener.accept()), daemon=True)
        thread.start()
        deadline = time.monotonic() + start_timeout
        while thread.is_alive():
            thread.join(0.2)
            if thread.is_alive() and (self._proc.poll() is not None or time.monotonic() > deadline):
                Client(self._listener.address, family="AF_UNIX").close()
                thread.join()
                accepted[0].close()
                self._fail(f"did not connect within {start_timeout} s")
        return accepted[0]

    def request(self, message):
        """Send `message`, return the list of every rank's reply."""
        try:
            self._conn.send(message)
            if not self._conn.poll(self.timeout):
                raise TimeoutError("nothing came back")
            replies = self._conn.recv()
        except (OSError, EOFError) as e:       # TimeoutError is an OSError
            self._fail(f"no reply within {self.timeout} s ({type(e).__name__}: {e})")
        for rank, (status, value) in enumerate(replies):
            if status == "error":
                raise RuntimeError(f"rank {rank} of {' '.join(self.command)} raised:\n{value}")
        return [value for _, value in replies]

    def output(self):
        self._log.flush()
        self._log.seek(0)
        return self._log.read()

    def _fail(self, why):
        tail = self.close(polite=False)
        raise TimeoutError(f"{' '.join(self.command)}: {why}; its output ends:\n{tail[-3000:]}")

    def close(self, polite=True):
        """Stop the group (a polite request, then a kill); returns its output."""
        if self._log.closed:                   # closed already (after a failure)
            return ""
        if polite and self._proc.poll() is None and self._conn is not None:
            try:
                self._conn.send(None)
                self._proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):       # a group that does not stop is killed below
                pass
        if self._proc.poll() is None:
            os.killpg(self._proc.pid, signal.SIGKILL)
            self._proc.wait()
        text = self.output()
        for x in (self._conn, self._listener):
            if x is not None:
                x.close()
        self._conn = None
        self._log.close()
        self._dir.cleanup()
        return text


def serve_requests(socket_path, rank, handle, *, broadcast, gather):
    """The group's side of `ProcessGroup`: rank 0 connects to `socket_path`;
    then, until the message None, every rank gets each request through
    `broadcast` (from rank 0), answers `handle(request)` (an exception becomes
    ("error", its traceback)), and rank 0 sends the `gather`ed replies."""
    conn = Client(socket_path, family="AF_UNIX") if rank == 0 else None
    while True:
        request = broadcast(conn.recv() if rank == 0 else None)
        if request is None:
            break
        try:
            reply = ("ok", handle(request))
        except Exception:            # noqa: BLE001 - reported to the test process, which raises it
            reply = ("error", traceback.format_exc())
        replies = gather(reply)
        if rank == 0:
            conn.send(replies)
    if conn is not None:
        conn.close()
