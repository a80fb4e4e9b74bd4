"""A flow run's watchdog: a small process that outlives a killed flow process and says so.

A flow process killed with SIGKILL (or by the OOM killer, or with its machine's power) runs no
hook: its run stays ``running`` in the store and Running in Prefect until another flow on the
same store notices (:func:`scanforest.flows.records.mark_interrupted`). So every flow run
starts this watchdog (:func:`watch`) in a session of its own, holding the read end of a pipe
whose write end only the flow process holds. The read returns when that process closes the
pipe at the run's end (:func:`release`), or when the process is gone, however it ended (the
kernel closes its descriptors, even while it is a zombie). The watchdog then looks at the run's
record: one still ``running`` belonged to a killed process, and becomes ``interrupted`` in the
store and Crashed in Prefect within seconds; a temporary local Prefect API the killed command
had started (which its exit would have stopped) is stopped after that.

Run as a script (``python _watchdog.py FD STORE RUN_ID FLOW_RUN_ID SERVER_PID``), so it waits
having imported nothing but ``os`` and ``sys``; it imports the store and Prefect's client only
after a kill.
"""
from __future__ import annotations

import os
import sys
import threading

_pipes: dict[str, int] = {}  # run id -> the write end this process holds
_lock = threading.Lock()


def watch(store: str, run_id: str, flow_run_id: str | None, server_pid: int | None = None) -> None:
    """Start the watchdog of run ``run_id`` of ``store`` (best effort: a run without one is still
    marked by the next flow on its store)."""
    import subprocess

    try:
        r, w = os.pipe()  # both ends close-on-exec: no other child of this process holds them
        subprocess.Popen([sys.executable, os.path.abspath(__file__), str(r), store, run_id, flow_run_id or "",
                          str(server_pid or 0)], pass_fds=(r,), stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        os.close(r)
    except OSError:
        return
    with _lock:
        old = _pipes.pop(run_id, None)
        _pipes[run_id] = w
    if old is not None:
        os.close(old)


def release(run_id: str) -> None:
    """The run ended in this process (its record says how): its watchdog exits."""
    with _lock:
        w = _pipes.pop(run_id, None)
    if w is not None:
        os.close(w)


def note_interrupt() -> None:
    """This process was asked to stop (a Ctrl-C): each watchdog it holds hears so now (one byte on
    its pipe), and says so if the process then ends before its run's record does (a Ctrl-C
    during a long numba call ends the command by its grace timer, with no hook run): the run is
    recorded as stopped by a Ctrl-C, not as killed."""
    with _lock:
        ends = list(_pipes.values())
    for w in ends:
        try:
            os.write(w, b"i")
        except OSError:
            pass


def interrupt(st, run: dict, why: str = "killed") -> None:
    """Record run ``run`` (its attributes, with ``id``) of store ``st``, whose process was killed,
    as ``interrupted``, and its Prefect flow run as Crashed when that API still has it running
    (another API, or a run gone from it: the store says it). ``why``: how it ended, as far as
    its watchdog knows (``killed``, or ``stopped by a Ctrl-C``)."""
    import contextlib
    import datetime

    msg = f"interrupted: its process ({run.get('host')}, pid {run.get('pid')}) ended without finishing ({why})"
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    st.write_run(run["id"], {"status": "interrupted", "error": msg, "noticed": now})
    if run.get("flow_run_id"):
        with contextlib.suppress(Exception):
            from prefect.client.orchestration import get_client
            from prefect.states import Crashed

            with get_client(sync_client=True) as client:
                fr = client.read_flow_run(run["flow_run_id"])
                if fr.state is not None and fr.state.is_running():
                    client.set_flow_run_state(fr.id, Crashed(message=msg), force=True)


def _crashed(store: str, run_id: str, flow_run_id: str | None, why: str = "killed") -> bool:
    """Mark the run interrupted (and Crashed) if its record still says ``running``; whether it did."""
    from scanforest.tasks.store import ScanStore

    st = ScanStore(store, mode="a")
    run = st.catalog.run(run_id)
    if run is None or run.get("status") != "running":
        return False  # ended on its own, or a no-op whose record was summarised
    interrupt(st, {**run, "id": run_id, "flow_run_id": flow_run_id}, why)
    return True


def main(argv: list[str]) -> None:
    fd, store, run_id, flow_run_id, server_pid = int(argv[0]), argv[1], argv[2], argv[3] or None, int(argv[4])
    why = "killed"
    while True:
        try:
            if os.read(fd, 1) == b"":  # once the flow process closed its end or is gone
                break
            why = "stopped by a Ctrl-C"  # note_interrupt
        except InterruptedError:
            continue
    killed = False
    try:
        killed = _crashed(store, run_id, flow_run_id, why)
    except Exception:  # noqa: BLE001 - nobody to tell; the next flow on the store marks it
        pass
    if killed and server_pid:  # the killed command's temporary Prefect API: its exit would have stopped it
        import signal

        try:
            os.kill(server_pid, signal.SIGTERM)
        except OSError:
            pass


if __name__ == "__main__":
    sys.path.pop(0)  # this file's folder: its modules (distributed.py, ...) must not shadow packages
    main(sys.argv[1:])
