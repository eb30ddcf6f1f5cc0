"""One error hierarchy; each class carries the exit code the CLI returns for it."""

from __future__ import annotations


class ExitCode:
    OK = 0
    FAILED = 1
    USAGE = 2
    TOOL_MISSING = 3
    NO_ACCESS = 3           # the target could not be read (ptrace refused): no_access names the fix
    ENGINE_FAILED = 4
    TARGET_STOPPED = 5      # the target was stopped or traced by someone else: nothing to judge
    NOT_DIAGNOSABLE = 5     # the target exited, is a zombie, runs no Python or is a kernel thread
    NOT_SATURATED = 6   # soak: no hang, but the KV pool never got near full: inconclusive
    INCONCLUSIVE = 6    # capture: a wait that is a hang or idleness depending on evidence that could not be read
    DEADLOCK = 10
    INTERRUPTED = 130


class KvdiagError(Exception):
    """Base of every error kvdiag reports to the user as one line plus a hint."""

    exit_code: int = ExitCode.FAILED

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint


class UsageError(KvdiagError):
    exit_code = ExitCode.USAGE


class ScenarioError(UsageError):
    """Invalid scenario file; the message names file:line and the field."""

    def __init__(self, message: str, file: str | None = None, line: int | None = None,
                 field: str | None = None, hint: str | None = None) -> None:
        where = ""
        if file is not None:
            where = f"{file}:{line}: " if line is not None else f"{file}: "
        what = f"{field}: " if field else ""
        super().__init__(f"{where}{what}{message}", hint)
        self.file = file
        self.line = line
        self.field = field


class BundleError(UsageError):
    """A bundle given on the command line is missing or unreadable."""


class ToolMissing(KvdiagError):
    exit_code = ExitCode.TOOL_MISSING


class EngineFailed(KvdiagError):
    exit_code = ExitCode.ENGINE_FAILED


class AllocatorError(KvdiagError):
    """The native allocator module is unavailable or misbehaved."""


class Interrupted(KvdiagError):
    exit_code = ExitCode.INTERRUPTED
    # The partial report written before the run stopped (a lifecycle's RunArtifacts), for the CLI to
    # print like any outcome; None when nothing was written.
    partial: object | None = None


class Terminated(KeyboardInterrupt):
    """SIGTERM/SIGHUP, delivered like Ctrl-C.

    A BaseException (as KeyboardInterrupt is) so that no ``except Exception`` on the
    way up can swallow it; the CLI maps it to exit 130 after teardown.
    """
