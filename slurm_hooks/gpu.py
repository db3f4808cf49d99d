"""One NVML reading of this node's GPUs, for the reports of opted-in jobs.

Only the standard library and pynvml (nvidia-ml-py) are used, and pynvml is
imported inside snapshot() so that merely importing this module never needs it.

pynvml always opens NVML as ``CDLL("libnvidia-ml.so.1")`` and has no setting
for another path. To point it at a different library (the tests' fake NVML,
or a driver outside the loader's search path) snapshot() first loads that file
by absolute path; its SONAME is libnvidia-ml.so.1, so the dynamic loader
answers pynvml's later dlopen with the object already in the process. After
init the two handles are compared, so a process that had already loaded some
other libnvidia-ml.so.1 gets an error rather than a reading from the wrong
library.

The precursor counters (corrected ECC, remapped-row counts, retired-page
counts, per-link NVLink error counters) come with the health fields. A call
the GPU or driver does not support (NVML_ERROR_NOT_SUPPORTED: row remapping
before Ampere, page retirement from Ampere on, no ECC) leaves its fields None
and names them in the GPU's ``unsupported`` list, not in ``errors``: a
missing feature is not a fault.
"""
from __future__ import annotations

import ctypes
import os

STATE_ENV = "RECOVERY_FAKE_NVML_STATE"


def _text(value) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def normalize_bus_id(bus_id: str) -> tuple[str, str]:
    """("00000000:3B:00.0", "0000:3b:00") for any "dom:bus:dev.fn" spelling;
    the second is the form the kernel's Xid lines use. ("", "") if unparsable."""
    try:
        domain, bus, devfn = bus_id.strip().split(":")
        device, _, function = devfn.partition(".")
        dom, b, dev, fn = (int(x, 16) for x in (domain, bus, device, function or "0"))
    except ValueError:
        return "", ""
    return f"{dom:08X}:{b:02X}:{dev:02X}.{fn:X}", f"{dom:04x}:{b:02x}:{dev:02x}"


def _gpu(nvml, index: int) -> dict:
    gpu = {"index": index, "uuid": None, "name": None, "pci_bus_id": None,
           "pci_short": None, "ecc_volatile_uncorrected": None,
           "ecc_aggregate_uncorrected": None, "retired_pages_pending": None,
           "remapped_rows_pending": None, "remapped_rows_failure": None,
           "temperature_c": None, "throttle_reasons": None, "nvlink": None,
           "memory_total_bytes": None, "ecc_volatile_corrected": None,
           "ecc_aggregate_corrected": None, "remapped_rows_correctable": None,
           "remapped_rows_uncorrectable": None, "retired_pages_sbe": None,
           "retired_pages_dbe": None, "lost": False, "unsupported": [], "errors": {}}

    def failed(fields, exc) -> None:
        if getattr(exc, "value", None) == nvml.NVML_ERROR_NOT_SUPPORTED:
            gpu["unsupported"].extend(f for f in fields if f not in gpu["unsupported"])
            return
        for name in fields:
            gpu["errors"][name] = str(exc)
        if getattr(exc, "value", None) == nvml.NVML_ERROR_GPU_IS_LOST:
            gpu["lost"] = True

    def read(fields, call, convert=lambda v: v) -> None:
        fields = (fields,) if isinstance(fields, str) else fields
        try:
            values = convert(call())
        except nvml.NVMLError as exc:
            failed(fields, exc)
            return
        if len(fields) == 1:
            values = (values,)
        gpu.update(zip(fields, values))

    try:
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
    except nvml.NVMLError as exc:
        failed(("handle",), exc)
        return gpu
    read("index", lambda: nvml.nvmlDeviceGetIndex(handle), int)
    read("uuid", lambda: nvml.nvmlDeviceGetUUID(handle), _text)
    read("name", lambda: nvml.nvmlDeviceGetName(handle), _text)
    read(("pci_bus_id", "pci_short"), lambda: nvml.nvmlDeviceGetPciInfo(handle),
         lambda info: normalize_bus_id(_text(info.busId)))
    for field, kind, counter in (
            ("ecc_volatile_uncorrected", nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
             nvml.NVML_VOLATILE_ECC),
            ("ecc_aggregate_uncorrected", nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
             nvml.NVML_AGGREGATE_ECC),
            ("ecc_volatile_corrected", nvml.NVML_MEMORY_ERROR_TYPE_CORRECTED,
             nvml.NVML_VOLATILE_ECC),
            ("ecc_aggregate_corrected", nvml.NVML_MEMORY_ERROR_TYPE_CORRECTED,
             nvml.NVML_AGGREGATE_ECC)):
        read(field, lambda k=kind, c=counter: nvml.nvmlDeviceGetTotalEccErrors(handle, k, c),
             int)
    read("retired_pages_pending",
         lambda: nvml.nvmlDeviceGetRetiredPagesPendingStatus(handle), bool)
    for field, cause in (
            ("retired_pages_sbe", nvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS),
            ("retired_pages_dbe", nvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR)):
        read(field, lambda c=cause: nvml.nvmlDeviceGetRetiredPages(handle, c), len)
    read(("remapped_rows_pending", "remapped_rows_failure", "remapped_rows_correctable",
          "remapped_rows_uncorrectable"),
         lambda: nvml.nvmlDeviceGetRemappedRows(handle),
         lambda rows: (bool(rows[2]), bool(rows[3]), int(rows[0]), int(rows[1])))
    read("temperature_c",
         lambda: nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU), int)
    read("throttle_reasons", lambda: _clock_reasons(nvml, handle), int)
    read("memory_total_bytes", lambda: nvml.nvmlDeviceGetMemoryInfo(handle).total, int)
    _nvlinks(nvml, handle, gpu, failed)
    return gpu


