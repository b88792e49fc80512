"""meshkit's rank hook. ``meshkit run --log`` puts this directory first on the job's PYTHONPATH,
so every Python process of the job imports it at start (as ``sitecustomize``). In a rank (``RANK``
set) it:
- lets the job's keeper read its stack when Yama's ``ptrace_scope`` is 1, where only an ancestor
  may: it names the keeper its tracer (``PR_SET_PTRACER``), so that the py-spy the keeper starts
  for ``meshkit diagnose`` may read it too, and nothing else of this user may;
- when torch's flight recorder is on (``TORCH_FR_BUFFER_SIZE``), keeps a thread blocked on a FIFO
  (``/tmp/meshkit-UID/fr-PID``) that, when the keeper opens it, writes the recorder's JSON beside
  it: the collectives this rank entered, read while its main thread waits in one;
- records an uncaught exception in ``$MESHKIT_ERRORS/rank<R>.json``, torchelastic's error-file
  shape plus the time to the microsecond, so ``diagnose`` names the rank that raised first (with
  torchrun or ``--spawn``, with torch's ``@record`` or without).
Then the next ``sitecustomize`` on the path (a venv's, a distribution's) is imported as if this one
were not there. Standard library only."""

import os
import sys

PR_SET_PTRACER = 0x59616D61
YAMA = "/proc/sys/kernel/yama/ptrace_scope"


# The paths node/files.py names (fifo, fifo_dump, rank_error_file), built by the same
# convention: the hook imports nothing of meshkit into the user's ranks.
# tests/test_nodefiles.py checks that they agree.
def fifo_path(pid: int) -> str:
    return f"/tmp/meshkit-{os.getuid()}/fr-{pid}"


def fifo_dump_path(fifo: str) -> str:
    return f"{fifo}.json"


def error_path(errors: str, rank: str) -> str:
    return f"{errors}/rank{rank}.json"


# No umask here: the hook runs inside the user's ranks, and a umask would change the
# modes of every file the user's own code writes. The hook's own files are made 0600
# instead (its FIFO's directory 0700), as node/files.py makes the node's.
NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW


def _write_new(path: str, data: bytes) -> None:
    """``path`` written whole through a new temporary of a name nobody can guess: whatever was
    planted at a name is never followed or written through."""
    temporary = f"{path}.{os.getpid()}.{os.urandom(8).hex()}"
    with os.fdopen(os.open(temporary, NEW_FILE, 0o600), "wb") as handle:
        handle.write(data)
    os.replace(temporary, path)


def _private(directory: str) -> bool:
    """The FIFOs' directory (node/files.py's state root), made 0700 if missing, and used
    only if it is a real directory of this user that nobody else can write, as node/files.py
    checks it."""
    import contextlib
    import stat

    with contextlib.suppress(FileExistsError):
        os.mkdir(directory, 0o700)
    info = os.lstat(directory)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        return False  # a symlink, a file, another user's
    if info.st_mode & 0o022:
        return False
    if info.st_mode & 0o077:
        os.chmod(directory, 0o700)
    return True


def _install(rank: str, errors: str) -> None:
    try:
        with open(YAMA) as handle:
            scope = handle.read().strip()
    except OSError:
        scope = "0"  # no Yama: the same user may trace
    keeper = os.environ.get("MESHKIT_KEEPER", "")
    if scope == "1" and keeper.isdigit():
        import ctypes

        ctypes.CDLL(None).prctl(PR_SET_PTRACER, ctypes.c_ulong(int(keeper)), 0, 0, 0)
    previous = sys.excepthook

    def record(kind, value, traceback_object):  # type: ignore[no-untyped-def]
        try:
            import json
            import time
            import traceback

            now = time.time()
            message = "".join(traceback.format_exception_only(kind, value)).strip()
            stack = "".join(traceback.format_exception(kind, value, traceback_object))
            info = {"py_callstack": stack, "timestamp": str(int(now))}
            ours = {"rank": int(rank), "node_rank": os.environ.get("NODE_RANK"), "time": now}
            data = {"message": {"message": message, "extraInfo": info}, "meshkit": ours}
            os.makedirs(errors, exist_ok=True)
            path = error_path(errors, rank)
            _write_new(path, json.dumps(data).encode())
        except Exception:  # the rank's own error must still be shown
            pass
        previous(kind, value, traceback_object)

    sys.excepthook = record
    if os.environ.get("TORCH_FR_BUFFER_SIZE"):
        import threading

        threading.Thread(target=_flight, name="meshkit-flight", daemon=True).start()


def _flight() -> None:
    fifo = fifo_path(os.getpid())
    try:
        if not _private(os.path.dirname(fifo)):
            # No flight recorder rather than a FIFO in a directory another user controls.
            return
        os.mkfifo(fifo, 0o600)
    except OSError:
        return
    while True:
        with open(fifo, "rb") as handle:
            handle.read()  # the agent opened and closed it: dump
        _write_new(fifo_dump_path(fifo), _recorded())


# torch keeps two flight recorders: gloo's (and other CPU backends') and NCCL's, each with its own
# dump. One rank may use both (a gloo group beside the NCCL one); every entry of each is kept.
RECORDERS = ("_dump_fr_trace_json", "_dump_nccl_trace_json")


def _recorded() -> bytes:
    import json

    merged: dict[str, object] = {}
    entries: list[object] = []
    for name in RECORDERS:
        try:
            dump = getattr(sys.modules["torch"]._C._distributed_c10d, name)
            data = json.loads(dump())
        except Exception:  # no torch.distributed (yet), or a build without this recorder
            continue
        if not isinstance(data, dict):
            continue
        merged = merged or data
        entries.extend(data.get("entries") or [])
    merged["entries"] = entries
    return json.dumps(merged).encode()


def _chain() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    mine = sys.modules.pop("sitecustomize", None)
    path = sys.path[:]
    sys.path[:] = [entry for entry in path if os.path.abspath(entry or ".") != here]
    try:
        import sitecustomize  # type: ignore[import-not-found]  # noqa: F401 - the next one
    except ImportError as exc:
        if exc.name != "sitecustomize":
            raise
    finally:
        sys.path[:] = path
        sys.modules.setdefault("sitecustomize", mine)  # type: ignore[arg-type]


if os.environ.get("RANK", "").isdigit() and os.environ.get("MESHKIT_ERRORS"):
    _install(os.environ["RANK"], os.environ["MESHKIT_ERRORS"])
_chain()
