"""Keeps a local cluster's instance processes (and its Conductor process) alive: a crashed one is reaped, the
reason logged (exit status and the last lines of its log), and started again under the same instance id after a
backoff that doubles while it keeps crashing (so a process that cannot start does not spin), as Kubernetes restarts
a crashed container.

The restarted process registers with the Conductor as before (same id: it replaces the dead registration), so the
cluster heals without its operator; requests that were running on the dead process ended with a status, and new
ones go to the live instances meanwhile.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

BACKOFF_FIRST_S = 0.5
BACKOFF_MAX_S = 30.0
STABLE_AFTER_S = 60.0
"""A process that ran this long before crashing starts the backoff again from its first step."""


def tail(path: Path | None, lines: int = 20) -> str:
    """The last ``lines`` lines of a log file ("" when there is none)."""
    if path is None:
        return ""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - 64 * 1024))
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def exit_reason(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exited with status {returncode}"


class Supervisor:
    """Watches ``instances`` (instance id -> ChildInstance, shared with the cluster) and restarts those whose
    process ended, with ``restart(instance_id)`` returning the new ChildInstance (it may raise: retried later).
    ``what`` names the processes in its log lines."""

    def __init__(self, instances: dict, restart: Callable[[str], object], poll_s: float = 0.25,
                 what: str = "instance"):
        self.instances = instances
        self.what = what
        self._restart = restart
        self._poll_s = poll_s
        self._stop = threading.Event()
        self._backoff: dict[str, float] = {}
        self._next_try: dict[str, float] = {}
        self._started_at: dict[str, float] = {i: time.monotonic() for i in instances}
        self.restarts: dict[str, int] = {}
        self._restarting: set[str] = set()
        self._thread = threading.Thread(target=self._run, name=f"{what}-supervisor", daemon=True)

    def start(self) -> "Supervisor":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(30)

    def _run(self) -> None:
        while not self._stop.wait(self._poll_s):
            for instance_id, child in list(self.instances.items()):
                if self._stop.is_set():
                    return
                code = child.proc.poll()  # reaps the process: no zombie
                if code is None:
                    continue
                now = time.monotonic()
                if instance_id in self._restarting:
                    continue
                if instance_id not in self._next_try:
                    self._crashed(instance_id, child, code, now)
                if now >= self._next_try[instance_id]:  # each on its own thread: a slow start delays no other
                    self._restarting.add(instance_id)
                    threading.Thread(target=self._try_restart, args=(instance_id, child), daemon=True,
                                     name=f"restart-{instance_id}").start()

    def _crashed(self, instance_id: str, child, code: int, now: float) -> None:
        uptime = now - self._started_at.get(instance_id, now)
        previous = self._backoff.get(instance_id, 0.0)
        delay = BACKOFF_FIRST_S if uptime > STABLE_AFTER_S or not previous else min(BACKOFF_MAX_S, previous * 2)
        self._backoff[instance_id] = delay
        self._next_try[instance_id] = now + delay
        lines = tail(getattr(child, "log_path", None))
        log.error("%s %s (pid %d) %s after %.1f s; restarting it in %.1f s%s", self.what, instance_id, child.proc.pid,
                  exit_reason(code), uptime, delay, f"; last lines of its log:\n{lines}" if lines else "")

    def _try_restart(self, instance_id: str, old) -> None:
        try:
            self._restart_once(instance_id, old)
        finally:
            self._restarting.discard(instance_id)

    def _restart_once(self, instance_id: str, old) -> None:
        old.stop()  # closes its pipes and log file
        try:
            new = self._restart(instance_id)
        except Exception as e:  # noqa: BLE001 - logged; tried again after a longer wait
            now = time.monotonic()
            delay = min(BACKOFF_MAX_S, self._backoff.get(instance_id, BACKOFF_FIRST_S) * 2)
            self._backoff[instance_id] = delay
            self._next_try[instance_id] = now + delay
            log.error("%s %s did not restart (%s); trying again in %.1f s", self.what, instance_id, e, delay)
            return
        if self._stop.is_set():
            new.stop()
            return
        self.instances[instance_id] = new
        self._next_try.pop(instance_id, None)
        self._started_at[instance_id] = time.monotonic()
        self.restarts[instance_id] = self.restarts.get(instance_id, 0) + 1
        log.warning("%s %s restarted (pid %d, %s)", self.what, instance_id, new.proc.pid, new.address)