def _clock_reasons(nvml, handle) -> int:
    """The newer ClocksEvent name first; older pynvml or drivers lack it."""
    newer = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
    if newer is not None:
        try:
            return newer(handle)
        except nvml.NVMLError as exc:
            if exc.value != nvml.NVML_ERROR_FUNCTION_NOT_FOUND:
                raise
    return nvml.nvmlDeviceGetCurrentClocksThrottleReasons(handle)


def _nvlinks(nvml, handle, gpu: dict, failed) -> None:
    """Links 0.. until NVML says there are no more; None if there are none."""
    links = []
    stop = (nvml.NVML_ERROR_NOT_SUPPORTED, nvml.NVML_ERROR_INVALID_ARGUMENT)
    for link in range(nvml.NVML_NVLINK_MAX_LINKS):
        try:
            active = nvml.nvmlDeviceGetNvLinkState(handle, link)
        except nvml.NVMLError as exc:
            if exc.value not in stop:
                failed(("nvlink",), exc)
                return
            break
        entry = {"link": link, "active": bool(active)}
        for name, counter in _LINK_COUNTERS:
            entry[name] = _link_counter(nvml, handle, link, counter, gpu, failed)
        links.append(entry)
    gpu["nvlink"] = links or None


# the per-link error counters of nvmlNvLinkErrorCounter_t, by the names the report uses
_LINK_COUNTERS = (("replay", 0), ("recovery", 1), ("crc_flit", 2), ("crc_data", 3),
                  ("ecc_data", 4))


def _link_counter(nvml, handle, link: int, counter: int, gpu: dict, failed):
    """One link's counter; None when the link or driver does not keep it."""
    try:
        return int(nvml.nvmlDeviceGetNvLinkErrorCounter(handle, link, counter))
    except nvml.NVMLError as exc:
        failed((f"nvlink_{_LINK_COUNTERS[counter][0]}",), exc)
        return None


def snapshot(library: str = "", state_file: str = "") -> dict:
    """Driver version and per-GPU health; never raises.

    library: load NVML from this path instead of the system's libnvidia-ml.so.1.
    state_file: the fake NVML's state (exported as $RECOVERY_FAKE_NVML_STATE).
    """
    result = {"ok": False, "error": None, "driver": "", "count": 0, "gpus": []}
    if state_file:
        os.environ[STATE_ENV] = state_file
    try:
        import pynvml as nvml
    except ImportError as exc:
        result["error"] = f"pynvml is not installed: {exc}"
        return result
    preloaded = None
    if library:
        path = os.path.abspath(library)
        try:
            preloaded = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError as exc:
            result["error"] = f"cannot load NVML library {path}: {exc}"
            return result
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as exc:
        result["error"] = str(exc)
        return result
    except Exception as exc:   # a broken install must not take the hook down
        result["error"] = f"NVML init failed: {type(exc).__name__}: {exc}"
        return result
    try:
        loaded = getattr(nvml, "nvmlLib", None)
        if preloaded is not None and getattr(loaded, "_handle", None) != preloaded._handle:
            result["error"] = (f"pynvml is using another libnvidia-ml.so.1 than {library} "
                               "(one was already loaded in this process)")
            return result
        result["driver"] = _text(nvml.nvmlSystemGetDriverVersion())
        count = nvml.nvmlDeviceGetCount()
        result["gpus"] = [_gpu(nvml, index) for index in range(count)]
        result["count"] = count
        result["ok"] = True
    except nvml.NVMLError as exc:
        result["error"] = str(exc)
    except Exception as exc:
        result["error"] = f"NVML query failed: {type(exc).__name__}: {exc}"
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:
            pass
    return result
