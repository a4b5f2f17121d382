"""The specdraft CLI (with the test-only "probe" family) and one fault, for tests/test_fault_injection.py.

FAULT=rename:N  the process's Nth rename or replace (os.rename, os.replace: pathlib and shutil go through them)
                fails with EIO, as on a flaky or full filesystem;
FAULT=fsize:N   every file the process writes is capped at N bytes (RLIMIT_FSIZE, SIGXFSZ ignored): the
                kernel answers EFBIG, what a full disk looks like to the writer.
The product itself carries no test hooks.
"""

import errno
import os
import resource
import signal
import sys

import probe_family  # noqa: F401  (registers the family)

fault = os.environ.get("FAULT", "")
if fault.startswith("fsize:"):
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    limit = int(fault.split(":")[1])
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
elif fault.startswith("rename:"):
    failing, calls = int(fault.split(":")[1]), []

    def failing_at_nth(real):
        def rename(*args, **kwargs):
            calls.append(args)
            if len(calls) == failing:
                raise OSError(errno.EIO, "injected: the rename failed", str(args[0]))
            return real(*args, **kwargs)
        return rename

    os.rename, os.replace = failing_at_nth(os.rename), failing_at_nth(os.replace)

from specdraft.cli import main  # noqa: E402  (after the fault is in place)

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
