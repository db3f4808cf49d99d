"""Print the directory holding nvml.h from the installed nvidia-nvml-dev wheel.

Exit status 1 (and nothing on stdout) when the package or its header is absent.
The header's place inside the wheel has moved between CUDA releases
(nvidia/cu13/include, nvidia/cuda_nvml_dev/include, ...), so ask the
package's own file list rather than guessing a path.
"""
import sys
from importlib import metadata


def main() -> int:
    try:
        files = metadata.files("nvidia-nvml-dev") or []
    except metadata.PackageNotFoundError:
        return 1
    for entry in files:
        if entry.name == "nvml.h":
            path = entry.locate().resolve()
            if path.is_file():
                print(path.parent)
                return 0
    return 1


if __name__ == "__main__":
    sys.exit(main())
