"""The child process that builds a constraint's automaton (outlines-core's Index) for structured.py.

Some expressions' automata grow exponentially with their length ((a|b)*a(a|b){20}), others with
their repetition counts ([a-z]{1,10000}: ~7 s and ~660 MB on SmolLM2's 49k vocabulary), so the
build runs here, under an address-space limit and killed past a deadline, where it cannot take
the server's memory. It dies with the process that started it, so a server killed outright (SIGKILL,
the OOM killer) leaves no build running on. It imports only outlines-core, so it starts in ~0.1 s.

    argv[1]: the parent's process id
    stdin: pickled (regular expression, end-of-sequence token id, {token bytes: [ids]}, memory bytes)
    stdout: the Index, pickled; exit status 2 and the reason on stderr if the expression is invalid
"""
import ctypes
import os
import pickle
import resource
import signal
import sys

PR_SET_PDEATHSIG = 1        # <linux/prctl.h>


def die_with_parent(parent_pid: int) -> None:
    """Have Linux SIGKILL this process when the thread that started it exits. That thread waits for
    the build (subprocess.communicate), so it exits only when the whole parent process dies."""
    if sys.platform != "linux":      # prctl is Linux's; elsewhere the parent's deadline is the only limit
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent_pid:   # the parent died before the signal was set up
        sys.exit(1)


def main() -> None:
    die_with_parent(int(sys.argv[1]))
    regex, eos_token_id, vocabulary, memory_bytes = pickle.load(sys.stdin.buffer)
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    import outlines_core

    try:
        index = outlines_core.Index(regex, outlines_core.Vocabulary(eos_token_id, vocabulary))
    except (ValueError, TypeError) as e:
        print(e, file=sys.stderr)
        sys.exit(2)
    sys.stdout.buffer.write(pickle.dumps(index))


if __name__ == "__main__":
    main()
