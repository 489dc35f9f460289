"""Accelerator profiles for the roofline cost model: peak dense BF16 tensor
FLOP/s, memory bandwidth and memory size, from the vendors' datasheets.

Datasheets quote tensor FLOP/s "with sparsity" (2:4 structured) as the
headline; the dense figure, which is what a transformer's matmuls get, is
half of it. Achieved fractions of these peaks are the cost model's
efficiencies, not part of the hardware.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    flops_per_s: float  # peak dense BF16 tensor FLOP/s
    memory_bandwidth_bytes_per_s: float
    memory_bytes: int
    source: str = ""

    def __post_init__(self) -> None:
        if self.flops_per_s <= 0 or self.memory_bandwidth_bytes_per_s <= 0 or self.memory_bytes <= 0:
            raise ValueError(f"hardware {self.name!r}: FLOP/s, bandwidth and memory must be > 0")


HARDWARE: dict[str, HardwareProfile] = {
    # NVIDIA H100 Tensor Core GPU datasheet, SXM5: BF16 Tensor Core 1,979 TFLOPS
    # with sparsity (989 dense), GPU memory 80 GB HBM3, bandwidth 3.35 TB/s.
    "h100": HardwareProfile("h100", 989e12, 3.35e12, 80 * 10**9,
                            "NVIDIA H100 datasheet (SXM5): 1979 TFLOPS BF16 sparse, 3.35 TB/s, 80 GB"),
    # NVIDIA H200 Tensor Core GPU datasheet, SXM: BF16 Tensor Core 1,979 TFLOPS
    # with sparsity (989 dense; same GH100 compute as H100), 141 GB HBM3e, 4.8 TB/s.
    "h200": HardwareProfile("h200", 989e12, 4.8e12, 141 * 10**9,
                            "NVIDIA H200 datasheet (SXM): 1979 TFLOPS BF16 sparse, 4.8 TB/s, 141 GB"),
    # NVIDIA A100 Tensor Core GPU datasheet, 80GB SXM: BF16 Tensor Core 312
    # TFLOPS dense (624 with sparsity), 80 GB HBM2e at 2,039 GB/s.
    "a100": HardwareProfile("a100", 312e12, 2.039e12, 80 * 10**9,
                            "NVIDIA A100 datasheet (80GB SXM): 312 TFLOPS BF16 dense, 2039 GB/s, 80 GB"),
    # NVIDIA L4 Tensor Core GPU datasheet: BF16 Tensor Core 242 TFLOPS with
    # sparsity (121 dense), 24 GB GDDR6 at 300 GB/s.
    "l4": HardwareProfile("l4", 121e12, 0.3e12, 24 * 10**9,
                          "NVIDIA L4 datasheet: 242 TFLOPS BF16 sparse, 300 GB/s, 24 GB"),
}


def hardware_preset(name: str) -> HardwareProfile:
    key = name.strip().lower()
    if key not in HARDWARE:
        raise ValueError(f"unknown hardware {name!r}; known: {', '.join(sorted(HARDWARE))} "
                         "(or a profile JSON path from `kvserve profile`)")
    return HARDWARE[key]
