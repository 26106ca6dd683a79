"""Sampling the PCIe link a streamed model's copies cross (``LinkSampler``: the load other processes
put on it, through NVML) and the SM clock that turns stall time into cycles."""
from __future__ import annotations

import logging
import threading
import time

from ..cuda import pcie_capacity
from ..prefetch import NVML_SAMPLE_S, other_link_load

log = logging.getLogger("deepseek_flash.stream")

# Nominal clock for fabric_stall_cycles where NVML cannot tell the SM clock.
NOMINAL_CLOCK_MHZ = 1000


class LinkSampler:
    """How busy the PCIe link is with traffic that is not this client's streaming.

    A background thread reads the device's PCIe receive rate from NVML every ``sample_s`` (each
    reading covers NVML's last 20 ms) and, every ``interval`` seconds, compares their mean with
    the bytes this client's copies *completed* over the same interval (``completed_bytes``, from
    the copy events): ``prefetch.other_link_load`` of the two is ``load`` (None until the first
    interval, where too few readings came in, or without NVML). Bytes merely issued would count
    copies still queued; one short reading against a long average would read our own bursts as
    someone else's traffic -- both made the window shrink with nothing else on the link.
    """

    def __init__(self, device: int, completed_bytes, interval: float = 0.5,
                 sample_s: float = NVML_SAMPLE_S, nvml=None):
        self.load: float | None = None
        self._completed = completed_bytes        # callable: bytes this client's copies completed
        self._interval = interval
        self._sample_s = sample_s
        self._stop = threading.Event()
        self._nvml = nvml
        self._device = device
        self._thread = threading.Thread(target=self._run, daemon=True, name="flash-link-sampler")

    def start(self) -> LinkSampler:
        self._thread.start()
        return self

    def _open(self):
        if self._nvml is None:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
        nv = self._nvml
        handle = nv.nvmlDeviceGetHandleByIndex(self._device)
        return handle, pcie_capacity(nv, handle)

    def read_rx(self, handle) -> float:
        """One NVML reading: the receive rate over its last 20 ms, bytes/s."""
        nv = self._nvml
        return nv.nvmlDeviceGetPcieThroughput(handle, nv.NVML_PCIE_UTIL_RX_BYTES) * 1024.0  # KB/s

    def close_interval(self, rx_rates, own_bytes: int, seconds: float, capacity) -> None:
        """End one interval: ``load`` from its readings and the bytes we completed in it."""
        self.load = other_link_load(rx_rates, own_bytes, seconds, capacity, self._sample_s)

    def _run(self) -> None:
        try:
            handle, capacity = self._open()
        except Exception as exc:   # noqa: BLE001 -- NVML absent or refusing (its own error types):
            log.debug("PCIe load not sampled: %s", exc)   # the window then ignores the link
            return
        mark, t = self._completed(), time.monotonic()
        rates: list[float] = []
        while not self._stop.wait(self._sample_s):
            try:
                rates.append(self.read_rx(handle))
            except Exception as exc:   # noqa: BLE001 -- a sampler thread must outlive NVML hiccups
                log.debug("PCIe sample failed: %s", exc)
            now = time.monotonic()
            if now - t >= self._interval:
                done = self._completed()
                self.close_interval(rates, done - mark, now - t, capacity)
                mark, t, rates = done, now, []

    def stop(self) -> None:
        self._stop.set()


def _sm_clock_mhz() -> int:
    try:
        import pynvml
    except ImportError:
        return NOMINAL_CLOCK_MHZ
    try:
        pynvml.nvmlInit()
        return int(pynvml.nvmlDeviceGetClockInfo(pynvml.nvmlDeviceGetHandleByIndex(0),
                                                 pynvml.NVML_CLOCK_SM)) or NOMINAL_CLOCK_MHZ
    except pynvml.NVMLError:   # no GPU or no driver: the nominal clock (docs/architecture.md)
        return NOMINAL_CLOCK_MHZ
