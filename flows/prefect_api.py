"""Prefect's API for the flows: the one named by ``PREFECT_API_URL``, or a temporary local one
started once per process (:func:`start_prefect_api`, :func:`ensure_prefect_api`), and the quieting
of Prefect's and Dask's loggers so the terminal keeps the command's progress bar and its user
errors in one line (:func:`quiet_prefect_logs`).

Workers never need a Prefect API (the flow's Prefect tasks run in the flow process and hand their
work to Dask, see :mod:`scanforest.flows.cluster`); they still receive the flow's API URL (the
worker plugin, :mod:`scanforest.flows.worker_setup`) so any Prefect call made there talks to the
flow's server instead of starting a temporary one.
"""
from __future__ import annotations

import contextlib
import logging
import os
import threading

_server_lock = threading.Lock()
_server: "_LocalAPI | None" = None


class _LocalAPI:
    """Prefect's API for this process when none is set: a uvicorn child serving
    ``prefect.server.api.server:create_app``, which is what Prefect's own temporary server runs
    (through :func:`create_local_app`, which skips the migration check once this Prefect has
    migrated this database).

    Started here rather than through ``prefect.server.api.server.SubprocessASGIServer`` because
    importing that module loads the whole server stack (FastAPI, SQLAlchemy: 2.6 s of a 12 s
    command on 2 cores) in the command's process, which only needs the client; and because
    :func:`start_prefect_api` can then start it early, so it boots while the command imports
    its flow and checks its input. Its output goes to ``PREFECT_HOME/scanforest-server.log``: when
    the command ends the server is terminated, possibly mid-rollback, and it used to print a
    SQLAlchemy traceback after the command's result.
    """

    def __init__(self):
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}/api"
        home = os.path.expanduser(os.environ.get("PREFECT_HOME", "~/.prefect"))
        os.makedirs(home, exist_ok=True)
        self.log = os.path.join(home, "scanforest-server.log")
        env = {**os.environ, "PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1",
               "PREFECT__SERVER_FINAL": "1", "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
        env.pop("PREFECT_API_URL", None)
        self._env = env
        self._spawn()

    def _spawn(self) -> None:
        import subprocess
        import sys

        # its own session: a Ctrl-C at the terminal goes to the command, not to its API (which
        # died with it, and the flow's crash handling then called the dead API for minutes); it
        # stops with the command (stop(), at exit) or, killed, when its parent is gone
        # (create_local_app's watch)
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "uvicorn", "--factory", "scanforest.flows.prefect_api:create_local_app",
                 "--host", "127.0.0.1", "--port", str(self.port), "--log-level", "error", "--lifespan", "on"],
                env={**self._env, _PARENT_ENV: str(os.getpid())}, stdout=out, stderr=out,
                stdin=subprocess.DEVNULL, start_new_session=True)

    def wait_ready(self, timeout: float = 90.0, attempts: int = 3) -> str:
        """Block until the API answers its health check (the first start migrates its database).

        Two commands started together on a new ``PREFECT_HOME`` both migrate its database, and the
        loser's server exits ("table ... already exists"); it is started again (same port), up
        to ``attempts`` times, and then finds the database migrated."""
        import time
        import urllib.error
        import urllib.request

        deadline = time.monotonic() + timeout
        direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # our own loopback server
        tries = 1
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                if tries >= attempts:
                    break
                tries += 1
                time.sleep(0.5 * tries)
                self._spawn()
                continue
            try:  # the standard library's client: httpx made a client and its SSL context at every poll
                with direct.open(self.url + "/health", timeout=2.0) as r:
                    if r.status == 200:
                        return self.url
            except (urllib.error.URLError, OSError, ValueError):
                pass
            time.sleep(0.1)
        exited = self.proc.poll()
        self.stop()
        why = (f"exited with code {exited} ({tries} starts)" if exited is not None
               else f"did not answer within {timeout:.0f} s")
        raise RuntimeError(f"Prefect's local API {why}; its log: {self.log} "
                           "(or set PREFECT_API_URL to a running `prefect server start`)")

    def stop(self) -> None:
        import subprocess

        if self.proc.poll() is None:
            # killed, not asked: served through create_local_app, uvicorn's SIGTERM handler held the
            # server until its start-up ended (a command refusing a bad store 0.7 -> 4-6 s); served
            # through Prefect's own factory, a SIGTERM ended it at once, as this does
            self.proc.kill()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass


