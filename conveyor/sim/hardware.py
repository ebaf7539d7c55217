"""The hardware catalog: peak dense tensor FLOP/s, memory bandwidth and capacity, with sources.

Figures are the vendors' datasheet numbers for dense (not 2:4 sparse) 16-bit tensor math, the
precision a GPU serves in. Memory sizes are the marketed GB taken as GiB, which is what
`nvidia-smi` reports to within 1-2% (an A100-40GB shows 40960 MiB). `cpu` is not in the
catalog: `conveyor calibrate` measures this machine and saves it (see calibrate.py).
"""

from __future__ import annotations

from dataclasses import dataclass

GiB = 1 << 30


@dataclass(frozen=True)
class Hardware:
    name: str
    description: str
    peak_flops: float  # dense FLOP/s in the compute dtype
    mem_bandwidth: float  # bytes/s of device memory
    memory_bytes: int
    host_bandwidth: float  # bytes/s between device and host memory (swap)
    dtype_bytes: int = 2  # bfloat16 on a GPU, float32 on a CPU
    is_gpu: bool = True
    source: str = ""
    # Bytes/s each way between two devices of one machine (NVLink), what tensor parallelism's
    # all-reduces cross; 0: none listed, they go over the host link (PCIe).
    link_bandwidth: float = 0.0
    # Dense FP8 tensor FLOP/s (Hopper, Ada); 0: no FP8 tensor cores, so FP8 weights are read as
    # bytes and multiplied in 16-bit (a weight-only kernel, as vLLM's Marlin FP8 on Ampere).
    fp8_flops: float = 0.0
    # Bytes/s to and from the machine's local disk (KV offloading's disk tier). No catalog entry
    # lists one: assumed a datacenter NVMe SSD on PCIe 4.0 (5-7 GB/s sequential read, 4-5 GB/s
    # write in vendors' datasheets), 4 GB/s either way.
    disk_bandwidth: float = 4e9

    @property
    def peer_bandwidth(self) -> float:
        return self.link_bandwidth or self.host_bandwidth

    def __post_init__(self) -> None:
        if min(self.peak_flops, self.mem_bandwidth, self.host_bandwidth) <= 0 or self.memory_bytes <= 0:
            raise ValueError(f"{self.name}: FLOP/s, bandwidths and memory must be positive")

    @property
    def ridge_point(self) -> float:
        """FLOPs per byte above which a kernel is compute-bound (the roofline's ridge)."""
        return self.peak_flops / self.mem_bandwidth


T, G = 1e12, 1e9
PCIE4, PCIE5 = 32 * G, 64 * G  # x16, per direction

HARDWARE: dict[str, Hardware] = {
    h.name: h
    for h in (
        Hardware("h100-sxm", "NVIDIA H100 SXM5 80GB", 989 * T, 3350 * G, 80 * GiB, PCIE5,
                 source="NVIDIA H100 datasheet, https://www.nvidia.com/en-us/data-center/h100/ "
                 "(BF16 Tensor 1,979 TFLOPS with sparsity, so 989 dense; HBM3 3.35 TB/s; "
                 "NVLink 900 GB/s, so 450 each way; FP8 Tensor 3,958 with sparsity, so 1,979 dense)",
                 link_bandwidth=450 * G, fp8_flops=1979 * T),
        Hardware("h200", "NVIDIA H200 SXM 141GB", 989 * T, 4800 * G, 141 * GiB, PCIE5,
                 source="NVIDIA H200 datasheet, https://www.nvidia.com/en-us/data-center/h200/ "
                 "(BF16 Tensor 1,979 TFLOPS with sparsity; HBM3e 4.8 TB/s; NVLink 900 GB/s; "
                 "FP8 Tensor 3,958 with sparsity)", link_bandwidth=450 * G, fp8_flops=1979 * T),
        Hardware("a100-40gb", "NVIDIA A100 SXM4 40GB", 312 * T, 1555 * G, 40 * GiB, PCIE4,
                 source="NVIDIA A100 datasheet, https://www.nvidia.com/en-us/data-center/a100/ "
                 "(BF16 Tensor 312 TFLOPS dense; HBM2 1,555 GB/s; NVLink 600 GB/s, so 300 each way)",
                 link_bandwidth=300 * G),
        Hardware("a100-80gb", "NVIDIA A100 SXM4 80GB", 312 * T, 2039 * G, 80 * GiB, PCIE4,
                 source="NVIDIA A100 datasheet, https://www.nvidia.com/en-us/data-center/a100/ "
                 "(BF16 Tensor 312 TFLOPS dense; HBM2e 2,039 GB/s; NVLink 600 GB/s)", link_bandwidth=300 * G),
        Hardware("a10g", "NVIDIA A10G 24GB (AWS G5)", 70 * T, 600 * G, 24 * GiB, PCIE4,
                 source="Baseten, 'NVIDIA A10 vs A10G for ML model inference', "
                 "https://www.baseten.co/blog/nvidia-a10-vs-a10g-for-ml-model-inference/ "
                 "(70 TFLOPS tensor, 600 GB/s GDDR6)"),
        Hardware("l4", "NVIDIA L4 24GB", 121 * T, 300 * G, 24 * GiB, PCIE4,
                 source="NVIDIA L4 datasheet, https://www.nvidia.com/en-us/data-center/l4/ "
                 "(FP16 Tensor 242 TFLOPS with sparsity, so 121 dense; 300 GB/s; FP8 485 with "
                 "sparsity, so 242.5 dense)", fp8_flops=242.5 * T),
        Hardware("rtx-a6000", "NVIDIA RTX A6000 48GB", 154.8 * T, 768 * G, 48 * GiB, PCIE4,
                 source="NVIDIA RTX A6000 datasheet, https://www.nvidia.com/en-us/design-visualization/rtx-a6000/ "
                 "(Tensor 309.7 TFLOPS with sparsity, so 154.8 dense; 768 GB/s GDDR6)"),
        Hardware("rtx-4070-laptop", "NVIDIA GeForce RTX 4070 Laptop 8GB", 36.9 * T, 256 * G, 8 * GiB, 16 * G,
                 source="NVIDIA spec table, https://www.nvidia.com/en-us/geforce/laptops/40-series/ "
                 "(4,608 CUDA cores, boost up to 2,175 MHz by power limit, 8 GB GDDR6 at 128 bit x 16 Gbps "
                 "= 256 GB/s, PCIe 4.0 x8). Tensor rate derived, not published: 4,608 x 2 FLOP x 2.0 GHz "
                 "x 2 (the Ada whitepaper's FP16-with-FP32-accumulate to FP32 ratio for GeForce)"),
    )
}


def hardware_names() -> list[str]:
    return [*sorted(HARDWARE), "cpu"]


def get_hardware(name: str) -> Hardware:
    h = HARDWARE.get(name.lower())
    if h is None:
        raise ValueError(f"unknown hardware {name!r}: use one of {', '.join(hardware_names())}")
    return h
