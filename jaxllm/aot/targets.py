"""The chips `jaxllm compile` compiles for, and how to get their compilers on this machine.

A target is a TPU slice (`v5e-1`, `v5e-4`, `v5e-8`, `v6e-1`, `v6e-4`, `v6e-8`, `v5p-8`, `v4-8`,
and the multi-host slices `v5e-16`, `v5e-32`, `v6e-16`, `v6e-32`, `v5p-16`, `v5p-32`, which
`jaxllm serve` runs with a process per host, `jaxllm.engine.multihost`) or one host of NVIDIA
GPUs (`h100`, `h200`, `h100x8`, `h200x4`, ...). Its devices are
compile-only devices from `jax.experimental.topologies`: libtpu (`pip install "jax[tpu]"`)
compiles for the TPUs and the CUDA plugin (jax-cuda12-plugin and jax-cuda12-pjrt, with ptxas
from nvidia-cuda-nvcc-cu12) for the GPUs, both on a machine without them.

The figures per chip are the vendors' published ones: HBM capacity, HBM bandwidth, and dense
bfloat16 and int8 peaks (per TPU chip: one device on v5e and v6e, a megacore of two
TensorCores on v4 and v5p; TPU slice names count chips on v5e and v6e and TensorCores on v4 and
v5p). They are what the roofline predictions divide by; they are not measurements.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
import re

import jax

from jaxllm.worker import gpu_pool_fraction

_GIB = 2**30
_MIB = 2**20


@dataclasses.dataclass(frozen=True)
class Chip:
    name: str  # v5e, h100, ...
    platform: str  # "tpu" or "cuda"
    device_kind: str  # what jax.Device.device_kind says of it
    memory_bytes: int  # HBM per device
    hbm_bytes_per_s: float
    bf16_flops: float  # dense peak per device
    int8_ops: float  # dense int8 (TPU) / fp8 (GPU) peak per device
    counts: tuple[int, ...]  # the device counts a target may name (TPUs: past one host too)
    cores_per_chip: int = 1  # TensorCores per chip (a v4 or v5p slice name counts these)
    # The HBM a program may use where it is less than `memory_bytes`: on a TPU, what XLA:TPU
    # says is available when it refuses a program too large (libtpu for jax 0.10.2: "exceeds
    # available HBM (15.75G)" on v5e); the runtime keeps the rest.
    program_bytes: int | None = None

    def target_name(self, count: int) -> str:
        """What `--target` calls `count` of these devices: h100, h100x8, v5e-4, v5p-8 (a v4 or
        v5p slice counts TensorCores)."""
        if self.platform == "cuda":
            return self.name if count == 1 else f"{self.name}x{count}"
        return f"{self.name}-{count * self.cores_per_chip}"


CHIPS = {
    c.name: c
    for c in (
        Chip(
            "v5e",
            "tpu",
            "TPU v5 lite",
            16 * _GIB,
            819e9,
            197e12,
            394e12,
            (1, 4, 8, 16, 32),
            1,
            int(15.75 * _GIB),
        ),
        Chip(
            "v6e",
            "tpu",
            "TPU v6 lite",
            32 * _GIB,
            1640e9,
            918e12,
            1836e12,
            (1, 4, 8, 16, 32),
            1,
            int(31.25 * _GIB),
        ),
        Chip("v5p", "tpu", "TPU v5", 95 * _GIB, 2765e9, 459e12, 918e12, (1, 4, 8, 16), 2),
        Chip(
            "v4", "tpu", "TPU v4", 32 * _GIB, 1228e9, 275e12, 275e12, (1, 4), 2, int(15.25 * _GIB)
        ),
        # nvidia-smi's totals for the 80 GB and 141 GB parts; 3.35 and 4.8 TB/s; 989 dense
        # bf16 TFLOP/s and twice that in fp8 (SXM).
        Chip(
            "h100",
            "cuda",
            "NVIDIA H100 80GB HBM3",
            81559 * _MIB,
            3.35e12,
            989e12,
            1979e12,
            (1, 2, 4, 8),
        ),
        Chip("h200", "cuda", "NVIDIA H200", 143771 * _MIB, 4.8e12, 989e12, 1979e12, (1, 2, 4, 8)),
    )
}

# The topology whose devices a TPU target takes (the first `count` of them): at least a host,
# since libtpu refuses topologies smaller ("v5e:1x1"); past 4 (v5p) or 8 chips, several hosts
# (libtpu describes them offline, with each device's process).
_TPU_TOPOLOGY = {
    ("v5e", 1): "v5e:2x2",
    ("v5e", 4): "v5e:2x2",
    ("v5e", 8): "v5e:2x4",
    ("v5e", 16): "v5e:4x4",
    ("v5e", 32): "v5e:4x8",
    ("v6e", 1): "v6e:2x2",
    ("v6e", 4): "v6e:2x2",
    ("v6e", 8): "v6e:2x4",
    ("v6e", 16): "v6e:4x4",
    ("v6e", 32): "v6e:4x8",
    ("v5p", 1): "v5p:2x2x1",
    ("v5p", 4): "v5p:2x2x1",
    ("v5p", 8): "v5p:2x2x2",
    ("v5p", 16): "v5p:2x2x4",
    ("v4", 1): "v4:2x2x1",
    ("v4", 4): "v4:2x2x1",
}

# A GPU as XLA's compiler needs it described when none is present (`GpuTargetConfig`), from
# NVIDIA's specifications of the SXM parts (compute capability 9.0, 132 SMs, 227 KiB of shared
# memory a block may opt into).
_GPU_TARGET_CONFIG = """gpu_device_info {{
  cuda_compute_capability {{ major: 9 minor: 0 }}
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132
  fpus_per_core: 128 block_dim_limit_x: 2147483647 block_dim_limit_y: 65535
  block_dim_limit_z: 65535 memory_bandwidth: {bandwidth} l2_cache_size: {l2}
  clock_rate_ghz: 1.98 device_memory_size: {memory} shared_memory_per_block_optin: 232448
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 1 }}
device_description_str: "{kind}"
"""


@dataclasses.dataclass(frozen=True)
class Target:
    name: str  # as given: v5e-4, h100x8, ...
    chip: Chip
    num_devices: int

    @property
    def platform(self) -> str:
        return self.chip.platform

    def limit_bytes(self, memory_utilization: float) -> int:
        """Device memory JAX lets the engine's programs use, as `jaxllm serve` on the target
        would see it in its memory stats: on a TPU what XLA:TPU allows (`program_bytes`, a
        little under the chip's HBM); on a GPU the pool JAX preallocates, which serve sets to
        `memory_utilization` of the memory (XLA_PYTHON_CLIENT_MEM_FRACTION where set, see
        `jaxllm.worker.kv_sizing.preallocate_gpu_memory`)."""
        if self.platform != "cuda":
            return self.chip.program_bytes or self.chip.memory_bytes
        return int(self.chip.memory_bytes * gpu_pool_fraction(memory_utilization))

    def devices(self) -> list[jax.Device]:
        """The target's compile-only devices (needs its compiler: libtpu, or the CUDA
        plugin)."""
        return list(_topology_devices(self.chip.name, self.num_devices)[: self.num_devices])


def parse_target(text: str) -> Target:
    """`v5e-4`, `v6e-1`, `v5p-8` (TensorCores), `h100`, `h200x8`, ... -> Target."""
    name = text.strip().lower()
    m = re.fullmatch(r"(v5e|v6e|v5p|v4)-(\d+)", name) or re.fullmatch(
        r"(h100|h200)(?:x(\d+))?", name
    )
    if m is None:
        raise ValueError(f"--target must be a TPU slice or a GPU host; got {text!r}. {choices()}")
    chip = CHIPS[m.group(1)]
    count = int(m.group(2) or 1)
    if chip.cores_per_chip > 1:
        if count % chip.cores_per_chip:
            raise ValueError(
                f"--target {text}: {chip.name} slices are named by TensorCores, "
                f"{chip.cores_per_chip} per chip (e.g. {chip.name}-8 is 4 chips)"
            )
        count //= chip.cores_per_chip
    if count not in chip.counts:
        raise ValueError(
            f"--target {text}: {chip.name} targets have "
            f"{', '.join(map(str, chip.counts))} devices. {choices()}"
        )
    return Target(text, chip, count)


def choices() -> str:
    names = [chip.target_name(n) for chip in CHIPS.values() for n in chip.counts]
    return "Targets: " + ", ".join(names) + "."


@functools.cache
def _topology_devices(chip_name: str, count: int) -> tuple[jax.Device, ...]:
    from jax.experimental import topologies

    chip = CHIPS[chip_name]
    if chip.platform == "tpu":
        _check_installed("libtpu", f'"jax[tpu]=={jax.__version__}"')
        # libtpu locks /tmp/libtpu_lockfile for the machine's TPU chips; compile-only devices
        # use none, so a second compile on this machine (a test beside a benchmark) may load it.
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
        topology = topologies.get_topology_desc(
            platform="tpu", topology_name=_TPU_TOPOLOGY[chip.name, count]
        )
        return tuple(topology.devices)
    _check_installed(
        "jax_cuda12_plugin",
        f"jax-cuda12-plugin=={jax.__version__} jax-cuda12-pjrt=={jax.__version__} "
        '"nvidia-cuda-nvcc-cu12>=12.6.85" (or "jax[cuda12]")',
    )
    config = _GPU_TARGET_CONFIG.format(
        bandwidth=int(chip.hbm_bytes_per_s),
        l2=50 * _MIB,
        memory=chip.memory_bytes,
        kind=chip.device_kind,
    )
    topology = topologies.get_topology_desc(
        "cuda", platform="cuda", topology=f"1x1x{count}", target_config=config
    )
    return tuple(topology.devices)


def _check_installed(module: str, packages: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise ValueError(
            f"compiling for this target needs its compiler, which is not installed: pip install "
            f"{packages} (`make compile-env` builds .venv-compile with the TPU and GPU ones)"
        )