#: what a process's first flow run imports besides the client: Prefect's flow and task engines,
#: its flow-graph helpers (``Flow.__call__``), and FastAPI's encoder, which Prefect's parameter
#: serialisation loads with the FastAPI and Starlette stack (136 modules in all: a first ingest's
#: body started 0.67-0.75 s into its call on 2 cores with them imported there, 0.58-0.63 s without)
FLOW_ENGINE_MODULES = ("prefect.flow_engine", "prefect.task_engine", "prefect.artifacts",
                       "prefect.utilities.visualization", "fastapi.encoders")


def import_flow_engine() -> None:
    """Import :data:`FLOW_ENGINE_MODULES` now: a command that waits for its temporary API to boot
    does it then, instead of inside its first stage (a missing optional module is left to the
    flow to report)."""
    import importlib

    for name in FLOW_ENGINE_MODULES:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)


def start_prefect_api() -> None:
    """Start the local Prefect API in the background when none is set (no-op otherwise), so it
    boots while the command does other work; :func:`ensure_prefect_api` waits for it.

    Its URL is exported at once (``PREFECT_API_URL``), and Prefect's settings are refreshed if
    Prefect is already imported, so nothing starts a second temporary server."""
    global _server
    if os.environ.get("PREFECT_API_URL"):
        return
    with _server_lock:
        if _server is None:
            _server = _LocalAPI()
            import atexit

            atexit.register(_stop_server)
        os.environ["PREFECT_API_URL"] = _server.url
        import sys

        if "prefect.context" in sys.modules:
            sys.modules["prefect.context"].refresh_global_settings_context()


def ensure_prefect_api() -> str:
    """The Prefect API URL the flows report to, starting a temporary local server if none is set.

    The URL is exported in ``os.environ`` so worker processes started afterwards inherit it.
    """
    quiet_prefect_logs()
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW", "ignore")
    start_prefect_api()
    url = os.environ["PREFECT_API_URL"]
    if _server is not None and url == _server.url:
        no_heartbeats_for_a_temporary_api()
        ready = _server.wait_ready()
        warm_api_client()
        return ready
    _check_api(url)  # the user's own server
    return url


_WARMED: set[str] = set()


def warm_api_client() -> bool:
    """Make this process's first request to the API now, in a background thread: Prefect's client
    checks the server's version once per process and API, at the first flow's start, and that
    first request to a server just started is slow (0.6-0.8 s on 2 cores). Done while the command
    goes on starting its cluster, an ingest of 8,000 files (every one unchanged) started its first
    task 1.89 s into the flow instead of 2.69 (means of 4 interleaved runs each, 2 cores,
    2026-11-28). Returns False when already done for this API."""
    url = os.environ.get("PREFECT_API_URL", "")
    if not url or url in _WARMED:
        return False
    _WARMED.add(url)

    def warm():
        try:
            from prefect.client.orchestration import get_client

            with get_client(sync_client=True) as client:
                client.raise_for_api_version_mismatch_once()  # cached for the process: flows skip it
        except Exception:  # the first flow makes the check itself, and says what is wrong
            pass

    threading.Thread(target=warm, name="sf-api-warm-up", daemon=True).start()
    return True


