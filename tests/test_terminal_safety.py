"""The operator's terminal is the operator's: what a node sends (exec output, log lines, status
fields, errors, GPU names) reaches a terminal with its control characters made visible, so no
escape sequence of a node's (OSC 52 writing the clipboard, cursor moves over other nodes' lines)
is obeyed, and ``top``'s rich view takes node strings as text, never markup. Into a pipe or a
file, ``exec`` and ``logs`` keep what the node sent, as pdsh does. The pure parts first, then on
a sandbox of real sshd nodes, each command run under a pseudo-terminal."""

from __future__ import annotations

import io
import json
import os
import pty
import select
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import MESHKIT, meshkit
from helpers.sandbox_jobs import script_job, wait_for
from invoke.exceptions import Exit

from meshkit import sandbox
from meshkit.cli import execute as cli_exec
from meshkit.cli.common import reported, table
from meshkit.cli.printing import relay, say
from meshkit.cli.tasks import top as cli_top
from meshkit.errors import RemoteError
from meshkit.ops.execute import NodeResult
from meshkit.ops.top import NodeLine, Snapshot
from meshkit.protocol import GpuSample, TopReply
from meshkit.terminal import CONTROL, visible

SANDBOX_NODES = 2

# What a hostile node prints: the clipboard written (OSC 52), the screen cleared, the cursor
# sent home, a window title set, a one-byte CSI (C1), and rich markup that would end a view.
OSC52 = "\x1b]52;c;aGVsbG8=\x07"
HOSTILE = f"{OSC52}\x1b[2J\x1b[5;5Hmoved\x1b]0;title\x07\x9b31m[/bold][red]x"


# ---- pure: the escaping ------------------------------------------------------------------------


def test_control_characters_are_made_visible_and_newline_and_tab_kept() -> None:
    assert visible("a\x1b[31mb") == "a\\x1b[31mb"
    assert visible(OSC52) == "\\x1b]52;c;aGVsbG8=\\x07"
    assert visible("one\ttwo\nthree\r\n") == "one\ttwo\nthree\\x0d\n"
    assert visible("\x00\x08\x0b\x0c\x7f") == "\\x00\\x08\\x0b\\x0c\\x7f"
    assert visible("\x80\x9b\x9d\x9f") == "\\x80\\x9b\\x9d\\x9f"  # C1, as code points
    # printable text is left alone, whatever the script; so is a backslash
    assert visible("é 中 \xa0 \u2603 [/bold] \\x1b") == "é 中 \xa0 \u2603 [/bold] \\x1b"


def test_every_code_point_is_shown_once_and_only_controls_are_changed() -> None:
    """Every Unicode scalar value: what ``visible`` returns has no control character left (so it
    is idempotent), and exactly the 65 C0/DEL/C1 controls other than newline and tab change."""
    changed = []
    for code in range(0x110000):
        if 0xD800 <= code <= 0xDFFF:
            continue  # lone surrogates are not text (item 5 keeps them out of node replies)
        shown = visible(chr(code))
        assert CONTROL.search(shown) is None
        assert visible(shown) == shown
        if shown != chr(code):
            changed.append(code)
            assert shown == f"\\x{code:02x}"
    controls = [*range(0x00, 0x09), *range(0x0B, 0x20), *range(0x7F, 0xA0)]
    assert changed == controls


class Stream(io.StringIO):
    """A text stream that says whether it is a terminal."""

    def __init__(self, terminal: bool) -> None:
        super().__init__()
        self.terminal = terminal

    def isatty(self) -> bool:
        return self.terminal


def test_say_always_makes_visible_and_relay_only_on_a_terminal() -> None:
    for terminal in (True, False):
        said = Stream(terminal)
        say(HOSTILE, said)
        assert "\x1b" not in said.getvalue()
        assert said.getvalue() == visible(HOSTILE) + "\n"
    relayed = Stream(terminal=True)
    relay(HOSTILE, relayed, end="")
    assert relayed.getvalue() == visible(HOSTILE)
    piped = Stream(terminal=False)
    relay(HOSTILE, piped, end="")
    assert piped.getvalue() == HOSTILE  # pdsh's way: the node's output, as it sent it


def test_a_table_makes_its_cells_visible_and_stays_aligned() -> None:
    text = table(["node", "last line"], [("n1", "a\x1b[2Jb"), ("n22", "c")])
    assert text.splitlines() == ["node  last line", "n1    a\\x1b[2Jb", "n22   c"]


def test_an_error_quoting_a_node_reaches_the_terminal_visible() -> None:
    with pytest.raises(Exit) as raised, reported():
        raise RemoteError(f"node1: agent said {OSC52}")
    assert "\x1b" not in str(raised.value.message)
    assert "\\x1b]52" in str(raised.value.message)


