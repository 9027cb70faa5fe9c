"""The child process that builds a constraint's automaton (outlines-core's Index) for structured.py.

Some expressions' automata grow exponentially with their length ((a|b)*a(a|b){20}), others with
their repetition counts ([a-z]{1,10000}: ~7 s and ~660 MB on SmolLM2's 49k vocabulary), so the
build runs here, under an address-space limit and killed past a deadline, where it cannot take
the server's memory. It imports only outlines-core, so it starts in ~0.1 s.

    stdin: pickled (regular expression, end-of-sequence token id, {token bytes: [ids]}, memory bytes)
    stdout: the Index, pickled; exit status 2 and the reason on stderr if the expression is invalid
"""
import pickle
import resource
import sys


def main() -> None:
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