def no_heartbeats_for_a_temporary_api() -> bool:
    """Turn Prefect's flow-run heartbeats off in this process while its API is the temporary local
    one (:func:`start_prefect_api`), unless the user set ``PREFECT_FLOWS_HEARTBEAT_FREQUENCY``.

    Heartbeats let a server's automation mark a flow run whose process died as crashed (Prefect
    3.8 sends one every 180 s by default). A temporary API ends with the command, so nothing can
    ever act on them there; and each flow run's end waits for its heartbeat thread's current
    1-second sleep (``prefect.flow_engine._send_heartbeats`` joins it): 1.0 s at the end of
    every flow and subflow run (an archive run has four), measured on 2 cores (2026-11-28).
    Returns True when turned off here. A user's own server keeps Prefect's default."""
    if local_api_pid() is None or any(k in os.environ for k in (
            "PREFECT_FLOWS_HEARTBEAT_FREQUENCY", "PREFECT_RUNNER_HEARTBEAT_FREQUENCY")):
        return False
    import prefect.context

    flows = prefect.context.GLOBAL_SETTINGS_CONTEXT.settings.flows
    try:
        flows.heartbeat_frequency = None  # Prefect's own "off" (an environment variable cannot say None)
    except (AttributeError, TypeError, ValueError):  # another Prefect's settings model: its default stays
        return False
    return True


def _check_api(url: str, timeout: float = 5.0) -> None:
    """A set ``PREFECT_API_URL`` that does not answer is a user error, said in one line (not the
    connection traceback the first flow call would print after its retries)."""
    import httpx

    from scanforest.kernels.errors import InputError

    try:
        httpx.get(url.rstrip("/") + "/health", timeout=timeout).raise_for_status()
    except httpx.HTTPError as exc:
        raise InputError(f"cannot reach the Prefect API at PREFECT_API_URL={url} ({type(exc).__name__}); "
                         "start it (`prefect server start`) or unset PREFECT_API_URL to use a temporary "
                         "local one") from None


def local_api_pid() -> int | None:
    """The process id of the local Prefect API this process started, while it is the API in use
    (``PREFECT_API_URL`` names it); None otherwise (a user's own server, or none started)."""
    if _server is not None and os.environ.get("PREFECT_API_URL") == _server.url:
        return _server.proc.pid
    return None


def _stop_server() -> None:
    global _server
    if _server is not None:
        logging.disable(logging.INFO)  # at interpreter exit the log streams may already be closed
        with contextlib.suppress(Exception):
            _server.stop()
        logging.disable(logging.NOTSET)
        if os.environ.get("PREFECT_API_URL") == _server.url:
            os.environ.pop("PREFECT_API_URL", None)
        _server = None


_USER_ERRORS = ("ScanforestError", "InputError", "ScanReadError", "DeviceError", "OutOfMemory", "Interrupted")


class _UserErrorFilter(logging.Filter):
    """Drop Prefect's log lines about a run that failed with a user error (an ``InputError`` and
    the like): the command prints that error in one line and exits 2; a traceback and the
    run's final-state line would bury it. Unexpected errors keep their tracebacks. A Ctrl-C's
    "Crash detected! Execution was aborted by an interrupt signal" is dropped too: the command
    said it stops (the run is still marked crashed)."""

    def filter(self, record: logging.LogRecord) -> bool:
        from scanforest.kernels.errors import ScanforestError

        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, ScanforestError):
            return False
        try:
            msg = record.getMessage()
        except Exception:
            return True
        if "aborted by an interrupt signal" in msg:
            return False
        return not (("Finished in state" in msg or "Retries are exhausted" in msg or "encountered an exception" in msg)
                    and any(name + ":" in msg or name + "(" in msg for name in _USER_ERRORS))


_FILTER = _UserErrorFilter()


def quiet_prefect_logs() -> None:
    """Keep the terminal for our progress bar: Prefect's per-task INFO lines go to the API only,
    and runs that end in a user error say so once, through the command."""
    import warnings

    for name in ("prefect.flow_runs", "prefect.task_runs", "prefect.engine"):
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)

    # query blocks are embedded in their tasks on purpose: a lost worker's block is recomputable
    warnings.filterwarnings("ignore", message=".*Sending large graph.*")
    for name in ("prefect.task_runs", "prefect.flow_runs", "prefect.engine", "httpx"):
        logging.getLogger(name).setLevel(logging.WARNING)
    # Prefect's event and log senders say "Still processing items: N items remaining..." while a
    # command exits and they drain their queues (progress, not a problem)
    for name in ("EventsWorker", "APILogWorker"):
        logging.getLogger(name).setLevel(logging.ERROR)
    for name in ("distributed", "distributed.scheduler", "distributed.nanny", "distributed.core",
                 "distributed.worker", "distributed.batched", "distributed.http.proxy"):
        logging.getLogger(name).setLevel(logging.ERROR)