def test_exec_output_is_relayed_and_json_says_how_many_bytes_were_cut(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    result = NodeResult("n1", 0, 0, f"out {OSC52}\n", f"err {OSC52}\n", None, 10, 3)
    assert result.cut == 13
    out = Stream(terminal=True)
    err = Stream(terminal=True)
    monkeypatch.setattr("sys.stdout", out)
    monkeypatch.setattr("sys.stderr", err)
    cli_exec.print_groups([result])
    cli_exec.print_lines([result])
    assert "\x1b" not in out.getvalue() + err.getvalue()
    assert "n1: out \\x1b]52" in out.getvalue()
    assert "n1: err \\x1b]52" in err.getvalue()
    data = cli_exec.as_json(result)
    assert (data["stdout_cut_bytes"], data["stderr_cut_bytes"]) == (10, 3)
    assert "\x1b" not in json.dumps(data)  # JSON escapes control characters itself


def top_sample(gpu_name: str, job_error: str | None = None) -> TopReply:
    gpu = GpuSample(0, gpu_name, 50.0, 1 << 30, 80 << 30, 100.0, 400.0, 60.0)
    return TopReply(
        hostname="node",
        cpus=8,
        cpu=10.0,
        memory_used=1 << 30,
        memory_total=16 << 30,
        load=[0.1, 0.2, 0.3],
        interface="eth0",
        ports=[],
        gpus=[gpu],
        gpu_source="nvidia-smi",
        ranks=[],
        job_error=job_error,
    )


def test_the_live_view_takes_node_strings_as_text_never_markup() -> None:
    """A GPU named ``[/bold]`` (a closing tag with nothing open: rich's MarkupError ended the
    view) and an error with escape sequences are shown as they read, the sequences visible."""
    from rich.console import Console

    up = NodeLine("10.0.0.1", 0, top_sample(f"[/bold]{HOSTILE}", f"[/red] {OSC52}"))
    down = NodeLine("10.0.0.2", 1, None, f"unreachable: [/] {OSC52}", 3.0)
    snapshot = Snapshot(time.time(), 2.0, [up, down], [], "[/bold] job", "[/i]")
    screen = io.StringIO()
    console = Console(file=screen, force_terminal=True, width=400, color_system="standard")
    console.print(cli_top.live_view(snapshot, per_gpu=True))
    shown = screen.getvalue()
    assert "[/bold]" in shown
    assert "[/red] \\x1b]52" in shown
    assert "unreachable: [/] \\x1b]52" in shown
    assert "\x1b]" not in shown  # no OSC at all: rich itself sends none here
    assert "\x1b[5;5H" not in shown and "\x1b[2J" not in shown
    plain = cli_top.plain(snapshot, per_gpu=True)
    assert "[/bold]" in plain


# ---- on the sandbox, under a pseudo-terminal --------------------------------------------------


def in_terminal(argv: list[str], cwd: Path, until: bytes = b"", seconds: float = 60.0) -> bytes:
    """What ``argv`` writes to a pseudo-terminal (stdout and stderr both), read until it exits,
    or, with ``until``, until that shows and then Ctrl-C (a live view) and its exit."""
    controller, terminal = pty.openpty()
    process = subprocess.Popen(argv, cwd=cwd, stdin=terminal, stdout=terminal, stderr=terminal)
    os.close(terminal)
    shown = b""
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            if until and until in shown and process.poll() is None:
                time.sleep(1.0)  # a refresh or two more
                process.send_signal(signal.SIGINT)
                until = b""
            if select.select([controller], [], [], 0.2)[0]:
                try:
                    chunk = os.read(controller, 65536)
                except OSError:  # the terminal's other end closed: the process is gone
                    break
                if not chunk:
                    break
                shown += chunk
            elif process.poll() is not None:
                break
        process.wait(timeout=10)
    finally:
        process.kill()
        os.close(controller)
    return shown


# The job: prints the hostile text on stdout and stderr, then sleeps (status shows its last line).
HOSTILE_JOB = f"""\
import sys
sys.stderr.write({HOSTILE!r} + "\\n")
sys.stdout.write({HOSTILE!r} + "\\n")
"""
# exec's command: the same text, by printf's escapes (the command line itself carries none).
EXEC_CMD = (
    "printf 'out \\033]52;c;aGVsbG8=\\007\\033[2J\\033[5;5Hmoved [/bold]\\n'; "
    "printf 'err \\033]52;c;aGVsbG8=\\007\\n' >&2"
)
# The fake nvidia-smi a node finds first on its PATH: a GPU whose name is markup and sequences.
FAKE_SMI = (
    "#!/bin/sh\n"
    "printf '0, [/bold]NVIDIA \\033]52;c;aGVsbG8=\\007\\033[5;5H[red]X, 50, 1000, 81920,"
    " 100.0, 400.0, 60\\n'\n"
)


@pytest.fixture(scope="module")
def hostile(cluster):
    """The mesh, and a job whose every rank prints escape sequences and markup."""
    workdir = script_job(cluster, "hostile", HOSTILE_JOB, "python hostile.py; sleep 600")
    yield cluster, workdir
    meshkit("stop", "--hostfile", str(cluster.hostfile), cwd=workdir)


@pytest.mark.sandbox
def test_exec_under_a_terminal_shows_no_escape_and_into_a_pipe_keeps_the_bytes(hostile) -> None:
    cluster, workdir = hostile
    argv = [*MESHKIT, "exec", "--hostfile", str(cluster.hostfile), "--cmd", EXEC_CMD]
    shown = in_terminal(argv, workdir)
    assert b"out \\x1b]52;c;aGVsbG8=\\x07\\x1b[2J" in shown, shown
    assert b"err \\x1b]52" in shown, shown
    assert b"\x1b" not in shown
    for lines in ([], ["--lines"]):
        piped = subprocess.run([*argv, *lines], cwd=workdir, capture_output=True, check=False)
        assert piped.returncode == 0, piped.stderr
        assert b"out \x1b]52;c;aGVsbG8=\x07\x1b[2J\x1b[5;5Hmoved [/bold]\n" in piped.stdout
        assert b"err \x1b]52;c;aGVsbG8=\x07" in piped.stderr
    out = meshkit("exec", "--hostfile", str(cluster.hostfile), "--json", "--cmd", EXEC_CMD)
    assert "\x1b" not in out.stdout
    data = json.loads(out.stdout)
    assert data[0]["stdout"].startswith("out \x1b]52")
    assert (data[0]["stdout_cut_bytes"], data[0]["stderr_cut_bytes"]) == (0, 0)


@pytest.mark.sandbox
def test_status_and_logs_under_a_terminal_show_no_escape_and_logs_piped_keep_it(hostile) -> None:
    cluster, workdir = hostile
    flags = ["--hostfile", str(cluster.hostfile)]

    def logged() -> bool:
        out = meshkit("logs", *flags, cwd=workdir)
        return out.stdout.count("moved") >= SANDBOX_NODES

    wait_for(logged, timeout=60)
    shown = in_terminal([*MESHKIT, "status", *flags], workdir)
    assert b"running" in shown, shown
    assert b"\\x1b[5;5Hmoved" in shown, shown
    assert b"\x1b" not in shown
    shown = in_terminal([*MESHKIT, "logs", *flags], workdir)
    assert b"[0] \\x1b]52;c;aGVsbG8=\\x07" in shown, shown
    assert b"\x1b" not in shown
    piped = subprocess.run([*MESHKIT, "logs", *flags], cwd=workdir, capture_output=True)
    assert b"[1] \x1b]52;c;aGVsbG8=\x07\x1b[2J\x1b[5;5Hmoved" in piped.stdout, piped.stdout


def plant_smi(node: sandbox.Node) -> None:
    """A fake ``nvidia-smi`` on the node's PATH, in a tmpfs mounted in the node's own mount
    namespace only (the host and the other node never see it)."""
    script = f"mount -t tmpfs -o size=64k,mode=755 fake-smi /usr/local/sbin && cat > {SMI} && "
    script += f"chmod 755 {SMI}"
    argv = [*sandbox.system.nsenter(node), "sh", "-c", script]
    subprocess.run(argv, input=FAKE_SMI, text=True, check=True, timeout=30)


SMI = "/usr/local/sbin/nvidia-smi"


@pytest.mark.sandbox
def test_top_survives_markup_in_a_gpu_name_and_shows_no_node_escape(hostile) -> None:
    cluster, workdir = hostile
    plant_smi(cluster.nodes[1])
    flags = ["--hostfile", str(cluster.hostfile), "--gpus"]
    data = json.loads(meshkit("top", *flags, "--json", cwd=workdir).stdout)
    names = [gpu["name"] for gpu in data["nodes"][1]["gpus"]]
    assert names and names[0].startswith("[/bold]NVIDIA \x1b]52"), data["nodes"][1]
    once = in_terminal([*MESHKIT, "top", *flags, "--once"], workdir)
    assert b"[/bold]NVIDIA \\x1b]52" in once, once
    live = in_terminal([*MESHKIT, "top", *flags, "--interval", "1"], workdir, until=b"[/bold]")
    assert b"[/bold]NVIDIA \\x1b]52" in live, live[-3000:]
    assert b"MarkupError" not in live and b"Traceback" not in live
    for view in (once, live):
        assert b"\x1b]" not in view  # rich sends no OSC here: any would be the node's
        assert b"\x1b[5;5H" not in view and b"\x1b[2J" not in view
