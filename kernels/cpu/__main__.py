"""Build (or find cached) the native CPU kernels ahead of the first request: python -m kernels.cpu"""
import sys

import kernels.cpu as cpu_kernels

if cpu_kernels.library() is None:
    print(f"native CPU kernels could not be built, the eager torch path will run: {cpu_kernels.error()}",
          file=sys.stderr)
    sys.exit(1)
print(f"native CPU kernels ready in {cpu_kernels.build_dir()}")