# ---- the temporary API's application -------------------------------------------------------
# What :class:`_LocalAPI` serves (:func:`create_local_app`): Prefect's own server application,
# less its database migration check when this Prefect has already brought this database to its
# revision. Every server start checks the migrations (Alembic loads every revision script): 0.3-0.9 s of a
# 3.1-4.0 s start on 2 cores (median 3.83 -> 3.61 s), paid by every command that starts a temporary API. The first start
# with a database migrates it as Prefect always does; once its lifespan has begun (the migrations
# passed) it leaves a marker in ``PREFECT_HOME`` naming the Prefect version, the database URL and
# the Alembic revision the SQLite file then holds. A later start that reads the same three (the
# revision from the file itself) skips the check; any other (another Prefect version, another
# database, a new or foreign file without that revision, a non-SQLite database) migrates as
# before. A file made again in place of the old one is told apart by its revision table, not by
# its inode, which the file system may give the new file.

MIGRATED_MARKER = "scanforest-api-migrated"


def _database_key() -> str | None:
    """Prefect's version, the database URL and the Alembic revision the SQLite database holds:
    what a migration was made for; None where it cannot be told (a server database, no file,
    no revision table: a new or foreign file)."""
    import sqlite3

    import prefect
    from prefect.settings import get_current_settings

    url = get_current_settings().server.database.connection_url
    url = url.get_secret_value() if hasattr(url, "get_secret_value") else str(url)
    if not url.startswith("sqlite") or ":///" not in url or ":memory:" in url:
        return None
    path = url.split(":///", 1)[1].split("?", 1)[0]
    if not os.path.isfile(path):
        return None
    try:
        with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)) as db:
            rows = db.execute("SELECT version_num FROM alembic_version").fetchall()
    except sqlite3.Error:
        return None
    return f"{prefect.__version__}|{url}|{rows[0][0]}" if len(rows) == 1 else None


def _marker_path() -> str:
    from prefect.settings import get_current_settings

    return os.path.join(str(get_current_settings().home), MIGRATED_MARKER)


#: the pid of the command a temporary local API serves (its parent): the API exits when it is gone
_PARENT_ENV = "SCANFOREST_API_PARENT"


def _exit_with_parent(parent: int, every: float = 1.0) -> None:
    """Exit this process (the temporary API, in a session of its own) once ``parent`` is no
    longer its parent: the command was killed without its exit handlers stopping it."""
    import threading
    import time

    def watch():
        while os.getppid() == parent:
            time.sleep(every)
        os._exit(0)

    threading.Thread(target=watch, name="sf-parent-watch", daemon=True).start()


def create_local_app():
    """Prefect's ``create_app()`` for the temporary local API, without the migration check where
    the marker says this Prefect made it (see the section above); it exits when the command that
    started it is gone."""
    import prefect.context

    parent = os.environ.get(_PARENT_ENV, "")
    if parent.isdigit():
        _exit_with_parent(int(parent))
    key = None
    with contextlib.suppress(Exception):
        key = _database_key()
    marker = _marker_path()
    current = False
    if key is not None:
        with contextlib.suppress(OSError):
            with open(marker, encoding="utf-8") as fh:
                current = fh.read() == key
    if current:
        os.environ["PREFECT_API_DATABASE_MIGRATE_ON_START"] = "false"
        prefect.context.refresh_global_settings_context()

    from prefect.server.api.server import create_app as prefect_app

    app = prefect_app()
    if current:
        return app
    inner = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(a):
        async with inner(a) as state:  # the migrations have passed
            made = None
            with contextlib.suppress(Exception):
                made = _database_key()  # the file exists now, if the start created it
            if made is not None:
                with contextlib.suppress(OSError):
                    tmp = f"{marker}.{os.getpid()}"
                    with open(tmp, "w", encoding="utf-8") as fh:
                        fh.write(made)
                    os.replace(tmp, marker)
            yield state

    app.router.lifespan_context = lifespan
    return app
